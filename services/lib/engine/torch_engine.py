"""The ``torch`` inference engine: a transformers causal LM with continuous batching.

One dedicated thread owns the model and runs the decode loop; coroutines hand it
requests through a condition-guarded queue and get results back on their event
loop (``call_soon_threadsafe``). The thread sleeps on the condition when idle.

Each loop iteration, at a decode-step boundary, applies pending weight updates
(``in_flight``: always, the running rows' KV cache then recomputed; ``between_requests``:
once no row is running, holding back newcomers meanwhile), then admits queued requests up
to ``max_batch_size`` and runs one decode step: the running batch and how it prefills,
samples and drops rows is :mod:`services.lib.engine.torch_batch`.

A LoRA run's versions carry adapters only (:mod:`services.lib.weights.lora_merge`): the engine keeps the
base of each adapted weight (copied on the first adapter) and loads base + B A · alpha / r.

The engine's settings are :class:`~services.lib.engine.config.TorchEngineConfig` (the run file's
``engine = { type = "torch", ... }``).
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

from services.lib.cuda_alloc import set_alloc_conf
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
from services.lib.engine.config import TorchEngineConfig
from services.lib.engine.sampling import DecodeState
from services.lib.engine.torch_batch import Request, RunningBatch
from services.lib.weights.lora_merge import AdapterFormatError, AdapterMerger, is_adapter

log = logging.getLogger("rlbus.rollout.torch_engine")

#: the torch dtypes :attr:`TorchEngineConfig.dtype` names
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class _WeightUpdate:
    __slots__ = ("tensors", "version", "loop", "future")

    def __init__(self, tensors: dict[str, torch.Tensor], version: int,
                 loop: asyncio.AbstractEventLoop, future: asyncio.Future) -> None:
        self.tensors, self.version, self.loop, self.future = tensors, version, loop, future


class TorchEngine:
    """Continuous-batching engine over a transformers causal LM (implements ``Engine``).

    ``model_dir`` is the Hugging Face directory (config, safetensors, tokenizer) loaded at start, unused
    with :meth:`from_model`; ``seed`` seeds the generator of unseeded requests (``None``: a fresh one;
    engines must not share it, or their samples would be correlated).
    """

    def __init__(self, config: TorchEngineConfig, model_dir: str | Path = "", *, seed: int | None = None,
                 model: torch.nn.Module | None = None, tokenizer: Any | None = None) -> None:
        self.config = config
        self.model_dir = str(model_dir)
        self._model = model
        self._tokenizer = tokenizer
        self._device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self._device.type == "cuda":
            set_alloc_conf()  # before anything of this process touches CUDA (services/lib/cuda_alloc.py)
        self._version = 0
        self._cond = threading.Condition()
        self._queue: collections.deque[Request] = collections.deque()
        self._updates: list[_WeightUpdate] = []
        self._stopping = False
        self._running = False
        self._thread: threading.Thread | None = None
        self._n_pending = 0
        self._rate = TokenRate(config.stats_window_s)
        # sleep/wake (a colocated trainer steps meanwhile): control calls run in the engine thread
        self._controls: list[tuple[Any, asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._asleep = False
        self._eos_ids: frozenset[int] = frozenset()
        self._targets: dict[str, torch.Tensor] = {}
        self._max_positions: int | None = None
        self._vocab_size = 0
        generator = torch.Generator(device=self._device)
        generator.seed() if seed is None else generator.manual_seed(seed)
        # the running batch (engine thread only)
        self._batch = RunningBatch(self._device, config.max_batch_size, config.max_prefill_tokens, generator)

    @classmethod
    def from_model(cls, model: torch.nn.Module, tokenizer: Any | None, config: TorchEngineConfig | None = None,
                   *, seed: int | None = None) -> TorchEngine:
        """An engine over an already loaded model (colocated runs, tests); ``start`` moves it to the device."""
        return cls(config or TorchEngineConfig(), seed=seed, model=model, tokenizer=tokenizer)

    # ------------------------------------------------------------------ lifecycle
    @property
    def device(self) -> torch.device:  # where the weights live: an NCCL weight receiver receives here
        return self._device

    async def start(self) -> None:
        """Load the model (if not given) and start the engine thread."""
        if self._running:
            return
        if self.config.num_threads:
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
            if not self.model_dir or not Path(self.model_dir).is_dir():
                raise EngineError(f"model_dir {self.model_dir!r} is not a directory; "
                                  "point it at a Hugging Face model directory")
            with HF_LOAD_LOCK:  # colocated services load in threads of one process
                from transformers import AutoModelForCausalLM, AutoTokenizer

                self._model = AutoModelForCausalLM.from_pretrained(
                    self.model_dir, dtype=dtype, attn_implementation=self.config.attn_implementation)
                if self._tokenizer is None:
                    self._tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        model = self._model.to(device=self._device, dtype=dtype).eval()
        model.requires_grad_(False)
        text_config = model.config.get_text_config(decoder=True)
        layer_types = getattr(text_config, "layer_types", None) or []
        if any(t != "full_attention" for t in layer_types):
            raise EngineError(f"the torch engine supports full-attention models only; layer types {set(layer_types)}")
        self._batch.use(model)
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

    # ------------------------------------------------------------------ public API
    @property
    def version(self) -> int:
        """The weight version tokens are sampled with now."""
        return self._version

    @property
    def tokenizer(self) -> Any | None:
        """The tokenizer loaded with the model (``None`` if there is none)."""
        return self._tokenizer

    @property
    def max_positions(self) -> int | None:
        """The most tokens (prompt + completion) one sequence may hold; None before start or when unknown."""
        return self._max_positions

    def stats(self) -> EngineStats:
        """Pending/running requests, recent tokens/s, total tokens, version."""
        with self._cond:
            return EngineStats(pending=self._n_pending, running=len(self._batch.rows),
                               tokens_per_s=self._rate.per_s(time.monotonic()),
                               total_generated_tokens=self._rate.total, version=self._version)

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        """Generate one completion; see :class:`~services.lib.engine.base.Engine`."""
        if not self._running:
            raise EngineNotRunningError("the torch engine is not running; call start() first")
        self._validate(prompt_ids, params)
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        request = Request(DecodeState(list(prompt_ids), params, self._eos_ids, self._tokenizer, self._device),
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
        self._batch.cache = None
        if self._device.type != "cpu":
            self._model.to("cpu")
            if self._device.type == "cuda":
                torch.cuda.empty_cache()
        self._asleep = True
        log.info("asleep (%d rows kept, %d queued): KV cache released%s", len(self._batch.rows), len(self._queue),
                 "" if self._device.type == "cpu" else ", weights on the host")

    def _restore(self) -> None:
        if not self._asleep:
            return
        if self._device.type != "cpu":
            self._model.to(self._device)
        if self._batch.rows:
            self._batch.recompute_cache()
        self._asleep = False
        log.info("awake (%d rows resumed)", len(self._batch.rows))

    # ------------------------------------------------------------------ engine thread
    def _after_step(self) -> None:
        """Called in the engine thread after every loop iteration (a hook for tests and instrumentation)."""

    def _has_work(self) -> bool:
        if self._stopping or self._controls:
            return True
        if self._asleep:
            return False
        if self._batch.rows:
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
                    if self._updates and (self.config.weight_update_mode == "in_flight" or not self._batch.rows):
                        updates, self._updates = self._updates, []
                    hold = self.config.weight_update_mode == "between_requests" and bool(self._updates)
                    newcomers = [] if hold else self._take_newcomers()
                try:
                    for update in updates:
                        self._apply_update(update)
                    self._drop_cancelled()
                    if newcomers:
                        self._admit(newcomers)
                    if self._batch.rows:
                        self._decode_step()
                except Exception as exc:  # fail the affected requests, keep serving the others
                    log.exception("torch engine step failed")
                    affected = self._batch.rows + [r for r in newcomers if r not in self._batch.rows]
                    self._batch.reset()
                    self._fail(affected, EngineError(f"generation failed: {exc!r}"))
                self._after_step()
        finally:
            with self._cond:
                queued, self._queue = list(self._queue), collections.deque()
                updates, self._updates = self._updates, []
                controls, self._controls = self._controls, []
            for _, loop, future in controls:
                resolve_threadsafe(loop, future, error=EngineNotRunningError("the torch engine stopped"))
            running = self._batch.rows
            self._batch.reset()
            self._fail(queued + running, EngineNotRunningError("the torch engine stopped before this request finished"))
            for update in updates:
                resolve_threadsafe(update.loop, update.future,
                                   error=EngineNotRunningError("engine stopped before the update"))

    def _take_newcomers(self) -> list[Request]:
        """Pop queued requests that fit (batch size, prefill budget); called under the lock."""
        room = self.config.max_batch_size - len(self._batch.rows)
        taken: list[Request] = []
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

    def _fail(self, requests: list[Request], error: EngineError) -> None:
        with self._cond:
            self._n_pending -= len(requests)
        for request in requests:
            resolve_threadsafe(request.loop, request.future, error=error)

    def _apply_update(self, update: _WeightUpdate) -> None:
        try:
            # inference mode, not no_grad: a weight the forward pass made in inference mode (generation runs in it)
            # can only be updated in place inside it, and a plain parameter can be either way
            with torch.inference_mode():
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
        if self._batch.rows:
            self._batch.recompute_cache()
        log.info("applied weights version %d (%d tensors, %d rows running)",
                 update.version, len(update.tensors), len(self._batch.rows))
        resolve_threadsafe(update.loop, update.future)

    def _drop_cancelled(self) -> None:
        dropped = self._batch.drop_cancelled()
        if dropped:
            with self._cond:
                self._n_pending -= dropped

    def _admit(self, newcomers: list[Request]) -> None:
        """Prefill ``newcomers`` into the running batch with their first token."""
        self._settle(*self._batch.admit(newcomers, self._version))

    def _decode_step(self) -> None:
        """One decode step of every running row."""
        self._settle(*self._batch.step(self._version))

    def _settle(self, n_tokens: int, finished: list[Request]) -> None:
        """Count a step's sampled tokens; return the requests it finished (already out of the batch, so
        stats never count a returned request as running)."""
        with self._cond:
            self._rate.add(n_tokens, time.monotonic())
            self._n_pending -= len(finished)
        for request in finished:
            resolve_threadsafe(request.loop, request.future, request.seq.result())
