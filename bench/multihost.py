"""Seconds per step of the same short loop on one host and across namespaced "hosts" (issue 14).

    .venv/bin/python bench/multihost.py --steps 40 --rounds 2 --delay-ms 0,1

The loop is the default example (``examples/addition.toml``: the tiny model, its trainer and rollout
settings) with a trainer, one rollout worker and a judge, each started with ``rlbus service`` against its
own nats-server, to ``--steps`` trainer steps (no evaluation, no checkpoints). Two layouts:

* ``single``: every service a process on this host, NATS on 127.0.0.1;
* ``multihost``: the layout of ``tests/cluster/test_multihost.py`` (``bench/_netns.py``): NATS in one
  network namespace, the trainer in a second, rollout and judge in a third, each joined to the NATS
  namespace by its own veth pair; with ``--delay-ms D`` (``D > 0``) netem adds D ms on both ends of each
  link (D each way, 2 D round trip). Each delay listed is its own layout.

Layouts alternate over ``--rounds`` (forward, then backward) so a machine getting busier does not favour
one. The figure is the trainer's mean seconds per step from ``metrics.jsonl`` (start-up excluded), with the
mean staleness beside it; the last line is JSON, with each multi-host layout's median s/step over the
single host's, and the same ratio within each round (runs back to back, less exposed to a changing load). Needs root, iproute2, and ``tc`` for a delay. Every namespace and veth it makes (names
``rlbm<n>...``, 10.25x.0.0/16: not the test's ``rlb<n>``, 10.200-249) is deleted at the end, also on failure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._netns import PORT, ROOT, Hosts, netem_missing  # noqa: E402
from bench._rlbus_runs import EXAMPLE, BenchRunError, read_metrics, run_stats, set_args  # noqa: E402
from services.runtime.natsd import find_nats_server, free_port  # noqa: E402

SERVICES = (("a", "trainer"), ("b", "rollout"), ("b", "judge"))  # (namespaced host, service)


def overrides(steps: int, run_dir: Path, run_id: str) -> dict[str, object]:
    return {"run.dir": str(run_dir), "run.id": run_id, "services.trainer.total_steps": steps,
            "services.trainer.max_wall_s": 0.0, "services.trainer.eval.every": 0,
            "services.trainer.eval.prompts": 16, "services.trainer.checkpoint_every": 0}


def steps_done(metrics: Path) -> int:
    return sum(1 for r in read_metrics(metrics) if "trainer/version" in r) if metrics.is_file() else 0


def one_run(label: str, work: Path, steps: int, hosts: Hosts | None, timeout_s: float) -> dict[str, float]:
    """Start NATS and the services (on ``hosts`` when given, else on this host), wait for ``steps`` steps,
    stop everything; the run's :func:`run_stats`."""
    work.mkdir(parents=True)
    conf = work / "nats.conf"
    conf.write_text("max_payload: 8388608\n")
    run_dir = work / "run"
    keys = set_args(overrides(steps, run_dir, f"bench-multihost-{label}-{os.getpid()}"))
    procs: list[subprocess.Popen] = []
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}

    def start(where: str | None, argv: list[str], log: Path) -> None:
        if hosts is not None and where is not None:
            procs.append(hosts.run(where, argv, log))
        else:
            procs.append(subprocess.Popen(argv, cwd=ROOT, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                                          env=env))

    try:
        if hosts is None:
            port = free_port()
            nats = [find_nats_server(), "-js", "-a", "127.0.0.1", "-p", str(port)]
            urls = {h: f"nats://127.0.0.1:{port}" for h in ("a", "b")}
        else:
            nats = [find_nats_server(), "-js", "-a", "0.0.0.0", "-p", str(PORT)]
            urls = hosts.addr
        start("nats", [*nats, "-sd", str(work / "js"), "-c", str(conf)], work / "nats.log")
        cli = [sys.executable, "-m", "services.launcher.cli", "service"]
        for host, svc in SERVICES:
            start(host, [*cli, svc, "--config", str(EXAMPLE), *keys, "--nats-url", urls[host],
                         "--instance", f"{svc}-0"], work / f"{svc}.log")
        deadline = time.monotonic() + timeout_s
        metrics = run_dir / "metrics.jsonl"
        while steps_done(metrics) < steps:
            dead = [p.args for p in procs if p.poll() is not None]
            if dead and steps_done(metrics) < steps:
                raise BenchRunError(f"{label}: a process exited early ({dead}); see the logs in {work}")
            if time.monotonic() > deadline:
                raise BenchRunError(f"{label}: {steps} steps not reached in {timeout_s:.0f}s; see {work}")
            time.sleep(1.0)
    finally:
        for p in reversed(procs):  # services first, NATS last
            if p.poll() is None:
                p.terminate()
        for p in reversed(procs):
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    stats = run_stats(read_metrics(run_dir / "metrics.jsonl"))
    print(f"{label}: {stats['s_per_step']:.3f} s/step, staleness mean {stats['staleness_mean']:.3f} "
          f"({stats['steps']:.0f} steps, {stats['last_step_s']:.1f} s after the first; load average "
          f"{os.getloadavg()[0]:.1f})", flush=True)
    return stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--delay-ms", default="0", help="netem delays (ms, comma-separated) of the multi-host runs")
    ap.add_argument("--timeout-s", type=float, default=900.0, help="limit of one run")
    ap.add_argument("--keep", action="store_true", help="keep the runs' directories (logs, metrics)")
    args = ap.parse_args()
    if os.geteuid() != 0 or not shutil.which("ip"):
        sys.exit("bench/multihost.py needs root and iproute2 (ip netns)")
    delays = [float(d) for d in args.delay_ms.split(",")]
    if any(d > 0 for d in delays):
        why = "tc not found" if not shutil.which("tc") else netem_missing()
        if why:
            sys.exit(f"--delay-ms above 0 needs tc's netem qdisc, which is not usable here: {why}")
    layouts = ["single", *(f"multihost-{d:g}ms" for d in delays)]
    root = Path(tempfile.mkdtemp(prefix="rlbus-bench-multihost-"))
    per: dict[str, list[float]] = {k: [] for k in layouts}
    stale: dict[str, list[float]] = {k: [] for k in layouts}
    pid = os.getpid()
    loads = [os.getloadavg()[0]]
    ok = False
    try:
        for r in range(args.rounds):
            for i, layout in enumerate(layouts if r % 2 == 0 else layouts[::-1]):
                hosts = None
                if layout != "single":
                    delay = delays[layouts.index(layout) - 1]
                    hosts = Hosts(f"rlbm{(pid + r * 10 + i) % 1000}", 250 + (pid + r) % 5)
                try:
                    if hosts is not None:
                        hosts.up()
                        if delay > 0:
                            hosts.delay(delay)
                    stats = one_run(f"{layout}-{r}", root / f"{layout}-{r}", args.steps, hosts, args.timeout_s)
                finally:
                    if hosts is not None:
                        hosts.down()
                        if hosts.leftovers():
                            print(f"warning: left behind: {hosts.leftovers()}", file=sys.stderr)
                per[layout].append(stats["s_per_step"])
                stale[layout].append(stats["staleness_mean"])
                loads.append(os.getloadavg()[0])
        ok = True
    finally:
        if ok and not args.keep:
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"runs kept in {root}", file=sys.stderr)
    base = statistics.median(per["single"])
    out = {"steps": args.steps, "rounds": args.rounds, "cpus": os.cpu_count(),
           "load_1min": [round(min(loads), 1), round(max(loads), 1)],
           "s_per_step": per,
           "median_s_per_step": {k: round(statistics.median(v), 3) for k, v in per.items()},
           "ratio_vs_single": {k: round(statistics.median(v) / base, 3) for k, v in per.items()},
           # each round's layouts ran back to back: a ratio within a round is less exposed to the load changing
           "ratio_by_round": {k: [round(m / s, 3) for m, s in zip(v, per["single"], strict=True)]
                              for k, v in per.items() if k != "single"},
           "staleness_mean": {k: round(statistics.median(v), 3) for k, v in stale.items()}}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
