"""``[placement]`` applied by the launcher to real service processes: what each started with, read back from
``/proc/<pid>/environ`` and the kernel's CPU affinity (``os.sched_getaffinity``), a trainer rank group's
ranks each on their own share of its CPUs, and a placement this host cannot serve refused before anything
starts."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from services.launcher.supervisor import Supervisor
from services.runtime.config import ConfigError
from services.runtime.placement import format_cpus
from tests.conftest import run_file, wait_for

pytestmark = pytest.mark.slow


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def started(sup: Supervisor) -> dict[str, int]:
    return {c.label: c.proc.pid for c in sup.children if c.proc is not None}


#: two CPUs this process may use (the tests pin services to them)
A, B = sorted(os.sched_getaffinity(0))[:2] if len(os.sched_getaffinity(0)) >= 2 else (0, 0)
needs_two_cpus = pytest.mark.skipif(A == B, reason="needs two CPUs")


@needs_two_cpus
def test_each_service_starts_with_its_gpus_cpus_and_threads(tmp_path, loop_model_dir):
    cfg = run_file(tmp_path, loop_model_dir, run_id="placed", services={"trainer": 1, "judge": 1, "echo": 2},
                   trainer={"devices": {"device": "auto", "num_threads": 1}}, extra=f"""
[placement]
trainer = {{ gpus = [1], cpus = [{A}, {B}] }}
judge = {{ cpus = [{B}], threads = 3 }}
echo = {{ cpus = [{A}, {B}] }}
""")
    sup = Supervisor(str(cfg), quiet=True)
    try:
        sup.start()
        pids = started(sup)
        env = {label: environ(pid) for label, pid in pids.items()}
        cpus = {label: os.sched_getaffinity(pid) for label, pid in pids.items()}
    finally:
        sup.stop()
    # the trainer may use a GPU: it sees GPU 1 of the launcher's as its only one
    assert env["trainer-0"]["CUDA_VISIBLE_DEVICES"] == "1"
    assert cpus["trainer-0"] == {A, B} and env["trainer-0"]["OMP_NUM_THREADS"] == "2"
    # CPU-only services never see a GPU; their threads follow their CPUs (or the placement's threads)
    assert env["judge-0"]["CUDA_VISIBLE_DEVICES"] == "" and cpus["judge-0"] == {B}
    assert env["judge-0"]["OMP_NUM_THREADS"] == env["judge-0"]["MKL_NUM_THREADS"] == "3"
    assert env["echo-0"]["CUDA_VISIBLE_DEVICES"] == env["echo-1"]["CUDA_VISIBLE_DEVICES"] == ""
    assert (cpus["echo-0"], cpus["echo-1"]) == ({A}, {B})  # one CPU each
    assert env["echo-0"]["OMP_NUM_THREADS"] == env["echo-1"]["OMP_NUM_THREADS"] == "1"


@needs_two_cpus
def test_a_rank_group_shares_its_cpus_out_among_its_ranks(tmp_path, loop_model_dir):
    cfg = run_file(tmp_path, loop_model_dir, run_id="ranked", services={"trainer": 1},
                   trainer={"devices": {"device": "cpu", "world_size": 2, "num_threads": 1}},
                   extra=f"[placement]\ntrainer = {{ cpus = [{A}, {B}] }}\n")
    sup = Supervisor(str(cfg), quiet=True)
    try:
        sup.start()
        threading.Thread(target=sup.wait, name="supervisor", daemon=True).start()
        rank0 = started(sup)["trainer-0"]
        pid_file = tmp_path / "run" / "ranks" / "rank-1.pid"
        rank1 = wait_for(lambda: pid_file.exists() and int(pid_file.read_text() or 0), 120, "rank 1 started")
        env0, env1 = environ(rank0), environ(rank1)
        cpus0, cpus1 = os.sched_getaffinity(rank0), os.sched_getaffinity(rank1)
    finally:
        sup.stop()
    assert env0["CUDA_VISIBLE_DEVICES"] == env1["CUDA_VISIBLE_DEVICES"] == ""  # a trainer on "cpu"
    assert env0["RLBUS_PLACEMENT_CPUS"] == format_cpus([A, B])  # the group's CPUs ...
    assert cpus0 == {A} and cpus1 == {B}  # ... one each for rank 0 and rank 1
    assert env1["OMP_NUM_THREADS"] == "1" and env1["RLBUS_PLACEMENT_CPUS"] == str(B)


def test_a_placement_this_host_cannot_serve_stops_the_launcher_before_anything_starts(tmp_path):
    missing = max(os.sched_getaffinity(0)) + 1
    cfg = run_file(tmp_path, "tiny-addition", run_id="unplaced", services={"echo": 1}, trainer={},
                   extra=f"[placement]\necho = {{ cpus = [{missing}] }}\n")
    with pytest.raises(ConfigError, match=rf"placement.echo.cpus: CPU\(s\) \[{missing}\] are not available"):
        Supervisor(str(cfg), quiet=True)
    assert not (tmp_path / "run" / "nats").exists()  # no NATS, no service
