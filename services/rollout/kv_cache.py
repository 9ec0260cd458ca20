"""A KV cache for continuous batching with transformers models.

Rows of the running batch are *left-padded* to one common length ``L``; a
boolean ``pad_mask`` of shape ``[B, L]`` marks real tokens. Keys and values of
each layer live in a preallocated buffer ``[B, kv_heads, capacity, head_dim]``
of which the window ``[start, end)`` is in use, so that:

* a decode step writes one column in place (no copy of the whole cache, unlike
  ``DynamicCache``'s ``torch.cat``); the buffer grows by doubling;
* trimming leading all-padding columns moves ``start`` (free);
* removing finished rows is one ``index_select`` along the batch axis;
* newcomers are merged by left-padding both sides to the longer length.

Padding columns always hold finite values (zeros, or the states of padded prompt
positions), so masked attention never meets a NaN. The model is called with an
explicit 4-D boolean mask built by :meth:`PaddedBatchCache.extend` and with
per-row position ids, so transformers' own padding heuristics never run.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

_MIN_HEADROOM = 32


class _PaddedLayer(DynamicLayer):
    """One layer's keys/values in a growable buffer; ``keys``/``values`` are the live window."""

    def __init__(self) -> None:
        super().__init__()
        self.kbuf: torch.Tensor | None = None
        self.vbuf: torch.Tensor | None = None
        self.start = 0
        self.end = 0

    @classmethod
    def from_buffers(cls, kbuf: torch.Tensor, vbuf: torch.Tensor, start: int, end: int) -> _PaddedLayer:
        layer = cls()
        layer.kbuf, layer.vbuf, layer.start, layer.end = kbuf, vbuf, start, end
        layer.device = kbuf.device
        layer.is_initialized = True
        layer._refresh()
        return layer

    def _refresh(self) -> None:
        self.keys = self.kbuf[:, :, self.start : self.end]
        self.values = self.vbuf[:, :, self.start : self.end]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, q_len, head_dim = key_states.shape
        capacity = q_len + max(_MIN_HEADROOM, q_len)
        self.kbuf = key_states.new_empty((batch, heads, capacity, head_dim))
        self.vbuf = value_states.new_empty((batch, heads, capacity, value_states.shape[-1]))
        self.start = self.end = 0
        self.device = key_states.device
        self.is_initialized = True

    def _grow(self, needed: int) -> None:
        length = self.end - self.start
        capacity = length + needed + max(_MIN_HEADROOM, length)
        kbuf = self.kbuf.new_empty((*self.kbuf.shape[:2], capacity, self.kbuf.shape[-1]))
        vbuf = self.vbuf.new_empty((*self.vbuf.shape[:2], capacity, self.vbuf.shape[-1]))
        kbuf[:, :, :length] = self.kbuf[:, :, self.start : self.end]
        vbuf[:, :, :length] = self.vbuf[:, :, self.start : self.end]
        self.kbuf, self.vbuf, self.start, self.end = kbuf, vbuf, 0, length

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q_len = key_states.shape[-2]
        if self.end + q_len > self.kbuf.shape[-2]:
            self._grow(q_len)
        self.kbuf[:, :, self.end : self.end + q_len] = key_states
        self.vbuf[:, :, self.end : self.end + q_len] = value_states
        self.end += q_len
        self._refresh()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.end - self.start if self.is_initialized else 0

    def select_rows(self, rows: torch.Tensor) -> None:
        self.kbuf = self.kbuf.index_select(0, rows)
        self.vbuf = self.vbuf.index_select(0, rows)
        self._refresh()

    def trim_left(self, columns: int) -> None:
        self.start += columns
        self._refresh()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.select_rows(indices)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.select_rows(beam_idx)


class CacheMergeError(ValueError):
    """Two caches cannot be merged (different models, dtypes or devices)."""


class PaddedBatchCache(Cache):
    """The KV cache and padding mask of a left-padded batch of independent sequences."""

    def __init__(self, num_layers: int, pad_mask: torch.Tensor | None = None) -> None:
        super().__init__(layers=[_PaddedLayer() for _ in range(num_layers)])
        self.pad_mask: torch.Tensor | None = pad_mask

    @property
    def batch_size(self) -> int:
        return 0 if self.pad_mask is None else self.pad_mask.shape[0]

    @property
    def seq_length(self) -> int:
        """Common (padded) length ``L`` of every row."""
        return 0 if self.pad_mask is None else self.pad_mask.shape[1]

    def extend(self, new_valid: torch.Tensor) -> torch.Tensor:
        """Append ``q`` columns (``new_valid``: bool ``[B, q]``, False = padding) to the mask.

        Returns the 4-D boolean attention mask ``[B, 1, q, L + q]`` for a forward
        pass over those ``q`` query positions: causal, blind to padding, and with
        every query attending at least to itself (so padded queries stay finite).
        """
        batch, q_len = new_valid.shape
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
        causal = k_pos <= q_pos  # [q, L + q]
        mask = causal[None] & self.pad_mask[:, None, :]  # [B, q, L + q]
        mask |= (k_pos == q_pos)[None]
        return mask[:, None]

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (1-D long tensor, in that order)."""
        for layer in self.layers:
            layer.select_rows(rows)
        self.pad_mask = self.pad_mask.index_select(0, rows)

    def trim_leading_padding(self) -> int:
        """Drop leading columns that are padding in every row; returns how many were dropped."""
        if self.pad_mask is None or self.pad_mask.shape[0] == 0:
            return 0
        any_real = self.pad_mask.any(dim=0)
        if not bool(any_real.any()):
            return 0
        first = int(any_real.to(torch.int8).argmax())
        if first > 0:
            for layer in self.layers:
                layer.trim_left(first)
            self.pad_mask = self.pad_mask[:, first:]
        return first

    @classmethod
    def merge(cls, first: PaddedBatchCache, second: PaddedBatchCache) -> PaddedBatchCache:
        """Rows of ``first`` then rows of ``second``, both left-padded to the longer length."""
        if len(first.layers) != len(second.layers):
            raise CacheMergeError(
                f"cannot merge caches of {len(first.layers)} and {len(second.layers)} layers"
            )
        len_a, len_b = first.seq_length, second.seq_length
        length = max(len_a, len_b)
        batch_a, batch_b = first.batch_size, second.batch_size
        capacity = length + max(_MIN_HEADROOM, length)
        merged = cls(len(first.layers))
        for i, (la, lb) in enumerate(zip(first.layers, second.layers, strict=True)):
            if la.kbuf.dtype != lb.kbuf.dtype or la.kbuf.device != lb.kbuf.device:
                raise CacheMergeError(
                    f"layer {i}: cannot merge {la.kbuf.dtype}/{la.kbuf.device} with "
                    f"{lb.kbuf.dtype}/{lb.kbuf.device}"
                )
            bufs = []
            for a, b in ((la.keys, lb.keys), (la.values, lb.values)):
                buf = a.new_empty((batch_a + batch_b, a.shape[1], capacity, a.shape[-1]))
                buf[:batch_a, :, : length - len_a].zero_()
                buf[:batch_a, :, length - len_a : length] = a
                buf[batch_a:, :, : length - len_b].zero_()
                buf[batch_a:, :, length - len_b : length] = b
                bufs.append(buf)
            merged.layers[i] = _PaddedLayer.from_buffers(bufs[0], bufs[1], 0, length)
        mask = first.pad_mask.new_zeros((batch_a + batch_b, length))
        mask[:batch_a, length - len_a :] = first.pad_mask
        mask[batch_a:, length - len_b :] = second.pad_mask
        merged.pad_mask = mask
        return merged
