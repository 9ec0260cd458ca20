"""The engine side of vLLM's weight-transfer handshake (``[weights] type = "vllm"``,
:mod:`services.lib.weights.vllm_transfer`): each step the trainer asks for, run on one ``AsyncLLM``.

``start`` pauses generation (``weight_update_mode`` as for staged updates) and opens vLLM's update;
``update`` receives one batch straight into the workers' parameters (NCCL broadcast or CUDA IPC,
vLLM's worker-side engine); ``finish`` closes it, resets the prefix cache (no token attends to KV
of older weights), labels the version and resumes. An update left open longer than ``timeout_s``
(the trainer died mid-send) resumes generation and is reported: the model may then hold a mix of
two versions until the next one is in.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from services.lib.engine.base import EngineNotRunningError, WeightUpdateError

log = logging.getLogger("rlbus.engine.vllm")


class TransferSteps:
    """vLLM's weight-sync steps on one running ``AsyncLLM`` (see the module docstring)."""

    def __init__(self, backend: str, timeout_s: float, mode: str) -> None:
        self.backend = backend
        self.timeout_s = timeout_s
        self.mode = "keep" if mode == "in_flight" else "wait"
        self._open: asyncio.TimerHandle | None = None  # the watchdog of an open update

    @staticmethod
    def engine_args(steps: TransferSteps | None) -> dict[str, Any]:
        """rlbus's ``AsyncEngineArgs`` for the worker side: its worker extension, and with ``steps`` the
        ``weight_transfer_config`` vLLM builds its receiving engine from (for ``gloo``, on CPU, through the
        extension whose module registers that backend in each worker)."""
        args: dict[str, Any] = {"worker_extension_cls": "services.lib.engine.vllm_weights.VllmWorkerExtension"}
        if steps is not None:
            args["weight_transfer_config"] = {"backend": steps.backend}
            if steps.backend == "gloo":
                args["worker_extension_cls"] = "services.lib.weights.vllm_gloo.GlooWorkerExtension"
        return args

    async def step(self, llm: Any, op: str, info: dict[str, Any], version: int) -> bool:
        """Run ``op`` on ``llm``; True when ``version`` is now in (``finish``)."""
        from vllm.distributed.weight_transfer.base import (
            WeightTransferInitRequest,
            WeightTransferUpdateRequest,
        )

        if llm is None:
            raise EngineNotRunningError("the vllm engine is not running")
        if op == "ping":
            return False
        if op == "init":
            await llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=dict(info)))
        elif op == "shutdown":
            await self._resume(llm)
            await llm.shutdown_weight_transfer_engine()
        elif op == "start":
            if self._open is not None:
                raise WeightUpdateError("a weight update is already open on this engine; finish it first")
            await llm.pause_generation(mode=self.mode, clear_cache=False)
            self._open = asyncio.get_running_loop().call_later(
                self.timeout_s, lambda: asyncio.ensure_future(self._abandoned(llm)))
            try:
                await llm.start_weight_update()
            except BaseException:
                await self._resume(llm)
                raise
        elif op == "update":
            try:
                await llm.update_weights(WeightTransferUpdateRequest(update_info=dict(info)))
            except Exception as exc:
                await self._resume(llm)
                raise WeightUpdateError(f"receiving version {version} failed ({exc}); the model may hold a mix of "
                                        "two versions until the next one is in") from exc
        elif op == "finish":
            try:
                await llm.finish_weight_update(str(version))
                await llm.reset_prefix_cache(reset_running_requests=True)
            finally:
                await self._resume(llm)
            return True
        else:
            raise WeightUpdateError(f"unknown weight transfer step {op!r}")
        return False

    async def _resume(self, llm: Any) -> None:
        handle, self._open = self._open, None
        if handle is not None:
            handle.cancel()
            if not llm.errored:
                await llm.resume_generation()

    async def _abandoned(self, llm: Any) -> None:
        if self._open is not None:
            log.error("a weight update stayed open %.0fs (the trainer died mid-send?); resuming generation, the "
                      "model may hold a mix of two versions until the next one is in", self.timeout_s)
            await self._resume(llm)
