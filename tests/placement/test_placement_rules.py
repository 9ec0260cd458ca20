"""``[placement]`` against the layout, checked on the typed run file: each instance's slice of GPUs and CPUs,
the environment a process starts with, and the refusals (each naming its keys) before anything starts."""

from __future__ import annotations

from typing import Any

import pytest

from services.launcher.placement import Layout
from services.launcher.runfile import RunFile
from services.runtime.config import ConfigError
from services.runtime.placement import format_cpus, parse_cpus, split_evenly


def runfile(services: dict[str, int], placement: dict[str, Any], trainer: dict[str, Any] | None = None,
            engine: dict[str, Any] | None = None, launcher: dict[str, Any] | None = None) -> RunFile:
    tree = {"launcher": {"services": services, **(launcher or {})}, "placement": placement,
            "services": {"trainer": {"devices": trainer or {"device": "cuda", "world_size": 1}},
                         "rollout": {"engine": engine or {"type": "vllm"}}}}
    return RunFile.from_tree(tree)


def refused(rf: RunFile) -> str:
    with pytest.raises(ConfigError) as e:
        rf.check()
    return str(e.value)


def test_cpu_lists_parse_and_print_like_linux():
    assert parse_cpus("0-3,8,10-11", "k") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpus([4, 2], "k") == [4, 2]
    assert format_cpus([0, 1, 2, 3, 8, 10, 11]) == "0-3,8,10-11"
    for bad in ("0-", "a", "3-1"):
        with pytest.raises(ConfigError, match="config key k"):
            parse_cpus(bad, "k")
    with pytest.raises(ConfigError, match="CPU 1 is listed twice"):
        parse_cpus("0-2,1", "k")
    assert split_evenly([0, 1, 2, 3, 4], 2) == [[0, 1, 2], [3, 4]]
    assert split_evenly([7], 2) == [[7], [7]]  # a share is never empty


def test_instances_take_their_slices_and_start_with_them():
    rf = runfile({"trainer": 1, "rollout": 2, "judge": 1},
                 {"trainer": {"gpus": [0, 1, 2, 3], "cpus": "0-7"}, "rollout": {"gpus": [4, 5, 6, 7], "cpus": [8, 9]},
                  "judge": {"cpus": "10-11", "threads": 4}},
                 trainer={"device": "cuda", "world_size": 4})
    rf.check()
    layout = Layout(rf)
    env: dict[str, str] = {}
    host = set(range(16))
    assert layout.gpu_slots("rollout") == [[4, 5], [6, 7]]
    r1 = layout.for_instance("rollout", 1, env, host)
    assert r1.env["CUDA_VISIBLE_DEVICES"] == "6,7" and r1.cpus == [9] and r1.env["OMP_NUM_THREADS"] == "1"
    t0 = layout.for_instance("trainer", 0, env, host)
    assert t0.env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3" and t0.env["RLBUS_PLACEMENT_CPUS"] == "0-7"
    assert t0.env["OMP_NUM_THREADS"] == t0.env["MKL_NUM_THREADS"] == "8"
    judge = layout.for_instance("judge", 0, env, host)
    assert judge.env["CUDA_VISIBLE_DEVICES"] == "" and judge.env["OMP_NUM_THREADS"] == "4"
    assert layout.requests("trainer") == (4, 8) and layout.requests("rollout") == (2, 1)
    # a third rollout (rlbus scale rollout=3) has no slice left: refused, naming the key
    with pytest.raises(ConfigError, match="placement.rollout.gpus: no GPUs left for instance 2"):
        layout.for_instance("rollout", 2, env, host)
    # indices are the launcher's own view: into its CUDA_VISIBLE_DEVICES when it has one
    outer = {"CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b,GPU-c,GPU-d,GPU-e,GPU-f,GPU-g,GPU-h"}
    assert layout.for_instance("rollout", 0, outer, host).env["CUDA_VISIBLE_DEVICES"] == "GPU-e,GPU-f"
    with pytest.raises(ConfigError, match="placement.trainer.gpus.*CUDA_VISIBLE_DEVICES='0,1', which has 2"):
        layout.for_instance("trainer", 0, {"CUDA_VISIBLE_DEVICES": "0,1"}, host)


def test_cpu_only_services_get_no_gpu_placed_or_not():
    rf = runfile({"trainer": 1, "rollout": 1, "judge": 1, "sandbox": 1, "weightsync": 1}, {},
                 trainer={"device": "cpu"}, engine={"type": "torch", "device": "cpu"})
    rf.check()
    layout = Layout(rf)
    for name in ("trainer", "rollout", "judge", "sandbox", "weightsync"):
        assert layout.for_instance(name, 0, {}).env == {"CUDA_VISIBLE_DEVICES": ""}, name
    gpu = runfile({"trainer": 1, "rollout": 1}, {}, engine={"type": "torch", "device": ""})
    assert "CUDA_VISIBLE_DEVICES" not in Layout(gpu).for_instance("rollout", 0, {}).env  # may use a GPU: inherits
    msg = refused(runfile({"trainer": 1, "judge": 1}, {"judge": {"gpus": [0]}}))
    assert "placement.judge.gpus" in msg and "CPU only" in msg


def test_a_trainer_and_a_separate_vllm_engine_never_share_a_gpu():
    msg = refused(runfile({"trainer": 1, "rollout": 2}, {"trainer": {"gpus": [0, 1]}, "rollout": {"gpus": [1, 2]}},
                          trainer={"device": "cuda", "world_size": 2}))
    assert "placement.trainer.gpus and placement.rollout.gpus" in msg and "GPU 1" in msg
    assert "trainer-0" in msg and "rollout-0" in msg and "trainer+rollout" in msg
    # two vLLM engines on one GPU neither
    msg = refused(runfile({"trainer": 1, "rollout": 1, "trainer+rollout": 1},
                          {"rollout": {"gpus": [3]}, "trainer+rollout": {"gpus": [3]}}))
    assert "placement.rollout.gpus and placement.trainer+rollout.gpus" in msg
    # unplaced on a GPU host, each would take cuda:0 of every GPU it sees: the "every vLLM lands on GPU 0"
    msg = refused(runfile({"trainer": 1, "rollout": 1}, {"trainer": {"gpus": [0]}}))
    assert "GPU 0 is given to trainer-0 (trainer) and rollout-0 (vllm)" in msg and "placement.rollout.gpus unset" in msg
    runfile({"trainer": 1, "rollout": 1}, {"rollout": {"gpus": [1]}}).check()  # the trainer keeps cuda:0
    runfile({"trainer": 1, "rollout": 1}, {}, trainer={"device": "auto"}).check()  # a CPU host may run this file
    # colocated in one process they time-share it; a torch engine may share a GPU with the trainer
    runfile({"trainer+rollout": 1}, {"trainer+rollout": {"gpus": [0]}}).check()
    runfile({"trainer": 1, "rollout": 1}, {"trainer": {"gpus": [0]}, "rollout": {"gpus": [0]}},
            engine={"type": "torch", "device": "cuda"}).check()


def test_devices_and_instances_must_fit_their_gpus():
    msg = refused(runfile({"trainer": 1}, {"trainer": {"gpus": [0, 1]}}, trainer={"device": "cuda", "world_size": 4}))
    assert "services.trainer.devices.world_size" in msg and "placement.trainer.gpus" in msg
    msg = refused(runfile({"trainer": 1}, {"trainer": {"gpus": [5]}}, trainer={"device": "cuda:1"}))
    assert "services.trainer.devices.device is 'cuda:1'" in msg and "cuda:0..cuda:0" in msg
    msg = refused(runfile({"trainer": 1, "rollout": 1}, {"rollout": {"gpus": [1]}},
                          engine={"type": "torch", "device": "cuda:2"}))
    assert "services.rollout.engine.device" in msg
    msg = refused(runfile({"trainer": 1, "rollout": 1}, {"rollout": {"gpus": [1, 2]}},
                          engine={"type": "vllm", "tensor_parallel_size": 4}))
    assert "tensor_parallel_size" in msg
    msg = refused(runfile({"trainer": 1, "rollout": 3}, {"rollout": {"gpus": [1, 2]}}))
    assert "placement.rollout.gpus" in msg and "3 instance(s)" in msg
    # the autoscaler's max counts: every instance it may start needs its slice
    msg = refused(runfile({"trainer": 1, "rollout": 1}, {"rollout": {"gpus": [1, 2], "gpus_per_instance": 1}},
                          launcher={"autoscale": {"rollout": {"min": 1, "max": 3}}}))
    assert "placement.rollout.gpus" in msg and "3 instances" in msg
    msg = refused(runfile({"trainer": 1}, {"rollout": {"cpus": [0]}}))
    assert "placement.rollout: not a service of [launcher] services" in msg
    msg = refused(runfile({"trainer": 1}, {"trainer": {"gpus": [0, 0]}}))
    assert "placement.trainer.gpus: a GPU is listed twice" in msg


def test_cpus_the_launcher_may_not_use_are_refused_on_its_host():
    import os

    missing = max(os.sched_getaffinity(0)) + 1
    rf = runfile({"trainer": 1, "judge": 1}, {"judge": {"cpus": [missing]}})
    rf.check()  # the file is fine on a bigger host ...
    with pytest.raises(ConfigError, match=rf"placement.judge.cpus: CPU\(s\) \[{missing}\] are not available"):
        Layout(rf).check_host({})  # ... this one cannot serve it


def test_a_multi_node_group_names_its_keys():
    msg = refused(runfile({"trainer": 1}, {}, trainer={"device": "cpu", "world_size": 3, "nnodes": 2}))
    assert "services.trainer.devices.world_size (3) is not a multiple of services.trainer.devices.nnodes" in msg
    msg = refused(runfile({"trainer": 1}, {}, trainer={"device": "cpu", "world_size": 2, "nnodes": 2}))
    assert "master_addr" in msg and "master_port" in msg
    msg = refused(runfile({"trainer": 1}, {}, trainer={"device": "cpu", "nnodes": 2, "world_size": 2,
                                                        "node_rank": 2, "master_addr": "a", "master_port": 1}))
    assert "node_rank is 2" in msg


def test_an_explicit_thread_count_above_the_placed_cpus_is_refused_naming_both_keys():
    cpu_trainer = {"device": "cpu", "num_threads": 2}
    torch_engine = {"type": "torch", "device": "cpu", "num_threads": 2}
    layout = {"trainer": 1, "rollout": 1}
    # one core each (the disjoint pools of bench/longtail.py): 2 threads would spin against each other
    msg = refused(runfile(layout, {"trainer": {"cpus": [0]}}, trainer=cpu_trainer))
    assert "services.trainer.devices.num_threads is 2" in msg and "placement.trainer.cpus gives each instance 1" in msg
    msg = refused(runfile(layout, {"rollout": {"cpus": "1"}}, trainer=cpu_trainer, engine=torch_engine))
    assert "services.rollout.engine.num_threads is 2" in msg and "placement.rollout.cpus" in msg
    # a rank group: each rank gets its share of the CPUs
    msg = refused(runfile(layout, {"trainer": {"cpus": [0, 1]}}, trainer={**cpu_trainer, "world_size": 2}))
    assert "gives each rank 1 CPU(s)" in msg
    # 0 follows the placement (OMP_NUM_THREADS); a count within the CPUs, or an unplaced process, is fine
    runfile(layout, {"trainer": {"cpus": [0]}, "rollout": {"cpus": [1]}},
            trainer={"device": "cpu", "num_threads": 0}, engine={**torch_engine, "num_threads": 1}).check()
    runfile(layout, {"trainer": {"cpus": [0, 1]}}, trainer=cpu_trainer, engine=torch_engine).check()
    runfile(layout, {}, trainer=cpu_trainer, engine=torch_engine).check()
