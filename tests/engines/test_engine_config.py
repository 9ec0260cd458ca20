"""The engine config is one type: the rollout's ``engine`` section decodes into it and the engine gets it
as read; a config built in code is checked as decoding checks it; reading it imports no torch."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest

from services.lib.engine.base import InvalidRequestError
from services.lib.engine.config import AutoEngineConfig, TorchEngineConfig, VllmEngineConfig
from services.rollout.config import RolloutConfig
from services.rollout.engines import build_engine


def test_the_run_files_section_is_what_the_engine_gets(loop_model_dir):
    cfg = msgspec.convert({"engine": {"type": "torch", "max_batch_size": 7, "max_queued": 9}}, RolloutConfig)
    assert cfg.engine == TorchEngineConfig(max_batch_size=7, max_queued=9)
    engine = build_engine(cfg.engine, loop_model_dir)
    assert engine.config is cfg.engine  # no translation in between
    assert isinstance(msgspec.convert({}, RolloutConfig).engine, AutoEngineConfig)
    vllm = msgspec.convert({"engine": {"type": "vllm", "kv_cache_gib": 1}}, RolloutConfig).engine
    assert vllm == VllmEngineConfig(kv_cache_gib=1.0)
    with pytest.raises(msgspec.ValidationError, match="model_dir"):  # facts of the run are not engine keys
        msgspec.convert({"engine": {"type": "torch", "model_dir": "x"}}, RolloutConfig)
    with pytest.raises(msgspec.ValidationError, match="engine_args repeats"):
        msgspec.convert({"engine": {"type": "vllm", "engine_args": {"seed": 1}}}, RolloutConfig)


def test_a_config_built_in_code_is_checked_naming_the_key():
    with pytest.raises(InvalidRequestError, match="torch engine config: max_batch_size"):
        TorchEngineConfig(max_batch_size=0)
    with pytest.raises(InvalidRequestError, match="torch engine config: dtype"):
        TorchEngineConfig(dtype="float64")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="vllm engine config: gpu_memory_utilization"):
        VllmEngineConfig(gpu_memory_utilization=1.5)
    with pytest.raises(InvalidRequestError, match="max_model_len must be 0"):
        VllmEngineConfig(max_model_len=1)
    with pytest.raises(InvalidRequestError, match="auto engine config: vllm_min_params_m"):
        AutoEngineConfig(vllm_min_params_m=-1.0)
    assert AutoEngineConfig().picks_vllm(134_515_008) and not AutoEngineConfig().picks_vllm(None)


def test_the_config_module_imports_no_torch():
    code = "import sys, services.lib.engine.config, services.rollout.config; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
