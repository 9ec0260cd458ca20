"""The torch engine's running batch: the rows being decoded, their KV cache and their next inputs.

:class:`~services.lib.engine.torch_engine.TorchEngine`'s thread owns one :class:`RunningBatch` and, at each
decode-step boundary (after applying pending weight updates):

1. admits queued requests (:meth:`RunningBatch.admit`): prefills them together (left-padded, grouped as
   :mod:`~services.lib.engine.prefill` says), samples their first token, and merges their KV cache into
   the running batch (:class:`~services.lib.engine.kv_cache.PaddedBatchCache`);
2. runs one decode step for every running row (:meth:`RunningBatch.step`) and samples the next tokens for
   the whole batch at once;
3. removes finished rows from the cache at once and trims leading columns that have become padding in
   every row.

An in-flight weight update recomputes the running rows' KV cache under the new weights
(:meth:`RunningBatch.recompute_cache`: one prefill of each row's prompt and tokens so far, as vLLM's
engine does by preempting them): no token attends to keys and values of older weights, so each token's
logprob is exactly that of the version it carries.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from services.lib.engine.kv_cache import PaddedBatchCache, cache_kwarg
from services.lib.engine.prefill import left_padded, prefill_chunks
from services.lib.engine.sampling import DecodeState, sample_tokens


class Request:
    """A queued or running request: its decoding state and where its result goes."""

    __slots__ = ("seq", "loop", "future", "cancelled")

    def __init__(self, seq: DecodeState, loop: asyncio.AbstractEventLoop, future: asyncio.Future) -> None:
        self.seq, self.loop, self.future = seq, loop, future
        self.cancelled = False


class RunningBatch:
    """The running rows of a torch engine and their state on the device (engine thread only).

    :meth:`admit` and :meth:`step` return how many tokens they sampled and the requests they finished
    (already out of the batch); the engine settles those.
    """

    def __init__(self, device: torch.device, capacity: int, max_prefill_tokens: int,
                 generator: torch.Generator) -> None:
        self.device, self.capacity, self.max_prefill_tokens = device, capacity, max_prefill_tokens
        self.generator = generator  # shared by unseeded requests
        self.rows: list[Request] = []
        self.cache: PaddedBatchCache | None = None
        self.next_tokens = torch.empty(0, dtype=torch.long, device=device)
        self.positions = torch.empty(0, dtype=torch.long, device=device)
        self.model: Any = None
        self._num_layers = 0
        self._cache_kwarg = "cache"

    def use(self, model: Any) -> None:
        """Decode with ``model`` (loaded, on the device)."""
        self.model = model
        self._num_layers = model.config.get_text_config(decoder=True).num_hidden_layers
        self._cache_kwarg = cache_kwarg(model)

    def reset(self) -> None:
        """Drop every row and the cache."""
        self.rows = []
        self.cache = None
        self.next_tokens = self.next_tokens[:0]
        self.positions = self.positions[:0]

    @torch.inference_mode()
    def drop_cancelled(self) -> int:
        """Remove the rows whose request was cancelled; how many. Under inference mode like every other change
        of the cache: moving the rows behind a removed one is an in-place update of inference tensors."""
        cancelled = [i for i, r in enumerate(self.rows) if r.cancelled]
        if cancelled:
            self._remove_rows(cancelled)
        return len(cancelled)

    @torch.inference_mode()
    def recompute_cache(self) -> None:
        """Rebuild the running rows' cache under the current weights: each row's prompt and tokens so far
        but the last (the next step's input), prefilled in row order, in slices within the prefill budget."""
        contexts = [tuple(r.seq.prompt_ids) + tuple(r.seq.tokens[:-1]) for r in self.rows]
        cache = PaddedBatchCache(self._num_layers, batch_capacity=self.capacity)
        lo = 0
        while lo < len(contexts):
            hi, longest = lo + 1, len(contexts[lo])
            while hi < len(contexts) and max(longest, len(contexts[hi])) * (hi - lo + 1) <= self.max_prefill_tokens:
                longest = max(longest, len(contexts[hi]))
                hi += 1
            part, _ = self._prefill(contexts[lo:hi])
            cache.append(part)
            lo = hi
        self.cache = cache

    def _prefill(self, prompts: list[tuple[int, ...]]) -> tuple[PaddedBatchCache, torch.Tensor]:
        """Left-padded forward pass over ``prompts``: their cache and last-position logits."""
        ids, valid, positions = left_padded(prompts)
        cache = PaddedBatchCache(self._num_layers)
        mask = cache.extend(valid.to(self.device))
        logits = self.model(input_ids=ids.to(self.device), attention_mask=mask,
                            position_ids=positions.to(self.device), use_cache=True, logits_to_keep=1,
                            **{self._cache_kwarg: cache}).logits[:, -1]
        return cache, logits

    @torch.inference_mode()
    def admit(self, newcomers: list[Request], version: int) -> tuple[int, list[Request]]:
        """Prefill ``newcomers``, sample their first token (under weight ``version``), append them.

        Identical prompts (a GRPO group) are prefilled once and their cache rows
        copied; distinct ones in chunks of similar length (:func:`prefill_chunks`).
        """
        groups: dict[tuple[int, ...], list[Request]] = {}
        for request in newcomers:
            groups.setdefault(tuple(request.seq.prompt_ids), []).append(request)
        if self.cache is None:
            self.cache = PaddedBatchCache(self._num_layers, batch_capacity=self.capacity)
        admitted: list[Request] = []
        all_logits: list[torch.Tensor] = []
        for chunk in prefill_chunks(groups):
            cache, logits = self._prefill(chunk)
            copies = [i for i, prompt in enumerate(chunk) for _ in groups[prompt]]
            rows = None
            if len(copies) > len(chunk):
                rows = torch.tensor(copies, dtype=torch.long, device=self.device)
                logits = logits.index_select(0, rows)
            self.cache.append(cache, rows)
            admitted += [r for prompt in chunk for r in groups[prompt]]
            all_logits.append(logits)
        logits = torch.cat(all_logits) if len(all_logits) > 1 else all_logits[0]
        tokens, token_list, logprob_list = sample_tokens(logits, [r.seq.params for r in admitted],
                                                         [r.seq.generator for r in admitted], self.generator)
        next_positions = torch.tensor([len(r.seq.prompt_ids) for r in admitted], dtype=torch.long,
                                      device=self.device)
        self.rows = self.rows + admitted
        self.next_tokens = torch.cat([self.next_tokens, tokens])
        self.positions = torch.cat([self.positions, next_positions])
        offset = len(self.rows) - len(admitted)
        return len(token_list), self._record(range(offset, len(self.rows)), token_list, logprob_list, version)

    @torch.inference_mode()
    def step(self, version: int) -> tuple[int, list[Request]]:
        """One forward pass of every running row, batched sampling (under weight ``version``), bookkeeping."""
        mask = self.cache.extend(torch.ones((len(self.rows), 1), dtype=torch.bool, device=self.device))
        logits = self.model(input_ids=self.next_tokens[:, None], attention_mask=mask,
                            position_ids=self.positions[:, None], use_cache=True,
                            **{self._cache_kwarg: self.cache}).logits[:, -1]
        self.positions += 1
        tokens, token_list, logprob_list = sample_tokens(logits, [r.seq.params for r in self.rows],
                                                         [r.seq.generator for r in self.rows], self.generator)
        self.next_tokens = tokens
        return len(token_list), self._record(range(len(self.rows)), token_list, logprob_list, version)

    def _record(self, row_indices: range, token_list: list[int], logprob_list: list[float],
                version: int) -> list[Request]:
        """Append sampled tokens to rows ``row_indices``; the rows that hit a stop leave the batch."""
        finished: list[int] = []
        for i, token, logprob in zip(row_indices, token_list, logprob_list, strict=True):
            if self.rows[i].seq.accept(token, logprob, version):
                finished.append(i)
        if not finished:
            return []
        done = [self.rows[i] for i in finished]
        self._remove_rows(finished)
        return done

    def _remove_rows(self, removed: list[int]) -> None:
        """Drop rows ``removed`` from the batch (cache, per-row state); trim columns that became all padding."""
        order = self.cache.remove_rows(removed)
        self.cache.trim_leading_padding()
        self.rows = [self.rows[i] for i in order]
        index = torch.tensor(order, dtype=torch.long, device=self.device)
        self.next_tokens = self.next_tokens.index_select(0, index)
        self.positions = self.positions.index_select(0, index)
