"""LoRA wired through the learner, the weight version and the torch engine (real tiny Llama, CPU).

* the learner trains adapters only and sends them as an adapter version, far smaller than the full state;
* an engine given that adapter version samples with the same logprobs as one given the merged full weights
  (peft's own merge), version after version (the base is kept, never merged twice);
* a malformed adapter is refused and changes nothing;
* a checkpoint holds the adapters and their optimiser moments: a learner resumed from it takes the same
  next step as the one that kept going;
* a wrong lora key or value stops the config, naming the key.
"""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import torch

from services.lib.engine.base import SamplingParams, WeightUpdateError
from services.lib.engine.config import TorchEngineConfig
from services.lib.engine.torch_engine import TorchEngine
from services.lib.weights import lora_merge
from services.runtime.config import ConfigError, convert
from services.trainer import devices
from services.trainer.config import TrainerConfig
from services.trainer.learner import Learner
from services.trainer.lora import merged_state
from services.trainer.step_input import StepInput
from tests.distributed.rank_script import batch

LORA = {"r": 4, "alpha": 8.0}


def _learner(model_dir, dtype: str = "float32", **groups) -> Learner:
    """A CPU LoRA learner; ``groups``: the config's groups (``loss={...}``), ``dtype`` the run's ``[model] dtype``."""
    optim = {"lr": 1e-2, **groups.pop("optim", {})}
    cfg = msgspec.convert({"devices": {"num_threads": 1, "device": "cpu"}, "optim": optim, "lora": LORA, **groups},
                          TrainerConfig)
    return Learner(cfg, model_dir, devices.resolve(cfg, dtype=dtype))


def _nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


async def _logprobs(engine: TorchEngine, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=11, ignore_eos=True)
    results = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
    return [(r.token_ids, r.logprobs) for r in results]


def test_learner_sends_adapters_and_an_engine_merges_them_like_peft(loop_model_dir):
    learner = _learner(loop_model_dir)
    trainable = [n for n, p in learner.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    full_bytes = _nbytes({k: v for k, v in learner.model.get_base_model().state_dict().items()})
    prompts = [[1, 5, 9, 3], [1, 7, 7, 4, 12], [1, 3]]

    async def main() -> None:
        cfg = TorchEngineConfig(num_threads=1)
        adapted, merged = TorchEngine(cfg, loop_model_dir, seed=0), TorchEngine(cfg, loop_model_dir, seed=0)
        await adapted.start()
        await merged.start()
        try:
            for version in (1, 2):
                metrics = learner.step_input(StepInput.of(batch(version), learner.cfg))
                assert metrics["optim/grad_norm"] > 0
                wire = learner.state_dict()
                assert lora_merge.is_adapter(wire)
                assert all(k == lora_merge.ADAPTER_KEY or k.endswith((".lora_A", ".lora_B")) for k in wire)
                assert _nbytes(wire) < 0.2 * full_bytes
                await adapted.update_weights(wire, version)
                await merged.update_weights(merged_state(learner.model), version)
                got, want = await _logprobs(adapted, prompts), await _logprobs(merged, prompts)
                assert [t for t, _ in got] == [t for t, _ in want]
                for (_, a), (_, b) in zip(got, want, strict=True):
                    assert a == pytest.approx(b, abs=1e-5)
            # version 2's adapters changed the sampled distribution: the comparison above had something to see
            base = TorchEngine(cfg, loop_model_dir, seed=0)
            await base.start()
            try:
                assert [lp for _, lp in await _logprobs(base, prompts)] != [lp for _, lp in got]
            finally:
                await base.stop()

            bad = dict(wire)
            name = next(k for k in bad if k.endswith(".lora_A"))
            bad[name] = torch.zeros(LORA["r"] + 1, bad[name].shape[1])
            with pytest.raises(WeightUpdateError, match="lora_A"):
                await adapted.update_weights(bad, 3)
            assert adapted.version == 2
        finally:
            await adapted.stop()
            await merged.stop()

    asyncio.run(main())


def test_resume_from_an_adapter_checkpoint_takes_the_same_next_step(loop_model_dir, tmp_path):
    torch.manual_seed(0)
    kept = _learner(loop_model_dir)
    kept.step_input(StepInput.of(batch(1), kept.cfg))
    ckpt = kept.save_checkpoint(tmp_path / "checkpoints", 1, {"step": 1})
    assert (ckpt / "adapter" / "adapter_config.json").is_file()
    assert not (ckpt / "model.safetensors").exists()  # no copy of the frozen base

    resumed = _learner(loop_model_dir)  # the base model again: the checkpoint fills in the adapters
    assert resumed.load_optimizer(ckpt) == {"step": 1}
    before = {k: v.clone() for k, v in kept.state_dict().items()}  # views of live parameters otherwise
    assert all(torch.equal(before[k], v) for k, v in resumed.state_dict().items())
    kept.step_input(StepInput.of(batch(2), kept.cfg))
    resumed.step_input(StepInput.of(batch(2), resumed.cfg))
    after_kept, after_resumed = kept.state_dict(), resumed.state_dict()
    assert not torch.equal(after_kept[next(k for k in before if k.endswith("lora_B"))],
                           before[next(k for k in before if k.endswith("lora_B"))])
    for k, v in after_kept.items():
        assert torch.allclose(v, after_resumed[k], atol=1e-7), k

    # the kept-version path of a restart (resume.continue_from_saved): an adapter version loads back
    fresh = _learner(loop_model_dir)
    fresh.load_weights(after_kept)
    assert all(torch.equal(after_kept[k], v) for k, v in fresh.state_dict().items())


def test_final_model_is_saved_merged_and_as_an_adapter(loop_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    learner = _learner(loop_model_dir)
    learner.step_input(StepInput.of(batch(4), learner.cfg))
    learner.save_pretrained(tmp_path / "final_model")
    learner.save_adapter(tmp_path / "final_adapter")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "final_model")
    adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(loop_model_dir),
                                        tmp_path / "final_adapter")
    ids = torch.tensor([[1, 5, 9, 3, 4]])
    with torch.no_grad():
        assert torch.allclose(merged(input_ids=ids).logits, adapter(input_ids=ids).logits, atol=1e-5)
        assert not torch.allclose(merged(input_ids=ids).logits,
                                  AutoModelForCausalLM.from_pretrained(loop_model_dir)(input_ids=ids).logits)


def test_lora_config_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"services\.trainer\.lora\.r"):
        convert({"lora": {"r": 0}}, TrainerConfig, "services.trainer")
    with pytest.raises(ConfigError, match=r"services\.trainer\.lora\.rank"):
        convert({"lora": {"rank": 8}}, TrainerConfig, "services.trainer")
    assert convert({}, TrainerConfig, "services.trainer").lora is None
    assert convert({"lora": {}, "devices": {"world_size": 2}}, TrainerConfig, "services.trainer").lora.r == 8


def test_the_kl_reference_of_a_lora_learner_is_the_base_model(loop_model_dir):
    from services.lib.model_io import sequence_logprobs

    learner = _learner(loop_model_dir, loss={"kl_coef": 0.5})
    assert learner.ref_model is None  # no second copy: the base is the policy with its adapters disabled
    first = learner.step_input(StepInput.of(batch(5), learner.cfg))
    assert first["losses/kl"] == pytest.approx(0.0, abs=1e-7)  # B starts at zero: policy == base
    second = learner.step_input(StepInput.of(batch(5), learner.cfg))
    assert second["losses/kl"] > 1e-6  # the adapters moved the policy away from the base

    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(loop_model_dir)
    prompts, completions = [[1, 5, 9], [1, 3]], [[4, 6, 2], [7, 7]]
    with torch.no_grad(), learner.model.disable_adapter():
        ref, _ = sequence_logprobs(learner.model, prompts, completions, pad_token_id=learner.pad_id)
    with torch.no_grad():
        want, _ = sequence_logprobs(base, prompts, completions, pad_token_id=learner.pad_id)
    assert torch.allclose(ref, want, atol=1e-6)


@pytest.mark.parametrize("keys", [{"optim": {"gradient_checkpointing": True}}, {"dtype": "bfloat16"}])
def test_lora_steps_with_gradient_checkpointing_and_bf16(loop_model_dir, keys):
    learner = _learner(loop_model_dir, **keys)
    metrics = learner.step_input(StepInput.of(batch(6), learner.cfg))
    assert metrics["optim/grad_norm"] > 0
    wire = learner.state_dict()
    b = next(v for k, v in wire.items() if k.endswith(".lora_B"))
    assert b.abs().max() > 0  # the adapters trained
    assert b.dtype == (torch.bfloat16 if keys.get("dtype") == "bfloat16" else torch.float32)  # bf16 on the wire
    assert all(p.dtype == torch.float32 for p in learner.model.parameters() if p.requires_grad)  # fp32 masters


def test_a_full_version_becomes_the_base_the_next_adapters_merge_into(loop_model_dir):
    learner = _learner(loop_model_dir)
    learner.step_input(StepInput.of(batch(7), learner.cfg))
    wire = {k: v.clone() for k, v in learner.state_dict().items()}
    _, pairs = lora_merge.unpack(wire)
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(loop_model_dir).state_dict()
    gen = torch.Generator().manual_seed(3)
    shifted = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in base.items()}  # a full version
    expected = dict(shifted)
    for name, (a, b) in pairs.items():
        expected[name] = lora_merge.merge(shifted[name], a, b, LORA["alpha"] / LORA["r"])
    prompts = [[1, 5, 9, 3], [1, 7, 7, 4, 12]]

    async def main() -> None:
        cfg = TorchEngineConfig(num_threads=1)
        adapted, reference = TorchEngine(cfg, loop_model_dir, seed=0), TorchEngine(cfg, loop_model_dir, seed=0)
        await adapted.start()
        await reference.start()
        try:
            await adapted.update_weights(wire, 1)  # adapters on the model's own base first
            await adapted.update_weights(shifted, 2)  # then a full version: the new base
            await adapted.update_weights(wire, 3)  # the same adapters again, now onto the new base
            await reference.update_weights(expected, 3)
            got, want = await _logprobs(adapted, prompts), await _logprobs(reference, prompts)
            assert [t for t, _ in got] == [t for t, _ in want]
            for (_, a), (_, b) in zip(got, want, strict=True):
                assert a == pytest.approx(b, abs=1e-5)
        finally:
            await adapted.stop()
            await reference.stop()

    asyncio.run(main())
