"""Where the trainer runs (devices checked at start-up, errors naming the key) and how a batch is cut
(token-budget micro-batches, shares across ranks)."""

from __future__ import annotations

import pytest
import torch

from services.launcher import registry
from services.runtime.config import ConfigError, load_service_config
from services.trainer import batching, devices
from services.trainer.config import DevicesConfig, TrainerConfig

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
