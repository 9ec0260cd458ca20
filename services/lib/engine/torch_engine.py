"""The ``torch`` inference engine: a transformers causal LM with continuous batching.

One dedicated thread owns the model and runs the decode loop; coroutines hand it
requests through a condition-guarded queue and get results back on their event
loop (``call_soon_threadsafe``). The thread sleeps on the condition when idle.

Each loop iteration, at a decode-step boundary:

1. applies pending weight updates (``in_flight``: always; ``between_requests``:
   once no row is running, holding back newcomers meanwhile);
2. admits queued requests up to ``max_batch_size``: prefills them together
   (left-padded, grouped as :mod:`~services.lib.engine.prefill` says), samples
   their first token, and merges their KV cache into the running batch
   (:class:`~services.lib.engine.kv_cache.PaddedBatchCache`);
3. runs one decode step for every running row and samples the next tokens for
   the whole batch at once;
4. removes finished rows from the cache at once and trims leading columns that
   have become padding in every row.

An in-flight update recomputes the running rows' KV cache under the new weights
(one prefill of each row's prompt and tokens so far, as vLLM's engine does by
preempting them): no token attends to keys and values of older weights, so each
token's logprob is exactly that of the version it carries.

A LoRA run's versions carry adapters only (:mod:`services.lib.weights.lora_merge`): the engine keeps the
base of each adapted weight (copied on the first adapter) and loads base + B A · alpha / r.

The engine's settings are :class:`~services.lib.engine.torch_config.TorchEngineConfig`.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from services.lib.engine.base import (
    EngineError,
    EngineNotRunningError,
    EngineOverloadedError,
    EngineStats,
    GenerationResult,
    InvalidRequestError,
    SamplingParams,
    TokenRate,
    WeightUpdateError,
    resolve_threadsafe,
)
from services.lib.engine.kv_cache import PaddedBatchCache, cache_kwarg
from services.lib.engine.prefill import left_padded, prefill_chunks
from services.lib.engine.sampling import DecodeState, sample_tokens
from services.lib.engine.torch_config import DTYPES, TorchEngineConfig
from services.lib.weights.lora_merge import AdapterFormatError, AdapterMerger, is_adapter

log = logging.getLogger("rlbus.rollout.torch_engine")


class _Request:
    """A queued or running request: its decoding state and where its result goes."""

    __slots__ = ("seq", "loop", "future", "cancelled")

    def __init__(self, seq: DecodeState, loop: asyncio.AbstractEventLoop, future: asyncio.Future) -> None:
        self.seq, self.loop, self.future = seq, loop, future
        self.cancelled = False


class _WeightUpdate:
    __slots__ = ("tensors", "version", "loop", "future")

    def __init__(self, tensors: dict[str, torch.Tensor], version: int,
                 loop: asyncio.AbstractEventLoop, future: asyncio.Future) -> None:
        self.tensors, self.version, self.loop, self.future = tensors, version, loop, future


class TorchEngine:
    """Continuous-batching engine over a transformers causal LM (implements ``Engine``)."""

    def __init__(self, config: TorchEngineConfig, *, model: torch.nn.Module | None = None,
                 tokenizer: Any | None = None) -> None:
        self.config = config
        self._model = model
        self._tokenizer = tokenizer
        self._device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self._version = config.initial_version
        self._cond = threading.Condition()
        self._queue: collections.deque[_Request] = collections.deque()
        self._updates: list[_WeightUpdate] = []
        self._stopping = False
        self._running = False
        self._thread: threading.Thread | None = None
        self._n_pending = 0
        self._rate = TokenRate(config.stats_window_s)
        # running batch (engine thread only)
        self._rows: list[_Request] = []
        self._cache: PaddedBatchCache | None = None
        self._cache_kwarg = "cache"  # the model's keyword for it, set at start
        # sleep/wake (a colocated trainer steps meanwhile): control calls run in the engine thread
        self._controls: list[tuple[Any, asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._asleep = False
        self._next_tokens = torch.empty(0, dtype=torch.long)
        self._positions = torch.empty(0, dtype=torch.long)
        self._eos_ids: frozenset[int] = frozenset()
        self._targets: dict[str, torch.Tensor] = {}
        self._max_positions: int | None = None
        self._vocab_size = 0
        self._generator = torch.Generator(device=self._device)
        if config.seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(config.seed)

    @classmethod
    def from_model(cls, model: torch.nn.Module, tokenizer: Any | None,
                   config: TorchEngineConfig | None = None) -> TorchEngine:
        """An engine over an already loaded model (colocated runs, tests); ``start`` moves it to the device."""
        return cls(config or TorchEngineConfig(), model=model, tokenizer=tokenizer)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Load the model (if not given) and start the engine thread."""
        if self._running:
            return
        if self.config.num_threads is not None:
            torch.set_num_threads(self.config.num_threads)
        await asyncio.to_thread(self._load)
        self._stopping = False
        self._running = True
        self._thread = threading.Thread(target=self._run, name="torch-engine", daemon=True)
        self._thread.start()
        log.info("torch engine started on %s (%s), version %d", self._device, self.config.dtype, self._version)

    async def stop(self) -> None:
        """Stop the engine thread; pending requests fail with EngineNotRunningError."""
        if not self._running:
            return
        self._running = False
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        self._thread = None

    def _load(self) -> None:
        from services.runtime.loading import HF_LOAD_LOCK

        dtype = DTYPES[self.config.dtype]
        if self._model is None:
            if not self.config.model_dir or not Path(self.config.model_dir).is_dir():
                raise EngineError(f"model_dir {self.config.model_dir!r} is not a directory; "
                                  "point it at a Hugging Face model directory")
            with HF_LOAD_LOCK:  # colocated services load in threads of one process
                from transformers import AutoModelForCausalLM, AutoTokenizer

                self._model = AutoModelForCausalLM.from_pretrained(
                    self.config.model_dir, dtype=dtype, attn_implementation=self.config.attn_implementation)
                if self._tokenizer is None:
                    self._tokenizer = AutoTokenizer.from_pretrained(self.config.model_dir)
        model = self._model.to(device=self._device, dtype=dtype).eval()
        model.requires_grad_(False)
        text_config = model.config.get_text_config(decoder=True)
        layer_types = getattr(text_config, "layer_types", None) or []
        if any(t != "full_attention" for t in layer_types):
            raise EngineError(f"the torch engine supports full-attention models only; layer types {set(layer_types)}")
        self._num_layers = text_config.num_hidden_layers
        self._cache_kwarg = cache_kwarg(model)
        self._max_positions = getattr(text_config, "max_position_embeddings", None)
        self._vocab_size = text_config.vocab_size
        self._targets = model.state_dict(keep_vars=True)
        self._adapters = AdapterMerger(lambda names: {n: self._targets[n].detach() for n in names},
                                       {k: tuple(v.shape) for k, v in self._targets.items()})
        eos = model.generation_config.eos_token_id if model.generation_config is not None else None
        eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if self._tokenizer is not None and self._tokenizer.eos_token_id is not None:
            eos_ids.add(self._tokenizer.eos_token_id)
        self._eos_ids = frozenset(eos_ids)
        self._next_tokens = self._next_tokens.to(self._device)
        self._positions = self._positions.to(self._device)

    # ------------------------------------------------------------------ public API
    @property
    def version(self) -> int:
        """The weight version tokens are sampled with now."""
        return self._version

    @property
    def tokenizer(self) -> Any | None:
        """The tokenizer loaded with the model (``None`` if there is none)."""
        return self._tokenizer

    def stats(self) -> EngineStats:
        """Pending/running requests, recent tokens/s, total tokens, version."""
        with self._cond:
            return EngineStats(pending=self._n_pending, running=len(self._rows),
                               tokens_per_s=self._rate.per_s(time.monotonic()),
                               total_generated_tokens=self._rate.total, version=self._version)

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        """Generate one completion; see :class:`~services.lib.engine.base.Engine`."""
        if not self._running:
            raise EngineNotRunningError("the torch engine is not running; call start() first")
        self._validate(prompt_ids, params)
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        request = _Request(DecodeState(list(prompt_ids), params, self._eos_ids, self._tokenizer, self._device),
                           loop, future)
        with self._cond:
            if len(self._queue) >= self.config.max_queued:
                raise EngineOverloadedError(
                    f"{len(self._queue)} requests already queued (max_queued={self.config.max_queued}); "
                    "slow down or raise max_queued")
            self._queue.append(request)
            self._n_pending += 1
            self._cond.notify()

        def on_done(f: asyncio.Future) -> None:
            if f.cancelled():
                request.cancelled = True
        future.add_done_callback(on_done)
        return await future

    def _validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise InvalidRequestError("prompt_ids is empty; give at least one token (e.g. BOS)")
        if min(prompt_ids) < 0 or max(prompt_ids) >= self._vocab_size:
            raise InvalidRequestError(f"prompt token ids must be in [0, {self._vocab_size})")
        if self._max_positions is not None and len(prompt_ids) + params.max_new_tokens > self._max_positions:
            raise InvalidRequestError(
                f"prompt ({len(prompt_ids)}) + max_new_tokens ({params.max_new_tokens}) exceeds the model's "
                f"max_position_embeddings ({self._max_positions}); shorten the prompt or lower max_new_tokens")
        if params.stop and self._tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer; this engine has none")

    async def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Copy ``state_dict`` (all or some of the model's tensors) into the model and set ``version``.

        Names and shapes are checked first; on a mismatch nothing is applied and
        WeightUpdateError is raised. Do not modify the tensors until this returns.
        """
        if not self._running:
            raise EngineNotRunningError("the torch engine is not running; call start() first")
        if is_adapter(state_dict):  # a LoRA version: merged into the kept base weights when applied
            try:
                self._adapters.check(state_dict)
            except AdapterFormatError as exc:
                raise WeightUpdateError(f"adapter version {version}: {exc}") from exc
        else:
            self._check_names_and_shapes(state_dict)
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        with self._cond:
            self._updates.append(_WeightUpdate(dict(state_dict), version, loop, future))
            self._cond.notify()
        await future

    def _check_names_and_shapes(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        unknown = [k for k in state_dict if k not in self._targets]
        if unknown:
            raise WeightUpdateError(f"unknown tensor names {unknown[:5]} (of {len(unknown)}); "
                                    "send a state dict of the same architecture")
        bad = [k for k, v in state_dict.items() if tuple(v.shape) != tuple(self._targets[k].shape)]
        if bad:
            k = bad[0]
            raise WeightUpdateError(f"shape mismatch for {k}: got {tuple(state_dict[k].shape)}, "
                                    f"model has {tuple(self._targets[k].shape)}")

    # ------------------------------------------------------------------ sleep / wake (colocation)
    async def sleep(self) -> None:
        """Release memory while a colocated trainer steps (:mod:`services.lib.colocation`): at the next step
        boundary decoding stops, the KV cache is dropped and, on a GPU, the weights move to the host. Running
        and queued requests are kept; weight updates wait. :meth:`wake_up` resumes them."""
        await self._control(self._release)

    async def wake_up(self) -> None:
        """Undo :meth:`sleep`: weights back on the device, the running rows' KV cache recomputed, decoding on."""
        await self._control(self._restore)

    @property
    def asleep(self) -> bool:
        return self._asleep

    async def _control(self, fn: Any) -> None:
        if not self._running:
            raise EngineNotRunningError("the torch engine is not running; call start() first")
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        with self._cond:
            self._controls.append((fn, loop, future))
            self._cond.notify()
        await future

    def _release(self) -> None:
        if self._asleep:
            return
        self._cache = None
        if self._device.type != "cpu":
            self._model.to("cpu")
            if self._device.type == "cuda":
                torch.cuda.empty_cache()
        self._asleep = True
        log.info("asleep (%d rows kept, %d queued): KV cache released%s", len(self._rows), len(self._queue),
                 "" if self._device.type == "cpu" else ", weights on the host")

    def _restore(self) -> None:
        if not self._asleep:
            return
        if self._device.type != "cpu":
            self._model.to(self._device)
        if self._rows:
            self._recompute_cache()
        self._asleep = False
        log.info("awake (%d rows resumed)", len(self._rows))

    # ------------------------------------------------------------------ engine thread
    def _after_step(self) -> None:
        """Called in the engine thread after every loop iteration (a hook for tests and instrumentation)."""

    def _has_work(self) -> bool:
        if self._stopping or self._controls:
            return True
        if self._asleep:
            return False
        if self._rows:
            return True
        return bool(self._updates) or bool(self._queue)

    def _run_controls(self) -> None:
        with self._cond:
            controls, self._controls = self._controls, []
        for fn, loop, future in controls:
            try:
                fn()
            except Exception as exc:
                log.exception("torch engine %s failed", getattr(fn, "__name__", fn))
                resolve_threadsafe(loop, future, error=EngineError(f"{getattr(fn, '__name__', fn)} failed: {exc!r}"))
            else:
                resolve_threadsafe(loop, future)

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(self._has_work)
                    if self._stopping:
                        break
                if self._controls:
                    self._run_controls()
                with self._cond:
                    if self._asleep or self._stopping:
                        continue
                    updates: list[_WeightUpdate] = []
                    if self._updates and (self.config.weight_update_mode == "in_flight" or not self._rows):
                        updates, self._updates = self._updates, []
                    hold = self.config.weight_update_mode == "between_requests" and bool(self._updates)
                    newcomers = [] if hold else self._take_newcomers()
                try:
                    for update in updates:
                        self._apply_update(update)
                    self._drop_cancelled()
                    if newcomers:
                        self._admit(newcomers)
                    if self._rows:
                        self._decode_step()
                except Exception as exc:  # fail the affected requests, keep serving the others
                    log.exception("torch engine step failed")
                    affected = self._rows + [r for r in newcomers if r not in self._rows]
                    self._reset_batch()
                    self._fail(affected, EngineError(f"generation failed: {exc!r}"))
                self._after_step()
        finally:
            with self._cond:
                queued, self._queue = list(self._queue), collections.deque()
                updates, self._updates = self._updates, []
                controls, self._controls = self._controls, []
            for _, loop, future in controls:
                resolve_threadsafe(loop, future, error=EngineNotRunningError("the torch engine stopped"))
            running = self._rows
            self._reset_batch()
            self._fail(queued + running, EngineNotRunningError("the torch engine stopped before this request finished"))
            for update in updates:
                resolve_threadsafe(update.loop, update.future,
                                   error=EngineNotRunningError("engine stopped before the update"))

    def _take_newcomers(self) -> list[_Request]:
        """Pop queued requests that fit (batch size, prefill budget); called under the lock."""
        room = self.config.max_batch_size - len(self._rows)
        taken: list[_Request] = []
        longest = 0
        while self._queue and len(taken) < room:
            request = self._queue[0]
            if request.cancelled:
                self._queue.popleft()
                self._n_pending -= 1
                continue
            longest_if = max(longest, len(request.seq.prompt_ids))
            if taken and longest_if * (len(taken) + 1) > self.config.max_prefill_tokens:
                break
            taken.append(self._queue.popleft())
            longest = longest_if
        return taken

    def _fail(self, requests: list[_Request], error: EngineError) -> None:
        with self._cond:
            self._n_pending -= len(requests)
        for request in requests:
            resolve_threadsafe(request.loop, request.future, error=error)

    def _reset_batch(self) -> None:
        self._rows = []
        self._cache = None
        self._next_tokens = self._next_tokens[:0]
        self._positions = self._positions[:0]

    def _apply_update(self, update: _WeightUpdate) -> None:
        try:
            with torch.no_grad():
                if is_adapter(update.tensors):
                    update.tensors = self._adapters.merged(update.tensors)
                else:
                    self._adapters.rebase(update.tensors)  # a full version: the new base of adapted weights
                for name, tensor in update.tensors.items():
                    self._targets[name].copy_(tensor)
        except (RuntimeError, TypeError, ValueError) as exc:  # the update's caller hears of it; generation goes on
            log.exception("weight update to version %d failed", update.version)
            resolve_threadsafe(update.loop, update.future, error=WeightUpdateError(
                f"copying version {update.version} failed ({exc!r}); the model may hold a mix of versions "
                f"{self._version} and {update.version}: send a full state dict again"))
            return
        self._version = update.version
        if self._rows:
            self._recompute_cache()
        log.info("applied weights version %d (%d tensors, %d rows running)",
                 update.version, len(update.tensors), len(self._rows))
        resolve_threadsafe(update.loop, update.future)

    @torch.inference_mode()
    def _recompute_cache(self) -> None:
        """Rebuild the running rows' cache under the current weights: each row's prompt and tokens so far
        but the last (the next step's input), prefilled in row order, in slices within the prefill budget."""
        contexts = [tuple(r.seq.prompt_ids) + tuple(r.seq.tokens[:-1]) for r in self._rows]
        cache = PaddedBatchCache(self._num_layers, batch_capacity=self.config.max_batch_size)
        lo = 0
        while lo < len(contexts):
            hi, longest = lo + 1, len(contexts[lo])
            budget = self.config.max_prefill_tokens
            while hi < len(contexts) and max(longest, len(contexts[hi])) * (hi - lo + 1) <= budget:
                longest = max(longest, len(contexts[hi]))
                hi += 1
            part, _ = self._prefill(contexts[lo:hi])
            cache.append(part)
            lo = hi
        self._cache = cache

    def _drop_cancelled(self) -> None:
        cancelled = [i for i, r in enumerate(self._rows) if r.cancelled]
        if cancelled:
            with self._cond:
                self._n_pending -= len(cancelled)
            self._remove_rows(cancelled)

    def _prefill(self, prompts: list[tuple[int, ...]]) -> tuple[PaddedBatchCache, torch.Tensor]:
        """Left-padded forward pass over ``prompts``: their cache and last-position logits."""
        ids, valid, positions = left_padded(prompts)
        cache = PaddedBatchCache(self._num_layers)
        mask = cache.extend(valid.to(self._device))
        logits = self._model(input_ids=ids.to(self._device), attention_mask=mask,
                             position_ids=positions.to(self._device), use_cache=True, logits_to_keep=1,
                             **{self._cache_kwarg: cache}).logits[:, -1]
        return cache, logits

    @torch.inference_mode()
    def _admit(self, newcomers: list[_Request]) -> None:
        """Prefill ``newcomers``, sample their first token, append them to the running batch.

        Identical prompts (a GRPO group) are prefilled once and their cache rows
        copied; distinct ones in chunks of similar length (:func:`prefill_chunks`).
        """
        device = self._device
        groups: dict[tuple[int, ...], list[_Request]] = {}
        for request in newcomers:
            groups.setdefault(tuple(request.seq.prompt_ids), []).append(request)
        chunks = prefill_chunks(groups)
        if self._cache is None:
            self._cache = PaddedBatchCache(self._num_layers, batch_capacity=self.config.max_batch_size)
        admitted: list[_Request] = []
        all_logits: list[torch.Tensor] = []
        for chunk in chunks:
            cache, logits = self._prefill(chunk)
            copies = [i for i, prompt in enumerate(chunk) for _ in groups[prompt]]
            rows = None
            if len(copies) > len(chunk):
                rows = torch.tensor(copies, dtype=torch.long, device=device)
                logits = logits.index_select(0, rows)
            self._cache.append(cache, rows)
            admitted += [r for prompt in chunk for r in groups[prompt]]
            all_logits.append(logits)
        logits = torch.cat(all_logits) if len(all_logits) > 1 else all_logits[0]
        tokens, token_list, logprob_list = sample_tokens(logits, [r.seq.params for r in admitted],
                                                         [r.seq.generator for r in admitted], self._generator)
        next_positions = torch.tensor([len(r.seq.prompt_ids) for r in admitted], dtype=torch.long, device=device)
        self._rows = self._rows + admitted
        self._next_tokens = torch.cat([self._next_tokens, tokens])
        self._positions = torch.cat([self._positions, next_positions])
        offset = len(self._rows) - len(admitted)
        self._record(range(offset, len(self._rows)), token_list, logprob_list)

    @torch.inference_mode()
    def _decode_step(self) -> None:
        """One forward pass of every running row, batched sampling, bookkeeping."""
        cache = self._cache
        mask = cache.extend(torch.ones((len(self._rows), 1), dtype=torch.bool, device=self._device))
        logits = self._model(input_ids=self._next_tokens[:, None], attention_mask=mask,
                             position_ids=self._positions[:, None], use_cache=True,
                             **{self._cache_kwarg: cache}).logits[:, -1]
        self._positions += 1
        tokens, token_list, logprob_list = sample_tokens(logits, [r.seq.params for r in self._rows],
                                                         [r.seq.generator for r in self._rows], self._generator)
        self._next_tokens = tokens
        self._record(range(len(self._rows)), token_list, logprob_list)

    def _record(self, row_indices: range, token_list: list[int], logprob_list: list[float]) -> None:
        """Append sampled tokens to rows ``row_indices``, finish rows that hit a stop, drop them."""
        version = self._version
        finished: list[int] = []
        for i, token, logprob in zip(row_indices, token_list, logprob_list, strict=True):
            if self._rows[i].seq.accept(token, logprob, version):
                finished.append(i)
        now = time.monotonic()
        with self._cond:
            self._rate.add(len(token_list), now)
        if finished:  # leave the batch first, so stats never count a returned request as running
            done_requests = [self._rows[i] for i in finished]
            self._remove_rows(finished)
            for request in done_requests:
                self._finish(request)

    def _finish(self, request: _Request) -> None:
        result = request.seq.result()
        with self._cond:
            self._n_pending -= 1
        resolve_threadsafe(request.loop, request.future, result)

    def _remove_rows(self, removed: list[int]) -> None:
        """Drop rows ``removed`` from the batch (cache, per-row state); trim columns that became all padding."""
        order = self._cache.remove_rows(removed)
        self._cache.trim_leading_padding()
        self._rows = [self._rows[i] for i in order]
        index = torch.tensor(order, dtype=torch.long, device=self._device)
        self._next_tokens = self._next_tokens.index_select(0, index)
        self._positions = self._positions.index_select(0, index)
