"""Soak: the default example for a long while, a random role killed every few minutes; does anything grow?

Runs ``examples/addition.toml`` (every service its own process, embedded NATS) under the local supervisor
for ``--minutes``, SIGKILLs a random role (trainer, rollout, judge, weightsync, or NATS itself) every
``--kill-every-s``, and samples every ``--sample-s``:

* each service process's RSS (with its children, e.g. the judge's user-code workers). Growth is measured per
  process lifetime, from its first sample after ``--warmup-s`` to its last: ``rss_growth_pct_max`` per role
  is the largest over that role's lifetimes long enough to measure (``--min-life-s``);
* every stream's messages and bytes (``streams_start`` after the first warm-up, ``streams_end``);
* retention: weight versions the trainer published vs those still stored (``weights_collected``: what
  weightsync garbage-collected), and checkpoints kept.

At the end the run's streams are read back and the accounting identity is checked
(``published = trained + dropped + eval + pending``; ``lost`` must be 0). Goals (issue 17): RSS growth
≤ 10 % after warm-up, lost 0.

Usage: ``python bench/soak.py [--minutes 30] [--kill-every-s 180] [--out DIR]``; the last stdout line is a
JSON object of the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from services.launcher.accounting import accounting  # noqa: E402
from services.launcher.supervisor import Supervisor  # noqa: E402
from services.runtime import bus  # noqa: E402
from services.runtime.natsd import EmbeddedNats, free_port  # noqa: E402

ROLES = ["trainer", "rollout", "judge", "weightsync", "nats"]
STREAMS = ["PROMPTS", "ROLLOUTS", "TRAJECTORIES", "OUTCOMES", "METRICS", "DLQ", "SANDBOX_EVENTS"]


def tree_rss_kb(pid: int) -> int:
    """RSS of ``pid`` and its descendants (kB), from /proc; 0 if it is gone."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                total += next((int(line.split()[1]) for line in f if line.startswith("VmRSS:")), 0)
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (OSError, ValueError):
            continue
    return total


async def stream_sizes(js: Any) -> dict[str, dict[str, int]]:
    out = {}
    for name in STREAMS:
        try:
            info = await js.stream_info(name)
        except Exception:  # not created yet, or the server is being restarted
            continue
        out[name] = {"messages": info.state.messages, "bytes": info.state.bytes}
    return out


def growth(samples: dict[tuple[str, int], list[tuple[float, int]]], warmup_s: float,
           min_life_s: float) -> dict[str, Any]:
    """Per role: the largest RSS growth (%) over its process lifetimes, first sample after warm-up → last."""
    per_role: dict[str, list[dict[str, float]]] = {}
    for (role, pid), series in samples.items():
        if not series:
            continue
        start = series[0][0]
        after = [(t, kb) for t, kb in series if t - start >= warmup_s and kb > 0]
        if len(after) < 2 or after[-1][0] - after[0][0] < min_life_s:
            continue
        first, last = after[0][1], after[-1][1]
        per_role.setdefault(role, []).append({
            "pid": pid, "measured_s": round(after[-1][0] - after[0][0]), "rss_mb_first": round(first / 1024, 1),
            "rss_mb_last": round(last / 1024, 1), "growth_pct": round(100.0 * (last - first) / first, 1)})
    return {role: {"rss_growth_pct_max": max(x["growth_pct"] for x in v), "lifetimes": v}
            for role, v in per_role.items()}


def soak(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    run_dir = out / "run"
    sup = Supervisor(str(REPO / args.config), overrides=[
        "run.id=soak", f"run.dir={run_dir}", f"launcher.nats_port={free_port()}", "launcher.max_restarts=1000",
        "services.trainer.total_steps=100000000", "services.trainer.max_wall_s=0",
    ], quiet=True)
    sup.start()
    sup.start_heartbeat_monitor()
    threading.Thread(target=sup.wait, name="supervisor", daemon=True).start()
    try:
        sampled = asyncio.run(sample(sup, args))
    finally:
        sup.stop()
    acc, kept = asyncio.run(read_back(run_dir))
    versions_published = max((int(line_version(line)) for line in _metrics_lines(run_dir)), default=0)
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").glob("*") if p.is_dir())
    rss = growth(sampled["samples"], args.warmup_s, args.min_life_s)
    return {
        "minutes": args.minutes, "kill_every_s": args.kill_every_s, "warmup_s": args.warmup_s,
        "kills": sampled["kills"],
        "rss": rss,
        "rss_growth_pct_max": max((v["rss_growth_pct_max"] for v in rss.values()), default=None),
        "streams_start": sampled["streams_start"], "streams_end": sampled["streams_end"],
        "weights_versions_published": versions_published, "weights_versions_stored": len(kept),
        "weights_collected": max(versions_published + 1 - len(kept), 0),
        "checkpoints_kept": len(checkpoints),
        "accounting": {k: acc[k] for k in ("published", "trained", "dropped", "eval", "pending", "lost")},
        "dropped_reasons": acc["dropped_reasons"],
        "lost": acc["lost"],
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }


async def sample(sup: Supervisor, args: argparse.Namespace) -> dict[str, Any]:
    """Sample RSS and stream sizes every ``sample_s`` and kill a random role every ``kill_every_s``."""
    rng = random.Random(args.seed)
    samples: dict[tuple[str, int], list[tuple[float, int]]] = {}
    kills: list[dict[str, Any]] = []
    streams_start: dict[str, Any] = {}
    streams_end: dict[str, Any] = {}
    nc = await bus.connect(sup.nats_section(), "rlbus-soak")
    js = nc.jetstream()
    t_start = time.monotonic()
    end = t_start + args.minutes * 60
    next_kill = t_start + args.warmup_s + args.kill_every_s
    try:
        while (now := time.monotonic()) < end:
            for c in sup.children:
                if c.proc is not None and c.proc.poll() is None:
                    samples.setdefault((c.service, c.proc.pid), []).append((now - t_start, tree_rss_kb(c.proc.pid)))
            sizes = await stream_sizes(js)
            if sizes:
                streams_end = sizes
                if not streams_start and now - t_start >= args.warmup_s:
                    streams_start = sizes
            if now >= next_kill:
                victim = rng.choice(ROLES)
                if victim == "nats":
                    sup.nats.kill()
                    await asyncio.sleep(rng.uniform(0.5, 3.0))  # the server stays down a while
                    sup.nats.start()
                else:
                    sup.kill_child(f"{victim}-0")
                kills.append({"role": victim, "t_s": round(now - t_start)})
                next_kill = now + args.kill_every_s
            await asyncio.sleep(args.sample_s)  # the sampling period
    finally:
        await nc.close()
    return {"samples": samples, "kills": kills, "streams_start": streams_start, "streams_end": streams_end}


async def read_back(run_dir: Path) -> tuple[dict[str, Any], list[int]]:
    """The accounting and the stored weight versions, from the run's own (file-stored) streams."""
    import nats

    from services.lib.weights.objstore import ObjectStoreBlobs

    with EmbeddedNats(run_dir / "nats", port=None) as server:
        nc = await nats.connect(server.url)
        acc = await accounting(nc.jetstream(), "soak")
        stored = await ObjectStoreBlobs(nc).list("soak/")
        await nc.close()
    return acc, sorted({int(name.split("/")[1][1:]) for name in stored})


def _metrics_lines(run_dir: Path) -> list[str]:
    path = run_dir / "metrics.jsonl"
    return path.read_text().splitlines() if path.is_file() else []


def line_version(line: str) -> float:
    try:
        return float(json.loads(line).get("trainer/version", 0.0))
    except (json.JSONDecodeError, AttributeError):
        return 0.0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--kill-every-s", type=float, default=180.0)
    ap.add_argument("--warmup-s", type=float, default=120.0, help="RSS growth is measured after this much of a "
                    "process's life (model loads, caches fill)")
    ap.add_argument("--min-life-s", type=float, default=120.0, help="shortest measured span counted")
    ap.add_argument("--sample-s", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=20261203)
    ap.add_argument("--config", default="examples/addition.toml")
    ap.add_argument("--out", default="/tmp/rlbus-soak")
    result = soak(ap.parse_args())
    print(json.dumps(result))
