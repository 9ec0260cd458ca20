"""What each algorithm option does to the default example: the example as shipped against the same run with one
option turned on, per seed, in one invocation (issue 29's A/B table).

Every side is the addition example with the same seed, sample budget (``--steps`` x groups_per_step x group_size),
thread settings and offline evaluation as ``bench/async_vs_sync.py`` (its asynchronous side, max_staleness 1): the
runs evaluate nothing in the loop and keep a version every ``--eval-every`` steps, each evaluated afterwards off
the run's clock on the same held-out prompts. A variant is compared with the default at a target reward: the
lower of the pair's final (``--smooth``-ed) rewards, or ``--target`` for every pair. Per variant and seed: the
steps and the trainer-clock seconds each side took to the target, ``steps_ratio`` (variant / default: < 1 is
fewer steps) and ``time_ratio`` (default / variant: > 1 is faster), the mean eval reward over the run (area
under the curve) and the final reward, and the option's own figures from the run's metrics (the fraction of
groups dynamic sampling filtered, the fraction of tokens the mismatch masks dropped, seconds per step).

    .venv/bin/python bench/algorithms.py --seeds 0,1,2 --steps 120 --smooth 3 --work-dir /tmp/algo
    .venv/bin/python bench/algorithms.py --variant dynamic:dynamic_sampling=true   # only that one
    .venv/bin/python bench/algorithms.py --quick       # two sides, a few steps each: a smoke run

``--example`` runs another shipped example instead, evaluated in the loop by its own engine (its ``[eval]``
settings; offline evaluation of a real model on CPU would take longer than the runs), each run stopped by
``--max-wall-s`` or ``--steps``, whichever comes first; its threads and engine stay the example's:

    .venv/bin/python bench/algorithms.py --example examples/smollm2_math.toml --steps 200 --max-wall-s 900 \
        --eval-prompts 100 --variant dynamic:dynamic_sampling=true

The default variants (without ``--variant``) are every option of docs/algorithms.md that the example can
take. ``--reuse`` reads a side whose run directory (``WORK/seed<N>/<side>``) already holds a finished run.
The last stdout line is one JSON object: ``per_seed`` and ``mean`` (over seeds, per variant).
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

from bench._offline_eval import offline_overrides  # noqa: E402
from bench._rlbus_runs import (  # noqa: E402
    EXAMPLE,
    BenchRunError,
    RunResult,
    compare,
    default_target,
    example_run_file,
    ratio,
    read_metrics,
    read_run,
    run_rlbus,
    smooth_curve,
)
from bench.async_vs_sync import (  # noqa: E402
    eval_reward_mean,
    evaluate_offline,
    mean,
    overrides,
    parse_set,
    parse_variant,
    side_json,
)
from services.runtime.config import ConfigError  # noqa: E402

log = logging.getLogger("rlbus.bench.algorithms")

#: one side per option of docs/algorithms.md that the addition example can take (its engine is the trainer's
#: own torch code, so the mismatch options measure their cost and their near-nil mask on matching numerics)
DEFAULT_VARIANTS = [
    "dynamic:dynamic_sampling=true",
    "mask_truncated:loss.mask_truncated=true",
    "overlong:loss.overlong_buffer=2",
    "dr_grpo:loss.type=dr_grpo",
    "gspo:loss.type=gspo",
    "cispo:loss.type=cispo",
    "icepop:loss.is_mode=icepop",
]
QUICK_VARIANTS = ["dynamic:dynamic_sampling=true"]

#: per-step metrics whose run mean goes into each side's figures
OPTION_METRICS = ("trainer/filtered_frac", "mismatch/masked_frac", "mismatch/kl", "policy/clip_frac")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a few steps, fewer eval prompts, one variant: a smoke run")
    p.add_argument("--steps", type=int, default=None, help="trainer steps per run (default 120; quick 8)")
    p.add_argument("--eval-every", type=int, default=None, help="evaluate every N steps (default 10; quick 4)")
    p.add_argument("--eval-prompts", type=int, default=None, help="held-out prompts per eval (default 200; quick 50)")
    p.add_argument("--seeds", default="0", help="comma-separated run seeds (default 0)")
    p.add_argument("--smooth", type=int, default=1, help="trailing mean of this many evaluations before comparing")
    p.add_argument("--target", type=float, default=None,
                   help="the reward every pair is compared at (default: the lower of the pair's final rewards)")
    p.add_argument("--variant", dest="variants", action="append", default=None, metavar="NAME:KEY=VALUE,...",
                   help="a side NAME with these keys on top of the example (bare trainer keys as in "
                        "bench/async_vs_sync.py); repeatable; default: every option (see DEFAULT_VARIANTS)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="a config key on every side, the default included; repeatable")
    p.add_argument("--reuse", action="store_true",
                   help="read a side whose run directory already holds a finished run instead of rerunning it")
    p.add_argument("--work-dir", type=Path, default=None, help="where the run directories go (default: a temp dir)")
    p.add_argument("--example", type=Path, default=EXAMPLE,
                   help="the run file of every side (default: the addition example, evaluated offline; another "
                        "example is evaluated in the loop with its own threads and engine)")
    p.add_argument("--max-wall-s", type=float, default=0.0,
                   help="with --example: each run's training wall-clock limit (0: --steps alone ends it)")
    args = p.parse_args(argv)
    args.example = args.example.resolve()
    args.offline = args.example == EXAMPLE.resolve()
    args.steps = args.steps or (8 if args.quick else 120)
    args.eval_every = args.eval_every or (4 if args.quick else 10)
    args.eval_prompts = args.eval_prompts or (50 if args.quick else 200)
    if args.variants is None:
        args.variants = QUICK_VARIANTS if args.quick else DEFAULT_VARIANTS
    # the asynchronous side of bench/async_vs_sync.py: the example's own staleness and one thread each
    args.async_staleness, args.async_threads = 1, 1
    return args


def side_overrides(args: argparse.Namespace, seed: int) -> dict[str, object]:
    """Config keys every side shares: bench/async_vs_sync.py's asynchronous side on the default example; on another
    example only the budget, the seed and the evaluation (its threads, engine and staleness stay its own)."""
    if args.offline:
        return {**overrides(args, args.async_staleness, args.async_threads, seed), **offline_overrides(args.eval_every)}
    return {
        "run.seed": seed,
        "services.trainer.total_steps": args.steps,
        "services.trainer.max_wall_s": args.max_wall_s,
        "services.trainer.eval.every": args.eval_every,
        "services.trainer.eval.prompts": args.eval_prompts,
        "services.trainer.checkpoint_every": 0,
        "common.drain_timeout_s": 2.0,
        **dict(parse_set(item) for item in args.sets),
    }


def check_keys(args: argparse.Namespace, keys: dict[str, object]) -> None:
    """Raise ``ConfigError`` naming the key when the example with the shared keys and ``keys`` would not load."""
    from bench._rlbus_runs import toml_value

    shared = side_overrides(args, 0)
    example_run_file(args.example, [f"{k}={toml_value(v)}" for k, v in {**shared, **keys}.items()])


def option_figures(run_dir: Path) -> dict[str, float]:
    """The run's mean of each :data:`OPTION_METRICS` figure over the steps that reported it."""
    rows = read_metrics(run_dir / "metrics.jsonl")
    out = {}
    for key in OPTION_METRICS:
        vals = [float(r[key]) for r in rows if key in r]
        if vals:
            out[key] = round(sum(vals) / len(vals), 4)
    return out


def compare_seed(args: argparse.Namespace, seed: int, work: Path,
                 variants: dict[str, dict[str, object]]) -> dict[str, object]:
    """The default and every variant of one seed, run (or read back with ``--reuse``), and their figures."""
    sides = {"default": {}, **variants}
    results: dict[str, RunResult] = {}
    extra: dict[str, dict[str, object]] = {}
    for name, keys in sides.items():
        run_dir = work / f"seed{seed}" / name
        if args.reuse and (run_dir / "summary.json").is_file():
            results[name] = read_run(name, run_dir)
        else:
            results[name] = run_rlbus(f"{name}-s{seed}", run_dir, {**side_overrides(args, seed), **keys},
                                      example=args.example, keep_versions=args.offline,
                                      timeout_s=max(1800.0, 3 * args.max_wall_s))
        extra[name] = {}
        if args.offline:
            results[name].curve, extra[name] = evaluate_offline(args, seed, results[name])
        extra[name].update(option_figures(run_dir))
        log.info("seed %d %s: final %.3f, mean %.3f", seed, name, results[name].final_reward,
                 eval_reward_mean(results[name]))
    curves = {name: smooth_curve(results[name].curve, args.smooth) for name in sides}
    vs_default: dict[str, dict[str, object]] = {}
    for name in variants:
        pair = {"default": curves["default"], name: curves[name]}
        target = args.target if args.target is not None else default_target(*pair.values())
        f = compare(pair, target)
        trivial = f["target_trivial"]
        vs_default[name] = {
            "target": f["target"], "target_trivial": trivial,
            "default_steps": f["default_steps"], "steps": f[f"{name}_steps"],
            "default_s": f["default_s"], "s": f[f"{name}_s"],
            "steps_ratio": None if trivial else ratio(f[f"{name}_steps"], f["default_steps"]),
            "time_ratio": None if trivial else ratio(f["default_s"], f[f"{name}_s"]),
            **({"equal_time_s": f["equal_time_s"],
                "reward_at_equal_time": {n: f[f"{n}_reward_at_equal_time"] for n in pair}}
               if "equal_time_s" in f else {}),
        }
    return {
        "seed": seed,
        "vs_default": vs_default,
        "final_reward": {name: results[name].final_reward for name in sides},
        "eval_reward_mean": {name: eval_reward_mean(results[name]) for name in sides},
        "sides": {name: {**side_json(results[name]), **extra[name]} for name in sides},
    }


def summarise(per_seed: list[dict[str, object]], names: list[str]) -> dict[str, object]:
    """Means over seeds per side: ratios against the default (None when a seed missed or had a trivial target)."""
    variants = [n for n in names if n != "default"]

    def over(name: str, figure: str) -> float | None:
        return mean([s["vs_default"][name][figure] for s in per_seed])  # type: ignore[index]

    def side(name: str, figure: str) -> float | None:
        vals = [s["sides"][name].get(figure) for s in per_seed]  # type: ignore[index]
        return mean(vals) if all(v is not None for v in vals) else None

    return {
        "steps_ratio": {n: over(n, "steps_ratio") for n in variants},
        "steps_ratio_of_means": {n: ratio(over(n, "steps"), over(n, "default_steps")) for n in variants},
        "time_ratio": {n: over(n, "time_ratio") for n in variants},
        "final_reward": {n: mean([s["final_reward"][n] for s in per_seed]) for n in names},  # type: ignore[index]
        "eval_reward_mean": {n: mean([s["eval_reward_mean"][n] for s in per_seed]) for n in names},  # type: ignore[index]
        "s_per_step": {n: side(n, "s_per_step") for n in names},
        **{f"mean_{k.replace('/', '_')}": {n: side(n, k) for n in names} for k in OPTION_METRICS},
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    try:
        variants = dict(parse_variant(v) for v in args.variants)
        if "default" in variants:
            raise ValueError("a variant may not be called 'default' (the example as shipped)")
        for keys in [{}, *variants.values()]:  # every side's keys load on the example before the first run
            check_keys(args, keys)
    except (ValueError, ConfigError) as e:
        print(f"algorithms: {e}", file=sys.stderr)
        return 2
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="rlbus-algorithms-"))
    per_seed = []
    try:
        for seed in seeds:
            per_seed.append(compare_seed(args, seed, work, variants))
    except BenchRunError as e:
        print(f"algorithms: {e}", file=sys.stderr)
        return 1
    names = ["default", *variants]
    out = {
        "bench": "algorithms",
        "quick": args.quick,
        "example": str(args.example),
        "eval": "offline" if args.offline else "inloop",
        "seeds": seeds,
        "steps": args.steps,
        "smooth": args.smooth,
        "eval_every": args.eval_every,
        "eval_prompts": args.eval_prompts,
        "variants": {n: {k: v for k, v in keys.items()} for n, keys in variants.items()},
        "set": dict(parse_set(item) for item in args.sets),
        "mean": summarise(per_seed, names),
        "per_seed": per_seed,
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
