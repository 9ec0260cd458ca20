"""Sandbox latency, fork cost, burst creation and the memory of paused sandboxes.

Figures (direct = against the backend in this process, no bus):

* ``create_exec_destroy_ms_p50`` / ``_p99``: create a sandbox, exec ``true``, destroy it, one after another
  (also split into ``create_ms_p50``, ``exec_true_ms_p50``, ``destroy_ms_p50``); ``bare_bwrap_true_ms_p50``
  is a bare ``bwrap --unshare-all ... true`` run between the iterations, the floor under any exec;
* ``fork_ms_p50``: fork a live sandbox whose work directory has 100 MB written in it since its last
  snapshot (``fork_copy_baseline_ms``: ``cp -a`` of the same 100 MB, what a copying fork would cost);
* ``burst_1000_create_s``: 1,000 creates issued at once (and ``burst_1000_destroy_s``);
* ``paused_1000_rss_mb``: 1,000 sandboxes each running a detached ``sleep``, all paused: the summed PSS of
  every process in their cgroups (bwrap monitor, bwrap init, sleep); ``paused_1000_cgroup_mb`` is the
  cgroups' own memory accounting (page cache and kernel memory included). ``--quick`` measures
  ``paused_n`` = 200 sandboxes and scales to 1,000.

Usage: ``sudo python bench/sandbox.py [--quick] [--root DIR]`` (root: overlay mounts and cgroups).
The machine may be shared: ``loadavg_1m`` is reported with the figures. The last stdout line is a JSON
object of the figures. ``--bus URL`` (the same figures through the NATS API) is reserved for the bus
service and not implemented here yet.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Protocol

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from proto import sandbox as api  # noqa: E402
from services.sandbox.backend import SandboxBackend, dispatch  # noqa: E402
from services.sandbox.bwrap import BwrapBackend  # noqa: E402
from services.sandbox.config import SandboxConfig  # noqa: E402

RUN = "bench"
MB = 1 << 20


class Target(Protocol):
    """Where requests go: the backend directly, or (later) the bus API."""

    name: str

    async def call(self, req: Any) -> Any: ...


class Direct:
    name = "direct"

    def __init__(self, backend: SandboxBackend) -> None:
        self.backend = backend

    async def call(self, req: Any) -> Any:
        return await dispatch(self.backend, req)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


async def create(t: Target, **kw: Any) -> str:
    return (await t.call(api.CreateRequest(run_id=RUN, **kw))).sandbox_id


RAW_BWRAP = [
    "bwrap", "--unshare-all", "--die-with-parent", "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin",
    "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64", "--ro-bind", "/etc", "/etc",
    "--dev", "/dev", "--proc", "/proc", "--", "true",
]


async def raw_bwrap_ms() -> float:
    """One bare ``bwrap ... true`` (no cgroup, overlay, uid drop): the floor under an exec."""
    t0 = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(*RAW_BWRAP, stdin=asyncio.subprocess.DEVNULL,
                                                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    await proc.wait()
    return (time.perf_counter() - t0) * 1e3


async def bench_create_exec_destroy(t: Target, n: int) -> dict[str, float]:
    total, c_ms, e_ms, d_ms, raw = [], [], [], [], []
    for i in range(n + 5):
        raw.append(await raw_bwrap_ms())  # interleaved, so both see the same machine load
        t0 = time.perf_counter()
        sid = await create(t)
        t1 = time.perf_counter()
        r = await t.call(api.ExecRequest(run_id=RUN, sandbox_id=sid, command=api.Argv(args=["true"])))
        t2 = time.perf_counter()
        await t.call(api.DestroyRequest(run_id=RUN, sandbox_id=sid))
        t3 = time.perf_counter()
        if r.exit_code != 0:
            raise RuntimeError(f"`true` exited {r.exit_code}: {r.stderr!r}")
        if i >= 5:  # warm-up
            total.append((t3 - t0) * 1e3)
            c_ms.append((t1 - t0) * 1e3)
            e_ms.append((t2 - t1) * 1e3)
            d_ms.append((t3 - t2) * 1e3)
    return {
        "create_exec_destroy_ms_p50": statistics.median(total),
        "create_exec_destroy_ms_p99": pct(total, 0.99),
        "create_ms_p50": statistics.median(c_ms),
        "exec_true_ms_p50": statistics.median(e_ms),
        "destroy_ms_p50": statistics.median(d_ms),
        "bare_bwrap_true_ms_p50": statistics.median(raw[5:]),
    }


async def bench_fork(t: Target, backend: BwrapBackend, n: int) -> dict[str, float]:
    fork_ms, baseline = [], []
    for i in range(n):
        sid = await create(t)
        w = await t.call(api.ExecRequest(run_id=RUN, sandbox_id=sid, timeout_s=120,
                                         command=api.Shell(script="head -c 104857600 /dev/urandom > big")))
        if w.exit_code != 0:
            raise RuntimeError(f"writing 100 MB failed: {w.stderr!r}")
        t0 = time.perf_counter()
        child = (await t.call(api.ForkRequest(run_id=RUN, source=api.FromSandbox(sandbox_id=sid)))).sandbox_id
        fork_ms.append((time.perf_counter() - t0) * 1e3)
        check = await t.call(api.ExecRequest(run_id=RUN, sandbox_id=child, command=api.Shell(script="stat -c %s big")))
        if check.stdout.strip() != b"104857600":
            raise RuntimeError(f"the fork does not see the 100 MB file: {check.stdout!r} {check.stderr!r}")
        if i == 0:  # what a copying fork costs: cp -a of the same directory
            layer = backend.layers.path(backend.sandboxes[sid].tree.layers[0])
            dst = os.path.join(backend.state_dir, "copy-baseline")
            for _ in range(3):
                c0 = time.perf_counter()
                subprocess.run(["cp", "-a", layer, dst], check=True)
                baseline.append((time.perf_counter() - c0) * 1e3)
                shutil.rmtree(dst)
        for x in (child, sid):
            await t.call(api.DestroyRequest(run_id=RUN, sandbox_id=x))
    return {"fork_ms_p50": statistics.median(fork_ms), "fork_copy_baseline_ms": statistics.median(baseline)}


async def bench_burst(t: Target, n: int) -> dict[str, float]:
    t0 = time.perf_counter()
    ids = await asyncio.gather(*(create(t) for _ in range(n)))
    created = time.perf_counter() - t0
    t0 = time.perf_counter()
    await asyncio.gather(*(t.call(api.DestroyRequest(run_id=RUN, sandbox_id=s)) for s in ids))
    return {"burst_1000_create_s": created * 1000 / n, "burst_1000_destroy_s": (time.perf_counter() - t0) * 1000 / n}


def pss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


async def bench_paused(t: Target, backend: BwrapBackend, n: int, concurrency: int = 32) -> dict[str, float]:
    sem = asyncio.Semaphore(concurrency)

    async def one() -> str:
        async with sem:
            sid = await create(t)
            await t.call(api.ExecRequest(run_id=RUN, sandbox_id=sid, detach=True,
                                         command=api.Shell(script="touch /tmp/up; exec sleep 3600")))
            return sid

    async def up(sid: str) -> bool:
        reply = await t.call(api.ReadFilesRequest(run_id=RUN, sandbox_id=sid, paths=["/tmp/up"]))
        return isinstance(reply.files[0], api.FileContent)

    t0 = time.perf_counter()
    ids = await asyncio.gather(*(one() for _ in range(n)))
    waiting = list(ids)
    while waiting:  # every sleep is running (not caught half-way through bwrap's setup by the pause)
        ready = await asyncio.gather(*(up(s) for s in waiting))
        waiting = [s for s, ok in zip(waiting, ready, strict=True) if not ok]
        if waiting:
            await asyncio.sleep(0.1)
    started = time.perf_counter() - t0
    t0 = time.perf_counter()
    await asyncio.gather(*(t.call(api.PauseRequest(run_id=RUN, sandbox_id=s)) for s in ids))
    paused = time.perf_counter() - t0
    pids = [p for s in ids for p in backend.sandboxes[s].cgroup.pids()]
    pss = sum(pss_kb(p) for p in pids) / 1024
    cg = sum(backend.sandboxes[s].cgroup.memory_bytes() for s in ids) / MB
    t0 = time.perf_counter()
    await asyncio.gather(*(t.call(api.DestroyRequest(run_id=RUN, sandbox_id=s)) for s in ids))
    scale = 1000 / n
    return {
        "paused_1000_rss_mb": pss * scale,
        "paused_1000_cgroup_mb": cg * scale,
        "paused_n": n,
        "paused_processes_per_sandbox": len(pids) / n,
        "start_detached_per_sandbox_ms": started * 1e3 / n,
        "pause_per_sandbox_ms": paused * 1e3 / n,
        "destroy_paused_per_sandbox_ms": (time.perf_counter() - t0) * 1e3 / n,
    }


async def main(args: argparse.Namespace) -> dict[str, Any]:
    if args.bus:
        raise SystemExit("--bus is not implemented yet: it needs the sandbox bus service (services/sandbox/main.py)")
    cfg = SandboxConfig(root_dir=args.root, max_sandboxes=5000, default_lease_ttl_s=3600)
    backend = BwrapBackend(cfg, lambda e: None)
    await backend.start()
    target = Direct(backend)
    figures: dict[str, Any] = {"mode": target.name, "quick": args.quick}
    try:
        q = args.quick
        steps = [
            ("create/exec/destroy", bench_create_exec_destroy(target, 100 if q else 500)),
            ("fork with 100 MB", bench_fork(target, backend, 5 if q else 15)),
            ("burst of 1000 creates", bench_burst(target, 1000)),
            ("paused sandboxes", bench_paused(target, backend, 200 if q else 1000)),
        ]
        for name, coro in steps:
            t0 = time.perf_counter()
            out = await coro
            figures.update(out)
            print(f"{name}: {json.dumps({k: round(v, 2) for k, v in out.items()})} ({time.perf_counter() - t0:.1f} s)",
                  file=sys.stderr)
    finally:
        await backend.close()
    figures["loadavg_1m"] = os.getloadavg()[0]
    return {k: round(v, 2) if isinstance(v, float) else v for k, v in figures.items()}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions, 200 paused sandboxes (< 1 minute)")
    parser.add_argument("--root", default="/var/tmp/rlbus-bench-sandbox", help="state directory (root_dir)")
    parser.add_argument("--bus", metavar="URL", help="measure through the NATS API at URL (not implemented yet)")
    parser.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.loop == "uvloop":
        import uvloop

        uvloop.install()
    print(json.dumps(asyncio.run(main(args))))
