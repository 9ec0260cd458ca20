"""The ``vllm`` transport's parts that need no vLLM and no GPU: the layout refusals (same GPU for nccl,
another GPU for ipc, no GPU at all), the group's ranks, the bucket plan, and the run file's rules."""

from __future__ import annotations

import importlib.util

import pytest

from services.launcher.runfile import RunFile
from services.lib.weights.transport import make_receiver, make_sender
from services.lib.weights.vllm_layout import check_gpus, plan_buckets, rank_offsets
from services.runtime.weights_config import ConfigError, VllmTransferConfig


def test_nccl_refuses_an_engine_on_the_trainers_gpu():
    check_gpus("nccl", "GPU-a", {"e1": ["GPU-b", "GPU-c"], "e2": ["GPU-d"]})  # distinct GPUs: fine
    with pytest.raises(ConfigError, match=r"engine e2 has a worker on the trainer's GPU GPU-a.*\[placement\]"):
        check_gpus("nccl", "GPU-a", {"e1": ["GPU-b"], "e2": ["GPU-c", "GPU-a"]})


def test_ipc_refuses_an_engine_on_another_gpu():
    check_gpus("ipc", "GPU-a", {"colocated": ["GPU-a"]})
    with pytest.raises(ConfigError, match=r"'ipc': engine colocated has workers on \['GPU-a', 'GPU-b'\]"):
        check_gpus("ipc", "GPU-a", {"colocated": ["GPU-a", "GPU-b"]})


@pytest.mark.parametrize("backend", ["nccl", "ipc"])
def test_a_trainer_without_a_gpu_is_refused(backend):
    with pytest.raises(ConfigError, match=r"the trainer has none.*type = \"store\""):
        check_gpus(backend, "cpu", {"e1": ["GPU-b"]})


def test_ranks_follow_the_engines_workers():
    offsets, world = rank_offsets({"b": 2, "a": 1, "c": 4})
    assert offsets == {"a": 1, "b": 2, "c": 4} and world == 8  # trainer 0; a: 1; b: 2-3; c: 4-7


def test_buckets_cut_after_the_tensor_that_crosses_the_bound():
    sizes = [("a", 40), ("b", 40), ("c", 40), ("d", 200), ("e", 10)]
    assert plan_buckets(sizes, 100) == [["a", "b", "c"], ["d"], ["e"]]
    assert plan_buckets(sizes, 1000) == [["a", "b", "c", "d", "e"]]
    assert plan_buckets([], 100) == []


def _runfile(tmp_path, body: str) -> RunFile:
    path = tmp_path / "run.toml"
    path.write_text(body)
    return RunFile.load(path, env={})


def test_run_file_derives_the_engines_and_checks_the_layout(tmp_path):
    nccl = '[services.rollout.engine]\ntype = "vllm"\n[weights]\ntype = "vllm"\n'
    runfile = _runfile(tmp_path, '[launcher]\nservices = { trainer = 1, rollout = 3 }\n' + nccl)
    assert isinstance(runfile.weights, VllmTransferConfig) and runfile.weights.backend == "nccl"
    assert runfile.check() == ["weights.engines=3"]
    with pytest.raises(ConfigError, match="weights.engines is 2, but this launcher starts 3"):
        _runfile(tmp_path, '[launcher]\nservices = { trainer = 1, rollout = 3 }\n' + nccl + "engines = 2\n").check()
    with pytest.raises(ConfigError, match='needs services.rollout.engine type = "vllm", not \'torch\''):
        _runfile(tmp_path, '[launcher]\nservices = { trainer = 1, rollout = 1 }\n[services.rollout.engine]\n'
                           'type = "torch"\n[weights]\ntype = "vllm"\n').check()
    ipc = nccl + 'backend = "ipc"\n'
    with pytest.raises(ConfigError, match=r'"ipc" hands CUDA IPC handles to a colocated engine'):
        _runfile(tmp_path, '[launcher]\nservices = { trainer = 1, rollout = 1 }\n' + ipc).check()
    colocated = _runfile(tmp_path, '[launcher]\nservices = { "trainer+rollout" = 1 }\n' + ipc)
    assert colocated.check() == []


def test_bad_values_name_their_key(tmp_path):
    with pytest.raises(ConfigError, match="weights.backend"):
        _runfile(tmp_path, '[weights]\ntype = "vllm"\nbackend = "rdma"\n')
    with pytest.raises(ConfigError, match="weights.bucket_bytes"):
        _runfile(tmp_path, '[weights]\ntype = "vllm"\nbucket_bytes = 10\n')


async def test_the_receiver_needs_a_vllm_engine():
    with pytest.raises(ConfigError, match='services.rollout.engine type = "vllm"'):
        make_receiver(VllmTransferConfig(backend="ipc"), None, "r1", engine=object())


async def test_the_sender_needs_vllm_in_the_trainers_process():
    spec = importlib.util.find_spec("vllm")
    if spec is not None and spec.origin is not None:  # a real package (tests/vllm is a namespace directory)
        pytest.skip("vLLM is importable here: the refusal is for trainers without it (tests/vllm covers the rest)")
    sender = make_sender(VllmTransferConfig(backend="ipc"), None, "r1")
    with pytest.raises(ConfigError, match=r'install vLLM there too \(pip install "rlbus\[vllm\]"\)'):
        await sender.start()
