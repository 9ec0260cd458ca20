"""A vLLM worker killed mid-request: pending requests fail with EngineNotRunningError and the engine says it
errored, so its owner (the rollout service) can exit and be restarted."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from services.lib.engine.base import EngineNotRunningError, SamplingParams
from services.lib.engine.config import VllmEngineConfig
from services.lib.engine.vllm_engine import VllmEngine
from tests.conftest import wait_for_async
from tests.vllm.conftest import vllm_workers


async def test_killed_worker_fails_pending_requests(loop_model_dir):
    engine = VllmEngine(VllmEngineConfig(dtype="float32", max_num_seqs=8, enforce_eager=True, kv_cache_gib=0.25),
                        loop_model_dir, seed=0)
    await engine.start()
    try:
        params = SamplingParams(max_new_tokens=55, temperature=1.0, ignore_eos=True)
        first = await engine.generate([1, 9, 6, 9, 18], SamplingParams(max_new_tokens=3, ignore_eos=True))
        assert len(first.token_ids) == 3 and not engine.errored
        workers = vllm_workers()
        assert workers, "no vLLM worker process found"
        pending = [asyncio.create_task(engine.generate([1, 9, 6, 9, 18], params)) for _ in range(4)]
        await wait_for_async(lambda: engine.stats().total_generated_tokens > 3, 30, "tokens to flow")
        for worker in workers:
            os.kill(worker.pid, signal.SIGKILL)
        for task in pending:
            with pytest.raises(EngineNotRunningError, match="died|stopped"):
                await asyncio.wait_for(task, 60)
        assert engine.errored
        with pytest.raises(EngineNotRunningError):
            await engine.generate([1, 2], params)
    finally:
        await asyncio.wait_for(engine.stop(), 60)
