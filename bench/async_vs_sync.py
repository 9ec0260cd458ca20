"""Async pays: the addition example synchronous (max_staleness 0) vs asynchronous, one after the other.

Both runs use the same seed, model and sample budget (total_steps x groups_per_step
x group_size trained completions) and evaluate the same held-out prompts at the
same steps. The asynchronous run keeps the example's 1 torch thread each for
trainer and rollout engine, since they run at once. The synchronous run gets its
best measured thread setting: its trainer and rollout alternate, so 2 threads
each looked right, but on the shared 2-core machine 2 threads made a sync step
5-9x slower (OpenMP workers spin-waiting against each other and other tenants)
and 2 threads with OMP_WAIT_POLICY=PASSIVE were no faster than 1 (a 1 M-parameter
model gains nothing from intra-op parallelism). So the default is 1 thread each;
``--sync-threads 2`` (optionally with ``--sync-omp-passive``) measures the other.

Figure: the wall time (trainer clock, see bench/_rlbus_runs.py) each run takes to
first reach the target eval reward (default: the lower of the two final rewards),
and their ratio sync / async (goal >= 1.5x on 2 cores).

    .venv/bin/python bench/async_vs_sync.py            # full: a few minutes per run
    .venv/bin/python bench/async_vs_sync.py --quick    # both sides, a few steps each

The last stdout line is one JSON object of the figures.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._rlbus_runs import (  # noqa: E402
    BenchRunError,
    RunResult,
    compare,
    curve_json,
    default_target,
    ratio,
    run_rlbus,
    smooth_curve,
)

log = logging.getLogger("rlbus.bench.async_vs_sync")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a few steps and fewer eval prompts (under about a minute): a smoke run whose "
                   "throughput (budget_time_ratio) is real, but too short to learn, so no time-to-reward ratio")
    p.add_argument("--steps", type=int, default=None, help="trainer steps per run (default 200; quick 8)")
    p.add_argument("--eval-every", type=int, default=None, help="evaluate every N steps (default 10; quick 4)")
    p.add_argument("--eval-prompts", type=int, default=None, help="held-out prompts per eval (default 200; quick 50)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smooth", type=int, default=1,
                   help="compare trailing means over this many evaluations (default 1: raw evaluations)")
    p.add_argument("--target", type=float, default=None,
                   help="eval reward to reach (0..1); default: the lower of the two final rewards")
    p.add_argument("--async-staleness", type=int, default=1, help="max_staleness of the async run (example: 1)")
    p.add_argument("--sync-threads", type=int, default=1,
                   help="torch threads of the sync run's trainer and of its rollout engine (each; default 1, "
                   "measured best here)")
    p.add_argument("--sync-omp-passive", action="store_true",
                   help="run the sync side with OMP_WAIT_POLICY=PASSIVE (matters with --sync-threads > 1)")
    p.add_argument("--async-threads", type=int, default=1,
                   help="torch threads of the async run's trainer and of its rollout engine (each; default 1)")
    p.add_argument("--order", choices=["sync-first", "async-first"], default="sync-first")
    p.add_argument("--work-dir", type=Path, default=None, help="where the run directories go (default: a temp dir)")
    return p.parse_args(argv)


def overrides(args: argparse.Namespace, staleness: int, threads: int) -> dict[str, object]:
    """Config keys of one side: everything but staleness and threads is shared."""
    return {
        "run.seed": args.seed,
        "services.trainer.total_steps": args.steps,
        "services.trainer.max_wall_s": 0.0,  # the sample budget, not a clock, ends both runs
        "services.trainer.eval_every": args.eval_every,
        "services.trainer.eval_prompts": args.eval_prompts,
        "services.trainer.checkpoint_every": 0,  # only the final model: no checkpoint cost on either side
        "services.trainer.max_staleness": staleness,
        "services.trainer.num_threads": threads,
        "services.lib.engine.base.num_threads": threads,
        "common.drain_timeout_s": 2.0,  # after the run has finished: shutdown only
    }


def side_json(r: RunResult) -> dict[str, object]:
    return {"final_reward": r.final_reward, "curve": curve_json(r.curve), "launch_s": round(r.launch_s, 1),
            **r.stats}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    args.steps = args.steps or (8 if args.quick else 200)
    args.eval_every = args.eval_every or (4 if args.quick else 10)
    args.eval_prompts = args.eval_prompts or (50 if args.quick else 200)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="rlbus-async-vs-sync-"))
    sides = {
        "sync": (0, args.sync_threads, {"OMP_WAIT_POLICY": "PASSIVE"} if args.sync_omp_passive else {}),
        "async": (args.async_staleness, args.async_threads, {}),
    }
    order = ["sync", "async"] if args.order == "sync-first" else ["async", "sync"]
    results: dict[str, RunResult] = {}
    try:
        for name in order:
            staleness, threads, env = sides[name]
            results[name] = run_rlbus(name, work / name, overrides(args, staleness, threads), env=env)
    except BenchRunError as e:
        print(f"async_vs_sync: {e}", file=sys.stderr)
        return 1
    sync, asyn = results["sync"], results["async"]
    curves = {"sync": smooth_curve(sync.curve, args.smooth), "async": smooth_curve(asyn.curve, args.smooth)}
    target = args.target if args.target is not None else default_target(*curves.values())
    figures = compare(curves, target)
    out = {
        "bench": "async_vs_sync",
        "quick": args.quick,
        # a target every run met at its first evaluation (quick runs, mostly) says nothing about speed
        "ratio": None if figures["target_trivial"] else ratio(figures["sync_s"], figures["async_s"]),
        "ratio_note": ("no ratio: the target reward was met at the first evaluation (too few steps to learn; "
                       "budget_time_ratio is this run's throughput figure)") if figures["target_trivial"] else "",
        "sync_s": figures["sync_s"],
        "async_s": figures["async_s"],
        "target": figures["target"],
        "target_trivial": figures["target_trivial"],
        "smooth": args.smooth,
        "sync_final_reward": sync.final_reward,
        "async_final_reward": asyn.final_reward,
        # wall time of the whole sample budget (no reward involved): the throughput ratio
        "budget_time_ratio": ratio(sync.stats.get("last_step_s"), asyn.stats.get("last_step_s")),
        "sync_steps_to_target": figures["sync_steps"],
        "async_steps_to_target": figures["async_steps"],
        "steps": args.steps,
        "samples_per_step": None,
        "sample_budget": None,
        "eval_every": args.eval_every,
        "eval_prompts": args.eval_prompts,
        "seed": args.seed,
        "settings": {"sync": {"max_staleness": 0, "threads_each": args.sync_threads,
                              "omp_passive": args.sync_omp_passive},
                     "async": {"max_staleness": args.async_staleness, "threads_each": args.async_threads},
                     "order": order},
        "sync": side_json(sync),
        "async": side_json(asyn),
    }
    for key in ("equal_time_s", "sync_reward_at_equal_time", "async_reward_at_equal_time"):
        if key in figures:
            out[key] = figures[key]
    cfg = json.loads((sync.run_dir / "config.resolved.json").read_text()) if (
        sync.run_dir / "config.resolved.json").is_file() else {}
    trainer_cfg = cfg.get("services", {}).get("trainer", {})
    if "groups_per_step" in trainer_cfg and "group_size" in trainer_cfg:
        out["samples_per_step"] = trainer_cfg["groups_per_step"] * trainer_cfg["group_size"]
        out["sample_budget"] = out["samples_per_step"] * args.steps
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
