"""A KV cache for continuous batching with transformers models.

Rows of the running batch are *left-padded* to one common length ``L``; a
boolean ``pad_mask`` of shape ``[B, L]`` marks real tokens. Keys and values of
each layer live in a preallocated buffer ``[batch_capacity, kv_heads,
seq_capacity, head_dim]`` of which rows ``[0, B)`` and columns ``[start, end)``
are live, so that:

* a decode step writes one column in place (no copy of the whole cache, unlike
  ``DynamicCache``'s ``torch.cat``); buffers grow by doubling when full;
* removing finished rows moves the last live rows into their slots (one row
  copied per removed row) and shrinks ``B``: :meth:`PaddedBatchCache.remove_rows`
  returns the new row order;
* trimming leading all-padding columns moves ``start`` (free);
* newcomers are appended into free rows, left-padded to ``L`` (or the running
  rows are left-extended with padding when the newcomers are longer).

Padding columns always hold finite values (zeros, or the states of padded prompt
positions), so masked attention never meets a NaN. The model is called with an
explicit 4-D boolean mask built by :meth:`PaddedBatchCache.extend` and with
per-row position ids, so transformers' own padding heuristics never run.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache, DynamicLayer

_MIN_HEADROOM = 32


def cache_kwarg(model: torch.nn.Module) -> str:
    """The keyword a transformers model takes its cache by: ``cache`` (transformers >= 5.20) or
    ``past_key_values`` (earlier; vLLM's CPU build pins transformers < 5.20, and the torch engine runs
    beside it there)."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class CacheMergeError(ValueError):
    """Two caches cannot be merged (different models, dtypes or devices)."""


class _PaddedLayer(DynamicLayer):
    """One layer's keys/values in a growable buffer; ``keys``/``values`` are the live window."""

    def __init__(self, batch_capacity: int = 0) -> None:
        super().__init__()
        self.batch_capacity = batch_capacity
        self.kbuf: torch.Tensor | None = None
        self.vbuf: torch.Tensor | None = None
        self.rows = self.start = self.end = 0

    def _refresh(self) -> None:
        self.keys = self.kbuf[: self.rows, :, self.start : self.end]
        self.values = self.vbuf[: self.rows, :, self.start : self.end]

    def _allocate(self, like_k: torch.Tensor, like_v: torch.Tensor, rows: int, columns: int) -> None:
        batch_capacity = max(rows, self.batch_capacity)
        capacity = columns + max(_MIN_HEADROOM, columns)
        self.kbuf = like_k.new_empty((batch_capacity, like_k.shape[1], capacity, like_k.shape[-1]))
        self.vbuf = like_v.new_empty((batch_capacity, like_v.shape[1], capacity, like_v.shape[-1]))
        self.device = like_k.device
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._allocate(key_states, value_states, key_states.shape[0], key_states.shape[-2])
        self.rows, self.start, self.end = key_states.shape[0], 0, 0

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q_len = key_states.shape[-2]
        if self.end + q_len > self.kbuf.shape[-2]:
            self._relayout(self.end - self.start + q_len, self.rows)
        self.kbuf[: self.rows, :, self.end : self.end + q_len] = key_states
        self.vbuf[: self.rows, :, self.end : self.end + q_len] = value_states
        self.end += q_len
        self._refresh()
        return self.keys, self.values

    def _relayout(self, columns: int, rows: int) -> None:
        """Reallocate for ``rows`` rows and ``columns`` columns; live data is kept right-aligned at ``columns``."""
        old_k, old_v = self.kbuf[: self.rows, :, self.start : self.end], self.vbuf[: self.rows, :, self.start : self.end]
        length = self.end - self.start
        self._allocate(old_k, old_v, rows, columns)
        self.kbuf[: self.rows, :, :length] = old_k
        self.vbuf[: self.rows, :, :length] = old_v
        self.start, self.end = 0, length

    def get_seq_length(self) -> int:
        return self.end - self.start if self.is_initialized else 0

    def move_rows(self, src: torch.Tensor, dst: torch.Tensor, rows: int) -> None:
        """Copy live rows ``src`` into slots ``dst``, then keep the first ``rows`` rows."""
        if src.numel():
            for buf in (self.kbuf, self.vbuf):
                window = buf[:, :, self.start : self.end]
                window.index_copy_(0, dst, window.index_select(0, src))
        self.rows = rows
        if rows == 0:
            self.start = self.end = 0
        self._refresh()

    def trim_left(self, columns: int) -> None:
        self.start += columns
        self._refresh()

    def append_rows(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append rows (``[n, H, Ln, D]``), left-padding whichever side is shorter with zeros."""
        n, new_len = keys.shape[0], keys.shape[-2]
        if not self.is_initialized:
            self._allocate(keys, values, n, new_len)
        length = self.end - self.start
        merged = max(length, new_len)
        if self.rows == 0:
            self.start = self.end = 0
            new_start, new_end = 0, merged
        else:
            new_start, new_end = self.end - merged, self.end
        if self.rows + n > self.kbuf.shape[0] or new_start < 0 or new_end > self.kbuf.shape[-2]:
            # reallocate, the live rows right-aligned at ``merged`` behind zero padding
            old_k = self.kbuf[: self.rows, :, self.start : self.end]
            old_v = self.vbuf[: self.rows, :, self.start : self.end]
            self._allocate(old_k, old_v, self.rows + n, merged)
            for buf, old in ((self.kbuf, old_k), (self.vbuf, old_v)):
                buf[: self.rows, :, : merged - length].zero_()
                buf[: self.rows, :, merged - length : merged] = old
            new_start, new_end = 0, merged
        elif self.rows and merged > length:  # extend the running rows to the left with padding
            self.kbuf[: self.rows, :, new_start : self.start].zero_()
            self.vbuf[: self.rows, :, new_start : self.start].zero_()
        self.start, self.end = new_start, new_end
        lo, hi = self.rows, self.rows + n
        for buf, new in ((self.kbuf, keys), (self.vbuf, values)):
            buf[lo:hi, :, self.start : self.end - new_len].zero_()
            buf[lo:hi, :, self.end - new_len : self.end] = new
        self.rows = hi
        self._refresh()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("use PaddedBatchCache.remove_rows")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("PaddedBatchCache does not support beam search")


class PaddedBatchCache(Cache):
    """The KV cache and padding mask of a left-padded batch of independent sequences.

    ``batch_capacity`` preallocates room for that many rows (the engine's
    ``max_batch_size``), so appending newcomers rarely reallocates.
    """

    def __init__(self, num_layers: int, batch_capacity: int = 0) -> None:
        super().__init__(layers=[_PaddedLayer(batch_capacity) for _ in range(num_layers)])
        self.pad_mask: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return 0 if self.pad_mask is None else self.pad_mask.shape[0]

    @property
    def seq_length(self) -> int:
        """Common (padded) length ``L`` of every row."""
        return 0 if self.pad_mask is None else self.pad_mask.shape[1]

    def extend(self, new_valid: torch.Tensor) -> torch.Tensor | None:
        """Append ``q`` columns (``new_valid``: bool ``[B, q]``, False = padding) to the mask.

        Returns the 4-D boolean attention mask ``[B, 1, q, L + q]`` for a forward
        pass over those ``q`` query positions: causal, blind to padding, and with
        every query attending at least to itself (so padded queries stay finite).
        """
        q_len = new_valid.shape[1]
        old_len = self.seq_length
        if self.pad_mask is None:
            self.pad_mask = new_valid.clone()
        else:
            self.pad_mask = torch.cat([self.pad_mask, new_valid], dim=1)
        if q_len == 1:
            return self.pad_mask[:, None, None, :]
        device = new_valid.device
        q_pos = torch.arange(old_len, old_len + q_len, device=device)[:, None]
        k_pos = torch.arange(old_len + q_len, device=device)[None, :]
        mask = (k_pos <= q_pos)[None] & self.pad_mask[:, None, :]  # causal and not padding: [B, q, L + q]
        mask |= (k_pos == q_pos)[None]
        return mask[:, None]

    def remove_rows(self, removed: Sequence[int]) -> list[int]:
        """Drop rows ``removed``; returns the old index of each remaining row, in the new row order.

        Rows from the end of the batch move into the freed slots (one row copied
        per removed row); callers reorder their per-row state the same way.
        """
        batch = self.batch_size
        gone = set(removed)
        rows = batch - len(gone)
        holes = sorted(i for i in gone if i < rows)
        fillers = [j for j in range(rows, batch) if j not in gone]
        order = list(range(rows))
        for hole, filler in zip(holes, fillers, strict=True):
            order[hole] = filler
        device = self.pad_mask.device
        src = torch.tensor(fillers, dtype=torch.long, device=device)
        dst = torch.tensor(holes, dtype=torch.long, device=device)
        for layer in self.layers:
            layer.move_rows(src, dst, rows)
        self.pad_mask = self.pad_mask.index_select(0, torch.tensor(order, dtype=torch.long, device=device))
        if rows == 0:
            self.pad_mask = self.pad_mask[:, :0]
        return order

    def trim_leading_padding(self) -> int:
        """Drop leading columns that are padding in every row; returns how many were dropped."""
        if self.batch_size == 0:
            return 0
        any_real = self.pad_mask.any(dim=0)
        first = int(any_real.to(torch.int8).argmax())
        if first > 0 and bool(any_real[first]):
            for layer in self.layers:
                layer.trim_left(first)
            self.pad_mask = self.pad_mask[:, first:]
            return first
        return 0

    def append(self, other: PaddedBatchCache, rows: torch.Tensor | None = None) -> None:
        """Append the rows of ``other`` (e.g. freshly prefilled newcomers) after this cache's rows.

        ``rows`` (1-D long tensor) appends ``other``'s rows in that order instead, repeats
        allowed: requests sharing a prompt are prefilled once and copied.
        """
        if len(self.layers) != len(other.layers):
            raise CacheMergeError(f"cannot merge caches of {len(self.layers)} and {len(other.layers)} layers")
        for i, (mine, theirs) in enumerate(zip(self.layers, other.layers, strict=True)):
            if mine.is_initialized and (mine.kbuf.dtype != theirs.keys.dtype or mine.kbuf.device != theirs.keys.device):
                raise CacheMergeError(f"layer {i}: cannot merge {mine.kbuf.dtype}/{mine.kbuf.device} with "
                                      f"{theirs.keys.dtype}/{theirs.keys.device}")
            if rows is None:
                mine.append_rows(theirs.keys, theirs.values)
            else:
                mine.append_rows(theirs.keys.index_select(0, rows), theirs.values.index_select(0, rows))
        other_mask = other.pad_mask if rows is None else other.pad_mask.index_select(0, rows)
        length = max(self.seq_length, other.seq_length)
        mask = other_mask.new_zeros((self.batch_size + other_mask.shape[0], length))
        if self.batch_size:
            mask[: self.batch_size, length - self.seq_length :] = self.pad_mask
        mask[self.batch_size :, length - other.seq_length :] = other_mask
        self.pad_mask = mask
