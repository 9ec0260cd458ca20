"""Where the trainer runs (devices checked at start-up, errors naming the key) and how a batch is cut
(token-budget micro-batches, shares across ranks)."""

from __future__ import annotations

import os

import msgspec
import pytest
import torch

from services.launcher import registry
from services.runtime.config import ConfigError, load_service_config
from services.trainer import batching, devices
from services.trainer.config import DevicesConfig, OptimConfig, TrainerConfig
from services.trainer.optim import build_optimizer

NO_CUDA = not torch.cuda.is_available()


def _loaded(tmp_path, **keys):
    """A run file whose ``[services.trainer.devices]`` has ``keys``."""
    body = "\n".join(f"{k} = {v!r}".replace("'", '"') for k, v in keys.items())
    path = tmp_path / "run.toml"
    path.write_text(f'[run]\nid = "dev"\ndir = "{tmp_path / "run"}"\n[services.trainer.devices]\n{body}\n')
    return load_service_config("trainer", registry.load("trainer")[0], path)


@pytest.mark.skipif(not NO_CUDA, reason="checks the errors of a host without CUDA (this one has a GPU)")
@pytest.mark.parametrize(("key", "value"), [("device", "cuda"), ("device", "cuda:3"), ("ref_device", "cuda:1")])
def test_a_cuda_device_on_a_cpu_host_stops_start_up_naming_the_key(tmp_path, key, value):
    loaded = _loaded(tmp_path, **{key: value})
    with pytest.raises(ConfigError, match=rf"services\.trainer\.devices\.{key} is '{value}'.*no CUDA device"):
        registry.load("trainer")[1](loaded)  # build(): before any model is loaded


def test_a_device_that_is_not_a_device_name_is_refused_at_load(tmp_path):
    with pytest.raises(ConfigError, match=r"services\.trainer\.devices\.device"):
        _loaded(tmp_path, device="tpu")
    with pytest.raises(ConfigError, match=r"services\.trainer\.devices\.world_size"):
        _loaded(tmp_path, world_size=0)


def test_cuda_ranks_take_one_gpu_each():
    if NO_CUDA:
        with pytest.raises(ConfigError, match=r"services\.trainer\.devices\.device is 'cuda:1'"):
            devices.resolve(TrainerConfig(devices=DevicesConfig(device="cuda:1", world_size=2)))
        return
    with pytest.raises(ConfigError, match=r"each rank takes its own GPU"):
        devices.resolve(TrainerConfig(devices=DevicesConfig(device="cuda:1", world_size=2)))


@pytest.mark.skipif(NO_CUDA or torch.cuda.device_count() < 2, reason="needs 2 GPUs: each rank's reference on its own")
def test_each_ranks_reference_sits_on_its_own_gpu():
    cfg = TrainerConfig(devices=DevicesConfig(device="cuda", ref_device="cuda", world_size=2))
    assert devices.resolve(cfg, rank=1).ref_device == "cuda:1"
    with pytest.raises(ConfigError, match=r"ref_device is 'cuda:0' with world_size 2"):
        devices.resolve(TrainerConfig(devices=DevicesConfig(device="cuda", ref_device="cuda:0", world_size=2)))


def test_auto_and_cpu_resolve_on_this_host():
    auto = devices.resolve(TrainerConfig(devices=DevicesConfig(device="auto")))
    assert auto.device == ("cpu" if NO_CUDA else "cuda:0")
    cpu = devices.resolve(TrainerConfig(devices=DevicesConfig(device="cpu", world_size=2)), rank=1, dtype="bfloat16")
    assert (cpu.device, cpu.ref_device, cpu.backend, cpu.dtype) == ("cpu", "cpu", "gloo", "bfloat16")


def test_micro_batches_stay_within_the_token_budget_and_keep_every_row():
    lengths = [3, 17, 9, 9, 30, 1, 12, 12, 5, 8]
    passes = batching.micro_batches(list(range(len(lengths))), lengths, max_rows=4, max_tokens=36)
    assert sorted(i for p in passes for i in p) == list(range(len(lengths)))
    for p in passes:
        assert len(p) <= 4
        assert len(p) == 1 or len(p) * max(lengths[i] for i in p) <= 36
    # the 30-token row fits alone; a row over the budget still runs (alone)
    assert batching.micro_batches([0, 1], [50, 2], max_rows=8, max_tokens=10) == [[0], [1]]
    # no token budget: only the row count bounds a pass
    assert [len(p) for p in batching.micro_batches(list(range(10)), lengths, max_rows=4)] == [4, 4, 2]


def test_ranks_get_balanced_shares_and_the_same_number_of_passes():
    lengths = [40, 2, 2, 2, 2, 2, 2, 2, 2, 2]
    shares = batching.split_across_ranks(lengths, 2)
    assert sorted(shares[0] + shares[1]) == list(range(10))
    assert [sum(lengths[i] for i in s) for s in shares] == [40, 18]  # the long row alone, the rest together
    plan = batching.plan(lengths, 2, max_rows=2)
    assert len(plan[0]) == len(plan[1]) == 5
    assert plan[0][1:] == [[], [], [], []]  # padding passes for the rank with less work
    assert batching.plan([5], 3, max_rows=4) == [[[0]], [[]], [[]]]  # more ranks than rows


def test_the_gpu_example_loads_and_on_this_host_stops_at_the_device_key():
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / "examples" / "gpu.toml"
    loaded = load_service_config("trainer", registry.load("trainer")[0], example)
    cfg = loaded.service
    assert (cfg.devices.device, cfg.devices.world_size, loaded.model.dtype) == ("cuda", 2, "bfloat16")
    load_service_config("rollout", registry.load("rollout")[0], example)
    if NO_CUDA:
        with pytest.raises(ConfigError, match=r"services\.trainer\.devices\.device is 'cuda'"):
            registry.load("trainer")[1](loaded)


def test_gpu_defaults_resolve_for_cuda_and_leave_cpu_unchanged():
    # pure resolution: what a CUDA device gets, decided without a GPU (none here)
    cfg = TrainerConfig()
    cuda = devices.precision_defaults("cuda", "auto", cfg, bf16_supported=lambda: True)
    assert cuda == devices.Precision(dtype="bfloat16", tf32=True, fused_optim=True,
                                     alloc_conf="expandable_segments:True")
    assert devices.precision_defaults("cuda", "auto", cfg, bf16_supported=lambda: False).dtype == "float32"
    assert devices.precision_defaults("cuda", "float32", cfg).dtype == "float32"  # a named dtype is kept
    off = TrainerConfig(devices=DevicesConfig(tf32=False), optim=msgspec.convert({"fused": False}, OptimConfig))
    assert devices.precision_defaults("cuda", "bfloat16", off) == devices.Precision(
        dtype="bfloat16", tf32=False, fused_optim=False, alloc_conf="expandable_segments:True")
    cpu = devices.precision_defaults("cpu", "auto", cfg, bf16_supported=lambda: pytest.fail("not asked on CPU"))
    assert cpu == devices.Precision(dtype="float32", tf32=False, fused_optim=False, alloc_conf="")
    assert devices.precision_defaults("cpu", "bfloat16", cfg).dtype == "bfloat16"


@pytest.mark.skipif(not NO_CUDA, reason="checks that CPU placement touches no GPU setting (this host has a GPU)")
def test_a_cpu_placement_applies_nothing_process_wide(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    before = (torch.backends.cuda.matmul.fp32_precision, torch.get_float32_matmul_precision())
    placed = devices.resolve(TrainerConfig(), dtype="auto")  # the defaults: "auto" everywhere
    assert (placed.device, placed.dtype, placed.tf32, placed.fused_optim) == ("cpu", "float32", False, False)
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
    assert (torch.backends.cuda.matmul.fp32_precision, torch.get_float32_matmul_precision()) == before


def test_the_learner_builds_fused_adamw_only_when_the_placement_says(loop_model_dir):
    from services.trainer.learner import Learner

    cpu = Learner(TrainerConfig(), loop_model_dir, devices.resolve(TrainerConfig(devices=DevicesConfig(device="cpu"))))
    assert cpu.optimizer.defaults["fused"] is None and cpu.placement.dtype == "float32"
    assert build_optimizer(torch.nn.Linear(2, 2), fused=True).defaults["fused"] is True  # what CUDA gets


def test_the_allocator_setting_is_set_once_and_an_operators_value_kept(monkeypatch):
    from services.lib.cuda_alloc import set_alloc_conf

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    assert set_alloc_conf() == "expandable_segments:True" == os.environ["PYTORCH_CUDA_ALLOC_CONF"]
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:256")
    assert set_alloc_conf() == "max_split_size_mb:256"
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    assert set_alloc_conf("") == "" and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ  # CPU: nothing set


@pytest.mark.parametrize(("packing", "varlen", "want"), [(True, True, "rlbus_varlen_sdpa"), (True, False, "sdpa"),
                                                         (False, True, "sdpa")])
def test_the_learner_takes_attention_per_packed_sequence_only_with_packing(loop_model_dir, packing, varlen, want):
    from services.trainer.learner import Learner

    cfg = TrainerConfig(optim=OptimConfig(packing=packing, varlen_attention=varlen))
    learner = Learner(cfg, loop_model_dir, devices.resolve(TrainerConfig(devices=DevicesConfig(device="cpu"))))
    assert learner.model.config._attn_implementation == want
