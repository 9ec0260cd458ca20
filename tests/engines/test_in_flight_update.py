"""The in-flight weight update contract, one test for every engine: requests running across an update keep
going; each request's tokens carry version 0 then version 1 (never interleaved); every token's logprob is that
of the weights its version names; a request started after the update is the new model's, token for token.

Runs for the torch engine in every environment and for the vLLM engine where vLLM is installed: ``./rlbus
test`` runs this directory in both lanes (``.venv``: torch; ``.venv-vllm``, where ``RLBUS_REQUIRE_VLLM=1``
makes a missing vLLM an error: torch and vllm). No parameter is ever skipped: an engine this environment
cannot run is not a parameter here.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os

import pytest
import torch

from services.lib.engine.base import SamplingParams
from tests.conftest import wait_for_async

_SPEC = importlib.util.find_spec("vllm")
HAVE_VLLM = _SPEC is not None and _SPEC.origin is not None  # a real package, not the tests/vllm directory
if os.environ.get("RLBUS_REQUIRE_VLLM") == "1" and not HAVE_VLLM:
    raise pytest.UsageError("RLBUS_REQUIRE_VLLM=1 but vLLM is not importable: run ./rlbus setup vllm")
ENGINES = ["torch"] + (["vllm"] if HAVE_VLLM else [])

N_REQUESTS, N_TOKENS = 48, 50  # prompt + 50 tokens fit the tiny model's 64 positions
TEXTS = ["12+34=", "7+8=", "40+2=", "99+1=", "5+55=", "3+4="]


def make_engine(kind: str, model_dir):
    if kind == "torch":
        from services.lib.engine.config import TorchEngineConfig
        from services.lib.engine.torch_engine import TorchEngine

        return TorchEngine(TorchEngineConfig(dtype="float32", max_batch_size=64), model_dir, seed=0)
    from services.lib.engine.config import VllmEngineConfig
    from services.lib.engine.vllm_engine import VllmEngine

    # 16 at once: the 48 requests run in waves, so requests are running when the update lands (with all 48 at
    # once vLLM on CPU could finish every one while the update was being staged: none spanned it)
    return VllmEngine(VllmEngineConfig(dtype="float32", max_num_seqs=16, enforce_eager=True, kv_cache_gib=0.25),
                      model_dir, seed=0)


def load(model_dir, state=None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if state is not None:
        model.load_state_dict(state)
    return model


def perturbed(model, seed: int = 7, scale: float = 0.3) -> dict[str, torch.Tensor]:
    """The model's full state dict plus noise (a tied head stays the embeddings, as a trainer sends it)."""
    gen = torch.Generator().manual_seed(seed)
    state = {k: v + scale * torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


@torch.inference_mode()
def forward_logprobs(model, prompt_ids: list[int], tokens: list[int]) -> list[float]:
    ids = torch.tensor([prompt_ids + tokens])
    logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None]).squeeze(1).tolist()


@torch.inference_mode()
def greedy(model, prompt_ids: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


@pytest.mark.parametrize("kind", ENGINES)
async def test_requests_in_flight_take_the_new_version(kind, loop_model_dir):
    old_model = load(loop_model_dir)
    new_state = perturbed(old_model)
    new_model = load(loop_model_dir, new_state)
    engine = make_engine(kind, loop_model_dir)
    await engine.start()
    try:
        def prompt(text: str) -> list[int]:
            return [engine.tokenizer.bos_token_id] + engine.tokenizer.encode(text, add_special_tokens=False)

        texts = [TEXTS[i % len(TEXTS)] for i in range(N_REQUESTS)]
        params = SamplingParams(max_new_tokens=N_TOKENS, temperature=1.0, seed=3, ignore_eos=True)
        start = engine.stats().total_generated_tokens
        tasks = [asyncio.create_task(engine.generate(prompt(t), params)) for t in texts]

        def under_way() -> bool:
            for t in tasks:  # a request that failed fails the test now, not at the deadline
                if t.done() and t.exception() is not None:
                    raise t.exception()
            return engine.stats().total_generated_tokens - start >= N_REQUESTS * 3  # early: the update must land mid-way

        await wait_for_async(under_way, 120, "the requests to be under way")
        await engine.update_weights(new_state, version=1)
        assert engine.version == 1
        results = await asyncio.gather(*tasks)

        spanning = 0
        for text, r in zip(texts, results, strict=True):
            k = r.versions.count(0)
            assert r.versions == [0] * k + [1] * (N_TOKENS - k), r.versions
            spanning += 0 < k < N_TOKENS
            ids = prompt(text)
            expected = forward_logprobs(old_model, ids, r.token_ids)[:k] + forward_logprobs(new_model, ids,
                                                                                             r.token_ids)[k:]
            torch.testing.assert_close(torch.tensor(r.logprobs), torch.tensor(expected), atol=2e-3, rtol=1e-3)
        assert spanning > 0, "no request spanned the update"

        ids = prompt("12+34=")
        fresh = await engine.generate(ids, SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True))
        assert fresh.versions == [1] * 30
        assert fresh.token_ids == greedy(new_model, ids, 30)
        assert fresh.token_ids != greedy(old_model, ids, 30)
    finally:
        await engine.stop()
