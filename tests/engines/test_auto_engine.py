"""``engine = { type = "auto" }``, the rollout's default: vLLM for models of at least 50 M parameters where
this environment has vLLM, the torch engine otherwise (BENCHMARKS.md measures both on SmolLM2-135M and the
tiny model). Runs in both lanes: in ``.venv`` (no vLLM) auto must fall back to torch and say why; in
``.venv-vllm`` it must pick vLLM for SmolLM2."""

from __future__ import annotations

import json
import logging

import torch

from services.lib.engine.config import AutoEngineConfig, TorchEngineConfig, VllmEngineConfig, vllm_available
from services.rollout.engines import concrete_engine
from services.tasks.models import model_params


def test_model_size_is_counted_from_the_config(loop_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(loop_model_dir)
    assert model_params(str(loop_model_dir)) == sum(p.numel() for p in model.parameters())
    assert model_params("smollm2") == 134_515_008 and model_params("tiny-addition") == 1_052_160
    assert model_params(str(tmp_path)) is None  # no config.json: unknown, never a guess
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": "x"}))
    assert model_params(str(tmp_path)) is None


def test_auto_picks_by_size_and_environment(loop_model_dir, caplog):
    auto = AutoEngineConfig()
    assert isinstance(concrete_engine(auto, str(loop_model_dir)), TorchEngineConfig)  # ~1 M: torch
    explicit = TorchEngineConfig(max_batch_size=7)
    assert concrete_engine(explicit, "smollm2") is explicit  # a named type is never second-guessed
    with caplog.at_level(logging.INFO, logger="services.rollout.engines"):
        chosen = concrete_engine(auto, "smollm2")
    if vllm_available():
        assert isinstance(chosen, VllmEngineConfig)
        assert chosen.enforce_eager == (not torch.cuda.is_available())
    else:
        assert isinstance(chosen, TorchEngineConfig)
        assert "not installed" in caplog.text and "./rlbus setup vllm" in caplog.text
    assert isinstance(concrete_engine(AutoEngineConfig(vllm_min_params_m=1000), "smollm2"), TorchEngineConfig)
