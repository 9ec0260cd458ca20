"""Sandbox latency, fork cost, burst creation and the memory of paused sandboxes.

Figures (direct = against the backend in this process, no bus):

* ``create_exec_destroy_ms_p50`` / ``_p99``: create a sandbox, exec ``true``, destroy it, one after another
  (also split into ``create_ms_p50``, ``exec_true_ms_p50``, ``destroy_ms_p50``); ``bare_bwrap_true_ms_p50``
  is a bare ``bwrap --unshare-all ... true`` run between the iterations, the floor under any exec;
* ``fork_ms_p50``: fork a live sandbox whose work directory has 100 MB written in it since its last
  snapshot (``fork_copy_baseline_ms``: ``cp -a`` of the same 100 MB, what a copying fork would cost);
* ``burst_1000_create_s``: 1,000 creates issued at once (and ``burst_1000_destroy_s``); with ``--burst N``
  also ``burst_n_create_s`` / ``burst_n_destroy_s``: N creates at once, in total (direct), and
  ``burst_n_mounts``: the mounts they held (two each: the quota volume and the overlay);
* ``paused_1000_rss_mb``: 1,000 sandboxes each running a detached ``sleep``, all paused: the summed PSS of
  every process in their cgroups (bwrap monitor, bwrap init, sleep); ``paused_1000_cgroup_mb`` is the
  cgroups' own memory accounting (page cache and kernel memory included). ``--quick`` measures
  ``paused_n`` = 200 sandboxes and scales to 1,000.

Through the bus (``bus_`` prefix; skipped with ``--direct-only``): the same create/exec/destroy,
fork and burst figures measured with :class:`services.lib.sandbox_client.SandboxClient` against
``rlbus service sandbox`` running as its own process (uvloop) on an embedded nats-server (or the
server at ``--bus URL``); every lifecycle event is published to JetStream as in production.
Direct and bus iterations alternate so both see the same machine load; ``ratio_*`` = bus / direct.
``bus_burst_events_stored_s``: from the start of the bus burst until its 2,000 lifecycle events
(created, destroyed) are stored in SANDBOX_EVENTS. ``bus_renew_lease_ms_p50`` is one request/reply round trip with next to no work (the floor of the bus
overhead; ``renew_lease_ms_p50`` is the same call made directly).

Exec paths (``path_<p>_`` prefix, ``p`` = ``bwrap``, ``hybrid``, ``server``: the backend's ``exec_path``, one
backend each, iterations interleaved; ``--exec-paths-only`` runs just these): the create → exec ``true`` →
destroy cycle and its parts, and ``warm_exec_ms``: ``true`` exec'd in a long-lived sandbox whose exec server
is ready (the steady state of an agent's tool calls); ``warm_exec_cpu_ms``: the CPU one warm exec costs in
all (this process, its reaped children, and the sandbox's exec server with everything it reaped), a figure
that machine load does not inflate as it does latencies; ``ratio_<p>_over_bwrap_*`` compare them. Side ``pool``
is the default ``hybrid`` path with a warm pool of ``--pool N`` sandboxes (``warm_pool``): its creates take a
sandbox built ahead, its server running, so its first exec goes through the server; ``pool_hits`` /
``pool_misses`` say how many of its measured creates the pool served (the refill builds one sandbox at a time, at
idle CPU priority, while the other sides run their cycles), ``pool_build_ms_*`` how long building one took,
``pool_server_start_cpu_ms`` / ``pool_sandbox_memory_mb`` what one costs while it waits, and
``ratio_pool_over_hybrid_*`` compare it with the same path without a pool. The other figures are measured with
``warm_pool = 0``, as before the pool existed.

Overload (``--overload N``, only this): N clients at once, each repeating create → exec ``true`` → destroy
through the bus for ``--overload-s`` seconds against ``rlbus service sandbox`` with its host-default bounds;
a refused (``overloaded``) create is counted and the client backs off by its ``retry_after_s`` (jittered)
before trying again. Figures: ``overload_served_per_s`` (cycles completed), ``overload_refused_per_s``,
``overload_timeouts`` / ``overload_errors`` (anything else; ``overload_errors_during_stop`` after the SIGTERM), ``overload_refusal_ms_p50``/``_p99`` (how fast a
refusal comes), ``overload_cycle_ms_p50``/``_p99``, ``overload_live_max`` (the most live sandboxes seen),
then the service is sent SIGTERM with the clients still sending: ``overload_stop_s`` (until it exited),
``overload_left_sandboxes`` (sandbox directories it left) and ``overload_reaped_after`` (what the next start
reaped). ``--service-repo DIR`` runs the service from another checkout (e.g. the code before a change).

Usage: ``sudo python bench/sandbox.py [--quick] [--root DIR] [--bus URL | --direct-only]`` (root: overlay
mounts and cgroups). The machine may be shared: ``loadavg_1m`` is reported with the figures. A table of the
latencies (p50 and p99 side by side, against the goals of issue 17: create+exec+destroy p50 <= 10 ms, p99 <=
50 ms) is printed before the last stdout line, a JSON object of the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import io
import json
import logging
import os
import pstats
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Protocol

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from proto import catalog  # noqa: E402
from proto import sandbox as api  # noqa: E402
from services.lib.sandbox_client import SandboxClient  # noqa: E402
from services.sandbox.backend import SandboxBackend, dispatch  # noqa: E402
from services.sandbox.bwrap import BwrapBackend  # noqa: E402
from services.sandbox.config import SandboxConfig  # noqa: E402
from services.sandbox.overlay import mounts_under  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

RUN = "bench"
MB = 1 << 20


class Target(Protocol):
    """Where requests go: the backend directly, or the bus API."""

    #: prefix of this target's figures ("" direct, "bus_" through the bus)
    prefix: str

    async def call(self, req: Any) -> Any: ...


class Direct:
    prefix = ""

    def __init__(self, backend: SandboxBackend) -> None:
        self.backend = backend

    async def call(self, req: Any) -> Any:
        return await dispatch(self.backend, req)


class Bus:
    prefix = "bus_"

    def __init__(self, client: SandboxClient) -> None:
        self.client = client

    async def call(self, req: Any) -> Any:
        return await self.client.call(req)


@contextlib.asynccontextmanager
async def bus_target(url: str | None, root: str, service_toml: str = "max_sandboxes = 5000\nwarm_pool = 0\n",
                     repo: Path = REPO, client_kw: dict[str, Any] | None = None,
                     procs: list[subprocess.Popen[bytes]] | None = None) -> AsyncIterator[Bus]:
    """``rlbus service sandbox`` (from ``repo``) as a child process on ``url`` (None: an embedded nats-server);
    its process is appended to ``procs``."""
    import nats

    from services.runtime.natsd import EmbeddedNats

    with tempfile.TemporaryDirectory(prefix="rlbus-bench-bus-") as tmp:
        server = None
        if url is None:
            server = EmbeddedNats(Path(tmp) / "nats", port=None)
            server.start()
            url = server.url
        cfg = Path(tmp) / "run.toml"
        cfg.write_text(f'[run]\nid = "{RUN}"\n[nats]\nurl = "{url}"\n[common]\nlog_level = "WARNING"\n'
                       f'[services.sandbox]\nroot_dir = "{root}"\ndefault_lease_ttl_s = 3600\n{service_toml}')
        log_path = Path(tmp) / "service.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen([sys.executable, "-m", "services.launcher.cli", "service", "sandbox",
                                     "--config", str(cfg)], cwd=repo, stdout=log, stderr=subprocess.STDOUT,
                                    env={**os.environ, "PYTHONPATH": str(repo)})
        if procs is not None:
            procs.append(proc)
        nc = await nats.connect(url, pending_size=256 * MB)
        try:
            client = SandboxClient(nc, RUN, **(client_kw or {"timeout_s": 120.0}))
            ready = asyncio.create_task(client.wait_ready(timeout_s=60.0), name="bench-bus-ready")
            exited = asyncio.create_task(asyncio.to_thread(proc.wait), name="bench-bus-service-exit")
            await asyncio.wait({ready, exited}, return_when=asyncio.FIRST_COMPLETED)
            if not ready.done():
                ready.cancel()
                raise SystemExit(f"the sandbox service exited ({proc.returncode}):\n{log_path.read_text()[-2000:]}")
            await ready
            yield Bus(client)
        finally:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(120)
            await nc.close()
            if server is not None:
                server.stop()


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


async def create_exec_destroy(t: Target) -> tuple[float, float, float, float]:
    """One create → exec ``true`` → destroy; the ms of (all, create, exec, destroy)."""
    t0 = time.perf_counter()
    sid = await create(t)
    t1 = time.perf_counter()
    r = await t.call(api.ExecRequest(run_id=RUN, sandbox_id=sid, command=api.Argv(args=["true"])))
    t2 = time.perf_counter()
    await t.call(api.DestroyRequest(run_id=RUN, sandbox_id=sid))
    t3 = time.perf_counter()
    if r.exit_code != 0:
        raise RuntimeError(f"`true` exited {r.exit_code}: {r.stderr!r}")
    return (t3 - t0) * 1e3, (t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3


async def bench_create_exec_destroy(targets: list[Target], n: int) -> dict[str, float]:
    samples: dict[str, list[tuple[float, float, float, float]]] = {t.prefix: [] for t in targets}
    renew: dict[str, list[float]] = {t.prefix: [] for t in targets}
    raw = []
    for i in range(n + 5):
        raw.append(await raw_bwrap_ms())  # interleaved, so every target sees the same machine load
        for t in targets:
            one = await create_exec_destroy(t)
            if i >= 5:  # warm-up
                samples[t.prefix].append(one)
        if i % 5 == 0:  # a round trip with next to no work: the request/reply overhead itself
            for t in targets:
                sid = await create(t)
                for _ in range(5):
                    r0 = time.perf_counter()
                    await t.call(api.RenewLeaseRequest(run_id=RUN, sandbox_id=sid))
                    renew[t.prefix].append((time.perf_counter() - r0) * 1e3)
                await t.call(api.DestroyRequest(run_id=RUN, sandbox_id=sid))
    out = {"bare_bwrap_true_ms_p50": statistics.median(raw[5:])}
    for p, rows in samples.items():
        total, c_ms, e_ms, d_ms = (list(col) for col in zip(*rows, strict=True))
        out.update({
            f"{p}create_exec_destroy_ms_p50": statistics.median(total),
            f"{p}create_exec_destroy_ms_p99": pct(total, 0.99),
            f"{p}create_exec_destroy_n": len(total),
            f"{p}create_ms_p50": statistics.median(c_ms),
            f"{p}create_ms_p99": pct(c_ms, 0.99),
            f"{p}exec_true_ms_p50": statistics.median(e_ms),
            f"{p}exec_true_ms_p99": pct(e_ms, 0.99),
            f"{p}destroy_ms_p50": statistics.median(d_ms),
            f"{p}destroy_ms_p99": pct(d_ms, 0.99),
            f"{p}renew_lease_ms_p50": statistics.median(renew[p]),
        })
    return out


#: latency rows of the table: (label, figure stem, goal p50 ms, goal p99 ms)
LATENCIES = [
    ("create+exec+destroy", "create_exec_destroy_ms", 10.0, 50.0),
    ("  create", "create_ms", None, None),
    ("  exec true", "exec_true_ms", None, None),
    ("  destroy", "destroy_ms", None, None),
]


def latency_table(figures: dict[str, Any]) -> str:
    """p50 and p99 of each latency, per target (direct, bus), with the goals and whether they are met."""
    lines = [f"{'latency (ms)':<28}{'p50':>8}{'p99':>8}   goal"]
    for prefix, target in (("", "direct"), ("bus_", "bus")):
        if f"{prefix}create_exec_destroy_ms_p50" not in figures:
            continue
        n = figures[f"{prefix}create_exec_destroy_n"]
        for label, stem, goal50, goal99 in LATENCIES:
            p50, p99 = figures[f"{prefix}{stem}_p50"], figures[f"{prefix}{stem}_p99"]
            goal = ""
            if goal50 is not None and goal99 is not None:
                goal = (f"p50 <= {goal50:g} ({'met' if p50 <= goal50 else 'NOT met'}), "
                        f"p99 <= {goal99:g} ({'met' if p99 <= goal99 else 'NOT met'})")
            lines.append(f"{target + ' ' + label:<28}{p50:>8.1f}{p99:>8.1f}   {goal}".rstrip())
        lines.append(f"{target + ' samples':<28}{n:>8}")
    if "bare_bwrap_true_ms_p50" in figures:
        lines.append(f"{'bare bwrap true':<28}{figures['bare_bwrap_true_ms_p50']:>8.1f}")
    return "\n".join(lines)


async def fork_100mb(t: Target, backend: BwrapBackend | None) -> tuple[float, list[float]]:
    """Fork a sandbox with 100 MB written since its last snapshot; the fork's ms (and, given the
    backend, 3 × the ms of ``cp -a`` of the same layer)."""
    baseline: list[float] = []
    sid = await create(t)
    w = await t.call(api.ExecRequest(run_id=RUN, sandbox_id=sid, timeout_s=120,
                                     command=api.Shell(script="head -c 104857600 /dev/urandom > big")))
    if w.exit_code != 0:
        raise RuntimeError(f"writing 100 MB failed: {w.stderr!r}")
    t0 = time.perf_counter()
    child = (await t.call(api.ForkRequest(run_id=RUN, source=api.FromSandbox(sandbox_id=sid)))).sandbox_id
    fork_ms = (time.perf_counter() - t0) * 1e3
    check = await t.call(api.ExecRequest(run_id=RUN, sandbox_id=child, command=api.Shell(script="stat -c %s big")))
    if check.stdout.strip() != b"104857600":
        raise RuntimeError(f"the fork does not see the 100 MB file: {check.stdout!r} {check.stderr!r}")
    if backend is not None:  # what a copying fork costs: cp -a of the same directory
        layer = backend.layers.path(backend.sandboxes[sid].tree.layers[0])
        dst = os.path.join(backend.state_dir, "copy-baseline")
        for _ in range(3):
            c0 = time.perf_counter()
            subprocess.run(["cp", "-a", layer, dst], check=True)
            baseline.append((time.perf_counter() - c0) * 1e3)
            shutil.rmtree(dst)
    for x in (child, sid):
        await t.call(api.DestroyRequest(run_id=RUN, sandbox_id=x))
    return fork_ms, baseline


async def bench_fork(targets: list[Target], backend: BwrapBackend, n: int) -> dict[str, float]:
    fork_ms: dict[str, list[float]] = {t.prefix: [] for t in targets}
    baseline: list[float] = []
    for i in range(n):
        for t in targets:
            ms, base = await fork_100mb(t, backend if i == 0 and isinstance(t, Direct) else None)
            fork_ms[t.prefix].append(ms)
            baseline += base
    out = {f"{p}fork_ms_p50": statistics.median(v) for p, v in fork_ms.items()}
    out["fork_copy_baseline_ms"] = statistics.median(baseline)
    return out


class EventCounter:
    """Counts this run's lifecycle events as the server routes them (a stored JetStream message is routed)."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.seen = 0
        self.done = asyncio.Event()
        self.sub: Any = None

    @classmethod
    async def start(cls, client: SandboxClient, expected: int) -> EventCounter:
        counter = cls(expected)
        counter.sub = await client.nc.subscribe(catalog.SANDBOX_EVENTS.wildcard(RUN), cb=counter.on_event)
        return counter

    async def on_event(self, msg: Any) -> None:
        self.seen += 1
        if self.seen >= self.expected:
            self.done.set()

    async def wait(self, timeout: float) -> None:
        await asyncio.wait_for(self.done.wait(), timeout)
        await self.sub.unsubscribe()


async def bench_burst(targets: list[Target], n: int) -> dict[str, float]:
    out = {}
    for t in targets:
        watch = await EventCounter.start(t.client, 2 * n) if isinstance(t, Bus) else None
        start = t0 = time.perf_counter()
        ids = await asyncio.gather(*(create(t) for _ in range(n)))
        created = time.perf_counter() - t0
        t0 = time.perf_counter()
        await asyncio.gather(*(t.call(api.DestroyRequest(run_id=RUN, sandbox_id=s)) for s in ids))
        out[f"{t.prefix}burst_1000_create_s"] = created * 1000 / n
        out[f"{t.prefix}burst_1000_destroy_s"] = (time.perf_counter() - t0) * 1000 / n
        if watch is not None:  # when the last of the burst's 2n events (created, destroyed) is stored
            await watch.wait(120)
            out[f"{t.prefix}burst_events_stored_s"] = time.perf_counter() - start
    return out


async def bench_big_burst(t: Target, backend: BwrapBackend, n: int) -> dict[str, float]:
    """``n`` creates at once, then ``n`` destroys at once: total seconds, and the mounts the sandboxes held."""
    t0 = time.perf_counter()
    ids = await asyncio.gather(*(create(t) for _ in range(n)))
    created = time.perf_counter() - t0
    mounts = len(mounts_under(backend.state_dir))
    t0 = time.perf_counter()
    await asyncio.gather(*(t.call(api.DestroyRequest(run_id=RUN, sandbox_id=s)) for s in ids))
    return {"burst_n": n, "burst_n_create_s": created, "burst_n_destroy_s": time.perf_counter() - t0,
            "burst_n_mounts": mounts}


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


#: how an exec starts (``exec_path``), compared side by side by :func:`bench_exec_paths`; ``pool``: the default
#: ``hybrid`` path with a warm pool (``warm_pool``), whose creates take a sandbox built ahead, its server running
EXEC_PATHS = ("bwrap", "hybrid", "server", "pool")


def side_config(root: str, side: str, pool: int, cgroup_parent: str = "rlbus") -> SandboxConfig:
    """The backend config of one side of :func:`bench_exec_paths` (no warm pool but on the ``pool`` side)."""
    if side == "pool":
        return SandboxConfig(root_dir=root, exec_path="hybrid", warm_pool=pool, default_lease_ttl_s=3600,
                             cgroup_parent=cgroup_parent)
    return SandboxConfig(root_dir=root, exec_path=side, warm_pool=0, default_lease_ttl_s=3600,
                         cgroup_parent=cgroup_parent)


async def quiet(b: BwrapBackend, pool: int) -> None:
    """Until ``b``'s background work is over: the release of destroyed sandboxes, and its pool's refill (``pool``
    sandboxes ready). The next cycle then starts with a full pool, and its take starts the refill beside it."""
    while b._tasks:
        await asyncio.gather(*list(b._tasks), return_exceptions=True)
    while len(b.pool) < pool:
        await asyncio.sleep(0.002)


async def bench_exec_paths(root: str, n: int, pool: int = 2, profile: cProfile.Profile | None = None,
                           cgroup_parent: str = "rlbus") -> dict[str, float]:
    """Each ``exec_path`` its own backend (and the warm pool's, of ``pool`` sandboxes), iterations interleaved:
    create → exec ``true`` → destroy (split into its parts), and ``true`` exec'd in a long-lived sandbox whose exec
    server is ready (``warm_exec``). The pool side also reports its hits and misses (a miss is built as ``hybrid``
    builds it, and its cycle counts as measured), how long building a pooled sandbox took (``pool_build_ms``: its
    volume, cgroup and mounts, and its server's start until ready, at idle CPU priority) and what one costs while
    it waits: its server's CPU to start (``pool_server_start_cpu_ms``: its bwrap monitor's and its pid 1's) and its
    cgroup's memory
    (``pool_sandbox_memory_mb``). Each side's warm exec waits for its backend's background work to end first (see
    :func:`quiet`); ``profile``, when given, records the pool side's create → exec → destroy cycles (this process
    only: the host's side of the work)."""
    backends = {p: BwrapBackend(side_config(root, p, pool, cgroup_parent), lambda e: None) for p in EXEC_PATHS}
    cycles: dict[str, list[tuple[float, float, float, float]]] = {p: [] for p in EXEC_PATHS}
    warm: dict[str, list[float]] = {p: [] for p in EXEC_PATHS}
    warm_cpu = {p: 0.0 for p in EXEC_PATHS}  # CPU seconds of the warm execs: this process, its children, the server
    pool_side = backends["pool"]
    start_cpu: list[float] = []
    pool_mb: list[float] = []
    async with contextlib.AsyncExitStack() as stack:
        live: dict[str, str] = {}
        for p, b in backends.items():
            await b.start()
            stack.push_async_callback(b.close)
            live[p] = await create(Direct(b))
            for _ in range(2):
                await b.exec(api.ExecRequest(run_id=RUN, sandbox_id=live[p], command=api.Argv(args=["true"])))
            sb = b.sandboxes[live[p]]
            while p != "bwrap" and sb.server is None:  # hybrid: started in the background by the second exec
                await asyncio.sleep(0.05)
        servers = {p: b.sandboxes[live[p]].server for p, b in backends.items()}
        for i in range(n + 5):
            if i == 5:  # after the warm-up: the servers' CPU so far (their reaped children's included)
                server_cpu0 = {p: proc_cpu_s(s.pid1) if s else 0.0 for p, s in servers.items()}
                hits0, misses0, built0 = pool_side.pool.hits, pool_side.pool.misses, len(pool_side.pool.build_s)
            if i >= 5:  # what the next pooled sandbox cost while it waited (server start CPU, memory)
                for q in pool_side.pool.idle.values():
                    for sb in list(q)[:1]:
                        if sb.server is not None:
                            start_cpu.append(sched_cpu_ms(sb.server.proc.pid) + sched_cpu_ms(sb.server.pid1))
                        pool_mb.append(sb.cgroup.memory_bytes() / MB)
            for p, b in backends.items():
                if p == "pool" and profile is not None:
                    profile.enable()
                one = await create_exec_destroy(Direct(b))
                if p == "pool" and profile is not None:
                    profile.disable()
                await quiet(b, pool if p == "pool" else 0)  # the warm exec alone: no release, no refill beside it
                t0, c0 = time.perf_counter(), own_cpu_s()
                r = await b.exec(api.ExecRequest(run_id=RUN, sandbox_id=live[p], command=api.Argv(args=["true"])))
                took, cpu = (time.perf_counter() - t0) * 1e3, own_cpu_s() - c0
                if r.exit_code != 0:
                    raise RuntimeError(f"{p}: `true` exited {r.exit_code}: {r.stderr!r}")
                if i >= 5:  # warm-up
                    cycles[p].append(one)
                    warm[p].append(took)
                    warm_cpu[p] += cpu
        for p, server in servers.items():
            if server is not None:
                if backends[p].sandboxes[live[p]].server is not server:
                    raise RuntimeError(f"{p}: the warm sandbox's exec server changed during the bench")
                warm_cpu[p] += proc_cpu_s(server.pid1) - server_cpu0[p]
        builds = list(pool_side.pool.build_s)[built0:]
        out: dict[str, float] = {
            "exec_paths_n": n, "pool_size": pool, "pool_hits": pool_side.pool.hits - hits0,
            "pool_misses": pool_side.pool.misses - misses0,
            "pool_build_ms_p50": statistics.median(builds) * 1e3 if builds else float("nan"),
            "pool_build_ms_p99": pct(builds, 0.99) * 1e3 if builds else float("nan"),
            "pool_server_start_cpu_ms": statistics.median(start_cpu) if start_cpu else float("nan"),
            "pool_sandbox_memory_mb": statistics.median(pool_mb) if pool_mb else float("nan"),
        }
    for p in EXEC_PATHS:
        total, c_ms, e_ms, d_ms = (list(col) for col in zip(*cycles[p], strict=True))
        for stem, values in (("create_exec_destroy_ms", total), ("create_ms", c_ms), ("exec_true_ms", e_ms),
                             ("destroy_ms", d_ms), ("warm_exec_ms", warm[p])):
            out[f"path_{p}_{stem}_p50"] = statistics.median(values)
            out[f"path_{p}_{stem}_p99"] = pct(values, 0.99)
        out[f"path_{p}_warm_exec_cpu_ms"] = warm_cpu[p] * 1e3 / n
    for p in ("hybrid", "server", "pool"):
        for stem in ("create_exec_destroy_ms_p50", "warm_exec_ms_p50", "warm_exec_ms_p99", "warm_exec_cpu_ms"):
            out[f"ratio_{p}_over_bwrap_{stem.replace('_ms', '')}"] = out[f"path_{p}_{stem}"] / out[f"path_bwrap_{stem}"]
    for stem in ("create_exec_destroy_ms_p50", "create_exec_destroy_ms_p99", "exec_true_ms_p50", "destroy_ms_p50"):
        out[f"ratio_pool_over_hybrid_{stem.replace('_ms', '')}"] = out[f"path_pool_{stem}"] / out[f"path_hybrid_{stem}"]
    return out


def own_cpu_s() -> float:
    """CPU seconds of this process and its reaped children (a per-exec bwrap and everything under it)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def proc_cpu_s(pid: int) -> float:
    """CPU seconds of ``pid`` and its reaped children (an exec server: its shepherds and their commands)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return sum(int(v) for v in fields[11:15]) / os.sysconf("SC_CLK_TCK")  # utime stime cutime cstime


def sched_cpu_ms(pid: int) -> float:
    """CPU ms ``pid`` has run so far (``/proc/<pid>/schedstat``: nanoseconds, finer than the clock ticks of stat)."""
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            return int(f.read().split()[0]) / 1e6
    except (OSError, ValueError, IndexError):
        return float("nan")


def exec_paths_table(figures: dict[str, Any]) -> str:
    """p50/p99 per ``exec_path``: the create+exec+destroy cycle, its parts, and an exec in a warm sandbox."""
    rows = [("create+exec+destroy", "create_exec_destroy_ms", (10.0, 50.0)), ("  create", "create_ms", None),
            ("  exec true", "exec_true_ms", None), ("  destroy", "destroy_ms", None),
            ("warm exec true", "warm_exec_ms", (10.0, 50.0))]
    lines = [f"{'exec_path latency (ms)':<30}{'p50':>8}{'p99':>8}   goal"]
    for p in EXEC_PATHS:
        for label, stem, goal in rows:
            p50, p99 = figures[f"path_{p}_{stem}_p50"], figures[f"path_{p}_{stem}_p99"]
            note = "" if goal is None else (f"p50 <= {goal[0]:g} ({'met' if p50 <= goal[0] else 'NOT met'}), "
                                            f"p99 <= {goal[1]:g} ({'met' if p99 <= goal[1] else 'NOT met'})")
            lines.append(f"{p + ' ' + label:<30}{p50:>8.1f}{p99:>8.1f}   {note}".rstrip())
        lines.append(f"{p + ' warm exec CPU (ms, all)':<30}{figures[f'path_{p}_warm_exec_cpu_ms']:>8.2f}")
    lines.append(f"pool of {figures['pool_size']}: {figures['pool_hits']} hits, {figures['pool_misses']} misses; "
                 f"building one {figures['pool_build_ms_p50']:.1f} ms p50 ({figures['pool_build_ms_p99']:.1f} p99), "
                 f"its server's start {figures['pool_server_start_cpu_ms']:.1f} ms of CPU, "
                 f"{figures['pool_sandbox_memory_mb']:.1f} MiB while it waits; pool / hybrid create+exec+destroy "
                 f"p50 {figures['ratio_pool_over_hybrid_create_exec_destroy_p50']:.2f}x")
    return "\n".join(lines)


#: figure → its bus/direct ratio key
RATIOS = {
    "create_exec_destroy_ms_p50": "ratio_create_exec_destroy_p50",
    "create_exec_destroy_ms_p99": "ratio_create_exec_destroy_p99",
    "fork_ms_p50": "ratio_fork_p50",
    "burst_1000_create_s": "ratio_burst_1000_create",
}


class OverloadStats:
    """What N create → exec → destroy clients saw."""

    def __init__(self) -> None:
        self.served = 0
        self.refused = 0
        self.timeouts = 0
        self.errors: dict[str, int] = {}
        self.refusal_ms: list[float] = []
        self.cycle_ms: list[float] = []
        self.live_max = 0

    def error(self, e: BaseException) -> None:
        key = getattr(e, "code", type(e).__name__)
        self.errors[key] = self.errors.get(key, 0) + 1


async def overload_client(bus: Bus, stats: OverloadStats, go: asyncio.Event) -> None:
    """Repeat create → exec ``true`` → destroy until cancelled; back off on ``overloaded`` as a client should."""
    import random

    from services.lib.sandbox_client import SandboxClientError, SandboxTimeout

    await go.wait()
    c = bus.client
    while True:
        t0 = time.perf_counter()
        try:
            sid = (await c.create()).sandbox_id
        except SandboxTimeout:
            stats.timeouts += 1
            continue
        except SandboxClientError as e:
            if e.code != "overloaded":
                stats.error(e)
                await asyncio.sleep(1.0)
                continue
            stats.refused += 1
            stats.refusal_ms.append((time.perf_counter() - t0) * 1e3)
            await asyncio.sleep((e.error.retry_after_s or 0.5) * (0.5 + random.random()))
            continue
        try:
            await c.exec(sid, ["true"])
            await c.destroy(sid)
        except SandboxTimeout:
            stats.timeouts += 1
            continue
        except SandboxClientError as e:
            stats.error(e)
            continue
        stats.served += 1
        stats.cycle_ms.append((time.perf_counter() - t0) * 1e3)


async def bench_overload(args: argparse.Namespace) -> dict[str, Any]:
    """``--overload N``: see the module docstring."""
    repo = Path(args.service_repo).resolve() if args.service_repo else REPO
    procs: list[subprocess.Popen[bytes]] = []
    stats = OverloadStats()
    go = asyncio.Event()
    kw = {"timeout_s": args.overload_timeout_s, "default_exec_timeout_s": args.overload_timeout_s,
          "exec_margin_s": 0.0, "retry_overloaded": False}
    out: dict[str, Any] = {"overload_clients": args.overload, "overload_s": args.overload_s,
                           "overload_service_repo": str(repo)}
    async with bus_target(args.bus, args.root, service_toml="", repo=repo, client_kw=kw, procs=procs) as bus:
        clients = [asyncio.create_task(overload_client(bus, stats, go)) for _ in range(args.overload)]
        t0 = time.perf_counter()
        go.set()
        while time.perf_counter() - t0 < args.overload_s:
            await asyncio.sleep(1.0)
            try:
                live = sum(len(r.sandboxes) for r in await asyncio.wait_for(bus.client.list(), 5.0))
                stats.live_max = max(stats.live_max, live)
            except Exception:  # an instance too busy to list: the figure misses one sample
                pass
        took = time.perf_counter() - t0
        served, refused, timeouts, errors = stats.served, stats.refused, stats.timeouts, dict(stats.errors)
        t_stop = time.perf_counter()
        procs[0].terminate()  # the clients keep sending: the stop finds work queued
        await asyncio.to_thread(procs[0].wait, 300)
        out["overload_stop_s"] = time.perf_counter() - t_stop
        out["overload_stop_rc"] = procs[0].returncode
        for task in clients:
            task.cancel()
        await asyncio.gather(*clients, return_exceptions=True)
    out.update({
        "overload_served_per_s": served / took, "overload_refused_per_s": refused / took,
        "overload_served": served, "overload_refused": refused, "overload_timeouts": timeouts,
        "overload_errors": errors, "overload_errors_during_stop": {
            k: n - errors.get(k, 0) for k, n in stats.errors.items() if n > errors.get(k, 0)},
        "overload_live_max": stats.live_max,
        "overload_refusal_ms_p50": statistics.median(stats.refusal_ms) if stats.refusal_ms else None,
        "overload_refusal_ms_p99": pct(stats.refusal_ms, 0.99) if stats.refusal_ms else None,
        "overload_cycle_ms_p50": statistics.median(stats.cycle_ms) if stats.cycle_ms else None,
        "overload_cycle_ms_p99": pct(stats.cycle_ms, 0.99) if stats.cycle_ms else None,
    })
    out["overload_left_sandboxes"] = sum(
        len(os.listdir(os.path.join(args.root, d, "s"))) for d in os.listdir(args.root)
        if os.path.isdir(os.path.join(args.root, d, "s")))
    t0 = time.perf_counter()
    reaper = BwrapBackend(SandboxConfig(root_dir=args.root), lambda e: None)
    out["overload_reaped_after"] = len(await reaper.start())
    out["overload_reap_s"] = time.perf_counter() - t0
    await reaper.close()
    out["loadavg_1m"] = os.getloadavg()[0]
    return {k: round(v, 2) if isinstance(v, float) else v for k, v in out.items()}


async def main(args: argparse.Namespace) -> dict[str, Any]:
    if args.overload:
        return await bench_overload(args)
    if args.exec_paths_only:
        profile = cProfile.Profile() if args.profile_pool else None
        figures = {"mode": "exec_paths", "quick": args.quick,
                   **await bench_exec_paths(args.root, 50 if args.quick else 300, args.pool, profile,
                                            args.cgroup_parent)}
        if profile is not None:  # where the host's time of the pooled cycles went
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(15)
            print(text.getvalue(), file=sys.stderr)
        figures["loadavg_1m"] = os.getloadavg()[0]
        return {k: round(v, 2) if isinstance(v, float) else v for k, v in figures.items()}
    cfg = SandboxConfig(root_dir=args.root, max_sandboxes=max(5000, args.burst), default_lease_ttl_s=3600,
                        warm_pool=0)  # these figures are without a pool, as before it; the pool has its side above
    backend = BwrapBackend(cfg, lambda e: None)
    await backend.start()
    direct = Direct(backend)
    figures: dict[str, Any] = {"mode": "direct" if args.direct_only else "direct+bus", "quick": args.quick}
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(backend.close)
        targets: list[Target] = [direct]
        if not args.direct_only:
            targets.append(await stack.enter_async_context(bus_target(args.bus, args.root)))
        q = args.quick
        steps = [
            ("create/exec/destroy", bench_create_exec_destroy(targets, 100 if q else 500)),
            ("exec paths (direct)", bench_exec_paths(args.root, 50 if q else 300, args.pool)),
            ("fork with 100 MB", bench_fork(targets, backend, 5 if q else 15)),
            ("burst of 1000 creates", bench_burst(targets, 1000)),
            ("paused sandboxes (direct)", bench_paused(direct, backend, 200 if q else 1000)),
        ]
        if args.burst:
            steps.append((f"burst of {args.burst} creates (direct)", bench_big_burst(direct, backend, args.burst)))
        for name, coro in steps:
            t0 = time.perf_counter()
            out = await coro
            figures.update(out)
            print(f"{name}: {json.dumps({k: round(v, 2) for k, v in out.items()})} ({time.perf_counter() - t0:.1f} s)",
                  file=sys.stderr)
    for key, ratio in RATIOS.items():
        if f"bus_{key}" in figures:
            figures[ratio] = figures[f"bus_{key}"] / figures[key]
    figures["loadavg_1m"] = os.getloadavg()[0]
    return {k: round(v, 2) if isinstance(v, float) else v for k, v in figures.items()}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions, 200 paused sandboxes (< 1 minute)")
    parser.add_argument("--root", default="/var/tmp/rlbus-bench-sandbox", help="state directory (root_dir)")
    parser.add_argument("--bus", metavar="URL", nargs="?", const=None,
                        help="NATS server for the bus figures (default, or --bus alone: an embedded one)")
    parser.add_argument("--direct-only", action="store_true", help="skip the figures through the bus")
    parser.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop")
    parser.add_argument("--burst", type=int, default=0, metavar="N",
                        help="also N creates at once (direct), e.g. 10000; 0: skip")
    parser.add_argument("--overload", type=int, default=0, metavar="N",
                        help="only the overload figures: N clients repeating create/exec/destroy (e.g. 2000)")
    parser.add_argument("--overload-s", type=float, default=30.0, help="how long the overload lasts before the stop")
    parser.add_argument("--overload-timeout-s", type=float, default=30.0, help="each overload request's timeout")
    parser.add_argument("--service-repo", metavar="DIR", help="run the service from this checkout")
    parser.add_argument("--exec-paths-only", action="store_true",
                        help="only the exec_path comparison (bwrap, hybrid, server, and the warm pool), direct")
    parser.add_argument("--pool", type=int, default=2, metavar="N", help="warm_pool of the pool side (default 2)")
    parser.add_argument("--cgroup-parent", default="rlbus", metavar="NAME",
                        help="with --exec-paths-only: the sandboxes' cgroup_parent. Under `nice -n 19` the sandboxes "
                        "outweigh the niced bench for the CPU (each wake-up of one preempts it): give them the bench's "
                        "weight with `mkdir /sys/fs/cgroup/cpu/NAME; echo 15 > /sys/fs/cgroup/cpu/NAME/cpu.shares`")
    parser.add_argument("--profile-pool", action="store_true",
                        help="with --exec-paths-only: cProfile of the pool side's cycles (host side) to stderr")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.loop == "uvloop":
        import uvloop

        uvloop.install()
    result = asyncio.run(main(args))
    if "path_bwrap_create_exec_destroy_ms_p50" in result:
        print(exec_paths_table(result))
    if not args.overload and not args.exec_paths_only:
        print(latency_table(result))
    print(json.dumps(result))
