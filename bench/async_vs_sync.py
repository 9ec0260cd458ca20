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

Figures per seed, each asynchronous side against sync: the wall time (trainer clock,
see bench/_rlbus_runs.py) and the trainer steps each takes to first reach the target
eval reward (default: the lower of the pair's final rewards, after ``--smooth``;
``--target`` sets one for every pair), the time ratio sync / async
(goal >= 1.5x on 2 cores) and the steps ratio async / sync (sample efficiency; goal
<= 1.1x), and the mean eval reward over the run. ``--seeds 0,1,2`` repeats the whole
comparison per seed and adds the means over seeds.

``--set KEY=VALUE`` sets a config key on every side (a bare KEY is a trainer key:
``--set ppo_epochs=2`` is ``services.trainer.ppo_epochs=2``); ``--variant
NAME:KEY=VALUE,KEY=VALUE`` adds an asynchronous side NAME with those keys on top, e.g.
``--variant decoupled:ppo_epochs=2,minibatches=2,is_mode=decoupled``. ``--reuse`` reads
a side whose run directory (``WORK/seed<N>/<side>``) already holds a finished run
instead of running it again (the settings are then the caller's to keep the same).

    .venv/bin/python bench/async_vs_sync.py            # full: a few minutes per run
    .venv/bin/python bench/async_vs_sync.py --quick    # both sides, a few steps each

The last stdout line is one JSON object of the figures (``per_seed`` and ``mean``).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import tomllib
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
    read_run,
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
    p.add_argument("--seeds", type=str, default="", help="comma-separated seeds, each a whole comparison "
                   "(overrides --seed), e.g. 0,1,2")
    p.add_argument("--smooth", type=int, default=1,
                   help="compare trailing means over this many evaluations (default 1: raw evaluations)")
    p.add_argument("--target", type=float, default=None,
                   help="eval reward to reach (0..1); default per seed: the lowest of the runs' final rewards")
    p.add_argument("--async-staleness", type=int, default=1, help="max_staleness of the async run (example: 1)")
    p.add_argument("--sync-threads", type=int, default=1,
                   help="torch threads of the sync run's trainer and of its rollout engine (each; default 1, "
                   "measured best here)")
    p.add_argument("--sync-omp-passive", action="store_true",
                   help="run the sync side with OMP_WAIT_POLICY=PASSIVE (matters with --sync-threads > 1)")
    p.add_argument("--async-threads", type=int, default=1,
                   help="torch threads of the async run's trainer and of its rollout engine (each; default 1)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="a config key on every side (bare KEY: services.trainer.KEY); repeatable")
    p.add_argument("--variant", dest="variants", action="append", default=[], metavar="NAME:KEY=VALUE,...",
                   help="an extra asynchronous side NAME with these keys on top; repeatable")
    p.add_argument("--reuse", action="store_true",
                   help="read a side whose run directory already holds a finished run instead of rerunning it")
    p.add_argument("--profile", action="store_true",
                   help="record every side's trainer with py-spy (pip install py-spy); where its time went goes "
                        "into the JSON line (profiles, per side)")
    p.add_argument("--order", choices=["sync-first", "async-first"], default="sync-first")
    p.add_argument("--work-dir", type=Path, default=None, help="where the run directories go (default: a temp dir)")
    return p.parse_args(argv)


def parse_set(item: str) -> tuple[str, object]:
    """``KEY=VALUE`` as a config key and a value (a TOML literal, else the text itself)."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ValueError(f"expected KEY=VALUE, got {item!r}")
    if "." not in key:
        key = f"services.trainer.{key}"
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text
    return key, value


def parse_variant(item: str) -> tuple[str, dict[str, object]]:
    """``NAME:KEY=VALUE,KEY=VALUE`` as a side name and its config keys."""
    name, sep, keys = item.partition(":")
    if not sep or not name.replace("-", "").replace("_", "").isalnum() or name in ("sync", "async"):
        raise ValueError(f"expected NAME:KEY=VALUE,... with NAME of letters, digits, - and _ (not sync/async); "
                         f"got {item!r}")
    return name, dict(parse_set(k) for k in keys.split(",") if k.strip())


def overrides(args: argparse.Namespace, staleness: int, threads: int, seed: int) -> dict[str, object]:
    """Config keys of one side: everything but staleness and threads is shared."""
    return {
        "run.seed": seed,
        "services.trainer.total_steps": args.steps,
        "services.trainer.max_wall_s": 0.0,  # the sample budget, not a clock, ends both runs
        "services.trainer.eval_every": args.eval_every,
        "services.trainer.eval_prompts": args.eval_prompts,
        "services.trainer.checkpoint_every": 0,  # only the final model: no checkpoint cost on either side
        "services.trainer.max_staleness": staleness,
        "services.trainer.num_threads": threads,
        "services.lib.engine.base.num_threads": threads,
        "common.drain_timeout_s": 2.0,  # after the run has finished: shutdown only
        **dict(parse_set(item) for item in args.sets),
    }


def side_json(r: RunResult) -> dict[str, object]:
    return {"final_reward": r.final_reward, "eval_reward_mean": eval_reward_mean(r), "curve": curve_json(r.curve),
            "launch_s": round(r.launch_s, 1), **r.stats}


def eval_reward_mean(r: RunResult) -> float:
    """The mean eval reward after the initial evaluation (area under the curve: learning per step)."""
    points = [p.reward for p in r.curve if p.step > 0] or [p.reward for p in r.curve]
    return round(sum(points) / len(points), 4)


def mean(values: list[float | None]) -> float | None:
    """The mean, or None when any value is missing (a run that never reached the target)."""
    if not values or any(v is None for v in values):
        return None
    return round(sum(v for v in values if v is not None) / len(values), 3)


def compare_seed(args: argparse.Namespace, seed: int, work: Path,
                 variants: dict[str, dict[str, object]]) -> dict[str, object]:
    """Every side of one seed, run (or read back with ``--reuse``), and its figures."""
    sides: dict[str, tuple[int, int, dict[str, str], dict[str, object]]] = {
        "sync": (0, args.sync_threads, {"OMP_WAIT_POLICY": "PASSIVE"} if args.sync_omp_passive else {}, {}),
        "async": (args.async_staleness, args.async_threads, {}, {}),
        **{name: (args.async_staleness, args.async_threads, {}, keys) for name, keys in variants.items()},
    }
    order = list(sides) if args.order == "sync-first" else [*list(sides)[1:], "sync"]
    results: dict[str, RunResult] = {}
    reused = []
    for name in order:
        staleness, threads, env, keys = sides[name]
        run_dir = work / f"seed{seed}" / name
        if args.reuse and (run_dir / "summary.json").is_file():
            results[name] = read_run(name, run_dir)
            reused.append(name)
            continue
        results[name] = run_rlbus(f"{name}-s{seed}", run_dir, {**overrides(args, staleness, threads, seed), **keys},
                                  env=env, profile="trainer" if args.profile else None)
    curves = {name: smooth_curve(results[name].curve, args.smooth) for name in sides}
    sync = results["sync"]
    vs_sync: dict[str, dict[str, object]] = {}
    for name in sides:
        if name == "sync":
            continue
        # each side against sync at its own target, so a weak variant does not lower the others' bar
        pair = {"sync": curves["sync"], name: curves[name]}
        target = args.target if args.target is not None else default_target(*pair.values())
        f = compare(pair, target)
        trivial = f["target_trivial"]
        vs_sync[name] = {
            "target": f["target"], "target_trivial": trivial,
            "sync_steps": f["sync_steps"], "steps": f[f"{name}_steps"], "sync_s": f["sync_s"], "s": f[f"{name}_s"],
            # sample efficiency: steps this side needed per step sync needed (goal <= 1.1)
            "steps_ratio": None if trivial else ratio(f[f"{name}_steps"], f["sync_steps"]),
            # speed: sync's time per this side's time to the same reward (goal >= 1.5)
            "time_ratio": None if trivial else ratio(f["sync_s"], f[f"{name}_s"]),
            "budget_time_ratio": ratio(sync.stats.get("last_step_s"), results[name].stats.get("last_step_s")),
            **({"equal_time_s": f["equal_time_s"],
                "reward_at_equal_time": {n: f[f"{n}_reward_at_equal_time"] for n in pair}}
               if "equal_time_s" in f else {}),
        }
    return {
        "seed": seed,
        "vs_sync": vs_sync,
        "final_reward": {name: results[name].final_reward for name in sides},
        "eval_reward_mean": {name: eval_reward_mean(results[name]) for name in sides},
        "reused": reused,
        "sides": {name: side_json(results[name]) for name in sides},
        **({"profiles": {name: results[name].profile for name in sides if results[name].profile}}
           if args.profile else {}),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    args.steps = args.steps or (8 if args.quick else 200)
    args.eval_every = args.eval_every or (4 if args.quick else 10)
    args.eval_prompts = args.eval_prompts or (50 if args.quick else 200)
    seeds = [int(x) for x in args.seeds.split(",") if x.strip()] if args.seeds else [args.seed]
    try:
        variants = dict(parse_variant(v) for v in args.variants)
        overrides(args, 0, 1, 0)  # every --set parses before the first run
    except ValueError as e:
        print(f"async_vs_sync: {e}", file=sys.stderr)
        return 2
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="rlbus-async-vs-sync-"))
    per_seed = []
    try:
        for seed in seeds:
            per_seed.append(compare_seed(args, seed, work, variants))
    except BenchRunError as e:
        print(f"async_vs_sync: {e}", file=sys.stderr)
        return 1
    names = list(per_seed[0]["final_reward"])  # type: ignore[arg-type]
    others = [n for n in names if n != "sync"]

    def over_seeds(name: str, figure: str) -> float | None:
        return mean([s["vs_sync"][name][figure] for s in per_seed])  # type: ignore[index]

    means = {
        "steps_ratio": {n: over_seeds(n, "steps_ratio") for n in others},
        # the ratio of the mean steps: a seed weighs by its steps, not by its ratio
        "steps_ratio_of_means": {n: ratio(over_seeds(n, "steps"), over_seeds(n, "sync_steps")) for n in others},
        "steps": {n: over_seeds(n, "steps") for n in others},
        "sync_steps": {n: over_seeds(n, "sync_steps") for n in others},
        "time_ratio": {n: over_seeds(n, "time_ratio") for n in others},
        "budget_time_ratio": {n: over_seeds(n, "budget_time_ratio") for n in others},
        "final_reward": {n: mean([s["final_reward"][n] for s in per_seed]) for n in names},  # type: ignore[index]
        "eval_reward_mean": {n: mean([s["eval_reward_mean"][n] for s in per_seed]) for n in names},  # type: ignore[index]
    }
    cfg_path = work / f"seed{seeds[0]}" / "sync" / "config.resolved.json"
    trainer_cfg = json.loads(cfg_path.read_text()).get("services", {}).get("trainer", {}) if cfg_path.is_file() else {}
    samples_per_step = (trainer_cfg["groups_per_step"] * trainer_cfg["group_size"]
                        if "groups_per_step" in trainer_cfg and "group_size" in trainer_cfg else None)
    out = {
        "bench": "async_vs_sync",
        "quick": args.quick,
        "seeds": seeds,
        # sync / async time to the same reward, mean over seeds (None when a seed's target was trivial or missed)
        "ratio": means["time_ratio"].get("async"),
        "steps_ratio": means["steps_ratio"],
        "mean": means,
        "smooth": args.smooth,
        "steps": args.steps,
        "samples_per_step": samples_per_step,
        "sample_budget": samples_per_step * args.steps if samples_per_step else None,
        "eval_every": args.eval_every,
        "eval_prompts": args.eval_prompts,
        "settings": {"sync": {"max_staleness": 0, "threads_each": args.sync_threads,
                              "omp_passive": args.sync_omp_passive},
                     "async": {"max_staleness": args.async_staleness, "threads_each": args.async_threads},
                     **{n: {"max_staleness": args.async_staleness, **keys} for n, keys in variants.items()},
                     "set": dict(parse_set(item) for item in args.sets), "order": args.order},
        "per_seed": per_seed,
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
