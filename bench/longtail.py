"""Where the bus should win: a long-tailed or agentic workload, synchronous vs asynchronous, everything shared vs
disjoint pools, each beside its physical limit (issue 30).

Workloads (``--workload``): ``longtail`` (examples/longtail.toml: SmolLM2-135M on word problems, step-by-step
answers up to 512 tokens, heavy-tailed lengths) and ``agentic`` (examples/tool_use.toml: the calculator tool,
two turns an episode, its tool in-process) and ``coding`` (examples/coding.toml at 4 groups of 4: each episode
writes code in its own sandbox and runs it there, up to 3 turns, and the judge runs hidden tests in a fork of
that sandbox; its reward needs the sandboxes, so it is not evaluated offline: throughput and split only). ``--quick`` runs the tiny addition example instead (either workload's own example
needs SmolLM2 and tens of seconds a step): a few steps of every side, to show the bench's parts work.

Sides, one after the other, the same seed and sample budget (steps x groups_per_step x group_size):

* ``sync`` (max_staleness 0) and ``async`` (``--async-staleness``, default 1);
* ``shared``: every process on every core, the example's thread counts; ``pooled``: the trainer pinned to
  one core, rollout, judge and weightsync to the other, through the run file's ``[placement]`` (CPU affinity
  set before ``exec``, OMP_NUM_THREADS to match), explicit torch thread counts set to 0 so they follow it.

``--modes`` and ``--layouts`` pick a subset. Every side is traced whole (``OTEL_TRACES_SAMPLER=always_on``,
the same cost on each) and evaluated offline after its run as bench/async_vs_sync.py does
(bench/_offline_eval.py: checkpoints every ``--eval-every`` steps kept, evaluated with HF ``generate`` off
the run's clock, placed at the trainer clock time of their step).

Figures (bench/_time_split.py says how each is read from the traces):

* ``lengths``: each side's completion-length distribution (p50/p90/p99/max, share cut at the limit);
* ``tools``: each side's sandbox calls per episode, their time and their share of an episode's wall time;
* per layout, from its synchronous run: the time split per step (generation g, training t, weight sync w,
  and the rest of the period), the ideal asynchronous speedup ``(g + t + w) / max(g, t)``, the measured one
  (sync's trainer clock over async's for the whole budget) and measured / ideal (goal >= 0.85 pooled); the
  issue's ideal leaves out the rest of sync's period (judging, bus hops), which overlap hides as well, so
  ``ideal_speedup_of_period`` (sync's period / max(g, t)) is printed beside it;
* per layout, async against sync: time and steps to the same held-out reward (default target: the lower of
  the pair's final rewards) with ``time_ratio`` = sync / async (goal >= 1.5 on long-tail) and
  ``steps_ratio`` = async / sync (goal <= 1.1);
* per mode, pooled against shared: shared's trainer clock over pooled's for the whole budget.

    .venv/bin/python bench/longtail.py --quick                       # tiny model, every side, about a minute
    .venv/bin/python bench/longtail.py --workload longtail           # SmolLM2, 40 steps a side (hours here)
    .venv/bin/python bench/longtail.py --workload agentic --steps 30
    .venv/bin/python bench/longtail.py --workload coding --steps 6 --layouts pooled

The runs need a quiet machine; their offline evaluations, off the clock, do not. ``--phase run`` runs the
sides and keeps their versions; ``--phase evaluate`` (the same arguments and ``--work-dir``) evaluates them
later and prints every figure, so several seeds' runs can go one after the other::

    bench/longtail.py --workload longtail --steps 20 --layouts pooled --seed 1 --phase run --work-dir /tmp/s1
    bench/longtail.py --workload longtail --steps 20 --layouts pooled --seed 1 --phase evaluate --work-dir /tmp/s1 \
        --eval-engine vllm

``--eval-engine vllm`` generates the evaluation's completions with vLLM (``bench/_vllm_eval.py``, in the
vLLM environment) instead of transformers' ``generate``: about a minute a version of 50 long completions
here instead of five. Curves are comparable only between runs evaluated by the same engine.

The last stdout line is one JSON object of the figures.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._offline_eval import offline_overrides, run_curve  # noqa: E402
from bench._rlbus_runs import (  # noqa: E402
    EXAMPLE,
    BenchRunError,
    RunResult,
    compare,
    curve_json,
    default_target,
    example_model_dir,
    example_run_file,
    parse_set_item,
    prune_run_files,
    ratio,
    read_metrics,
    read_run,
    read_write_times,
    run_rlbus,
    toml_value,
)
from bench._sides import LAYOUTS, MODES, choice_list, layout_overrides, mode_overrides, pool_cpus  # noqa: E402
from bench._time_split import (  # noqa: E402
    completion_lengths,
    ideal_speedup,
    length_figures,
    read_spans,
    step_split,
    tool_figures,
)
from services.runtime.config import ConfigError  # noqa: E402

log = logging.getLogger("rlbus.bench.longtail")

REPO = Path(__file__).resolve().parents[1]
WORKLOADS = {"longtail": REPO / "examples" / "longtail.toml", "agentic": REPO / "examples" / "tool_use.toml",
             "coding": REPO / "examples" / "coding.toml"}
#: what the bench changes in a workload's example: coding.toml is sized to show its events in a few minutes
#: (2 groups of 4); the bench gives it a batch whose episodes overlap (4 groups of 4, as many tickets)
WORKLOAD_KEYS: dict[str, dict[str, object]] = {
    "coding": {"services.trainer.groups_per_step": 4, "services.trainer.group_size": 4,
               "services.rollout.max_tickets": 16},
}
#: workloads whose reward needs the run's services (hidden tests in a sandbox fork): not evaluated offline
NO_OFFLINE_EVAL = {"coding"}
#: every span of every group and step: the time split and the length distribution need them all
TRACE_ALL = {"OTEL_TRACES_SAMPLER": "always_on"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="longtail")
    p.add_argument("--quick", action="store_true", help="the tiny addition example, a few steps, every side "
                   "(about a minute): the parts work; too short to learn, so no time-to-reward figure")
    p.add_argument("--example", type=Path, default=None, help="run this run file instead of the workload's")
    p.add_argument("--steps", type=int, default=None, help="trainer steps per side (default 40; quick 6)")
    p.add_argument("--eval-every", type=int, default=None,
                   help="evaluate every N steps (default 5; quick 3; coding 0); 0: no evaluation, throughput and "
                   "the time split only (no time-to-reward figures)")
    p.add_argument("--eval-prompts", type=int, default=None,
                   help="held-out prompts per evaluation (default: the example's eval.prompts; quick 20)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--async-staleness", type=int, default=1, help="max_staleness of the async sides")
    p.add_argument("--modes", default="sync,async", help="comma-separated: sync, async")
    p.add_argument("--layouts", default="shared,pooled", help="comma-separated: shared, pooled")
    p.add_argument("--target", type=float, default=None,
                   help="held-out reward to reach (default per pair: the lower final reward)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="a config key on every side, on top of the bench's (full dotted key; the value a TOML "
                   "literal); repeatable")
    p.add_argument("--phase", choices=("all", "run", "evaluate"), default="all",
                   help="all: run every side, then evaluate each offline; run: only run them, keeping their "
                   "versions (throughput and split; no same-reward figures); evaluate: only evaluate the runs "
                   "an earlier --phase run left in --work-dir (same arguments), and print every figure. "
                   "Splitting lets the runs go one after the other on a quiet machine while the evaluations, "
                   "off the clock, wait for a busy one")
    p.add_argument("--eval-engine", choices=("hf", "vllm"), default="hf",
                   help="what generates the offline evaluation's completions: hf (transformers' generate, "
                   "float32, one thread) or vllm (vLLM in the rollout's vLLM environment, every core, the "
                   "run's engine dtype; several times faster on long completions). Compare curves only "
                   "between runs evaluated with the same engine")
    p.add_argument("--keep-run-files", action="store_true",
                   help="keep each run's checkpoints, JetStream store and final model (several GB a SmolLM2 run); "
                   "by default they are removed once the run is read: metrics, traces, logs and the kept "
                   "versions stay, which is all the figures and --phase evaluate need")
    p.add_argument("--timeout-s", type=float, default=7200.0, help="most seconds one side's run may take")
    p.add_argument("--work-dir", type=Path, default=None, help="where the run directories go (default: a temp dir)")
    args = p.parse_args(argv)
    try:
        args.sets = dict(parse_set_item(item) for item in args.sets)
    except ValueError as e:
        p.error(f"--set: {e}")
    args.modes = choice_list(p, "--modes", args.modes, MODES)
    args.layouts = choice_list(p, "--layouts", args.layouts, LAYOUTS)
    args.example = args.example or (EXAMPLE if args.quick else WORKLOADS[args.workload])
    if args.steps is None:
        args.steps = 6 if args.quick else 40
    if args.eval_every is None:
        args.eval_every = 3 if args.quick else 0 if args.workload in NO_OFFLINE_EVAL else 5
    if args.eval_every and args.workload in NO_OFFLINE_EVAL and not args.quick:
        p.error(f"--workload {args.workload}: its reward runs hidden tests in the run's sandboxes, which the "
                "offline evaluation cannot; use --eval-every 0")
    if args.eval_prompts is None and args.quick:
        args.eval_prompts = 20
    if args.steps < 1:
        p.error("--steps must be >= 1")
    if args.eval_every < 0:
        p.error("--eval-every must be >= 0")
    if args.phase == "evaluate" and args.work_dir is None:
        p.error("--phase evaluate reads the runs of an earlier --phase run: name its --work-dir")
    if args.phase != "all" and not args.eval_every:
        p.error(f"--phase {args.phase}: only evaluated runs have phases; with --eval-every 0 run them whole")
    return args


def side_overrides(args: argparse.Namespace, runfile: Any, mode: str, layout: str) -> dict[str, object]:
    """Config keys of one side: the budget, offline evaluation, the mode's staleness and the layout."""
    return {
        **({} if args.quick else WORKLOAD_KEYS.get(args.workload, {})),
        "run.seed": args.seed,
        "services.trainer.total_steps": args.steps,
        "services.trainer.max_wall_s": 0.0,  # the sample budget, not a clock, ends every side
        "common.drain_timeout_s": 2.0,
        **offline_overrides(args.eval_every),
        **mode_overrides(mode, args.async_staleness),
        **layout_overrides(layout, runfile),
        **args.sets,
    }


def check_keys(example: Path, keys: dict[str, object]) -> None:
    """Raise ``ConfigError`` naming the key when ``example`` with ``keys`` would not start."""
    example_run_file(example, [f"{k}={toml_value(v)}" for k, v in keys.items()]).check()


def trainer_restarts(metrics: list[dict[str, Any]]) -> int:
    """Times the trainer's clock went back between step lines: a restarted trainer (resumed from its
    checkpoint by the launcher) starts ``elapsed_s`` again, so its run's times do not add up."""
    times = [float(m["elapsed_s"]) for m in metrics if "trainer/version" in m]
    return sum(b < a for a, b in zip(times, times[1:], strict=False))


def side_figures(r: RunResult, limit: int | None, sync: bool) -> dict[str, Any]:
    """One side's figures: the loop's stats, its completion lengths and, for a synchronous side, its split."""
    spans = read_spans(r.run_dir)
    out: dict[str, Any] = {"final_reward": r.final_reward if r.curve else None, "curve": curve_json(r.curve), **r.stats,
                           "lengths": length_figures(completion_lengths(spans), limit),
                           "tools": tool_figures(spans),
                           "trainer_restarts": trainer_restarts(read_metrics(r.run_dir / "metrics.jsonl"))}
    if out["trainer_restarts"]:
        log.warning("%s: the trainer restarted %d time(s) (its clock started again): this side's times are not "
                    "comparable; see %s", r.label, out["trainer_restarts"], r.run_dir / "logs")
    if sync:
        split = step_split(spans)
        period = None if out["trainer_restarts"] else r.stats.get("s_per_step")  # a restart breaks the clock
        split["period_s"] = period
        split["other_s"] = None if period is None else round(period - split["g_s"] - split["t_s"] - split["w_s"], 3)
        out["split"] = split
    return out


def layout_figures(sync: dict[str, Any], async_: dict[str, Any], sync_r: RunResult, async_r: RunResult,
                   target: float | None) -> dict[str, Any]:
    """One layout's async against sync: the physical limit from sync's split, and the same-reward figures."""
    split = sync["split"]
    ideal = ideal_speedup(split["g_s"], split["t_s"], split["w_s"])
    measured = ratio(sync_r.stats.get("last_step_s"), async_r.stats.get("last_step_s"))
    bound = max(split["g_s"], split["t_s"])
    out = {
        "ideal_speedup": ideal, "measured_speedup": measured,
        "measured_over_ideal": ratio(measured, ideal),
        # the same bound against sync's whole period: the rest (judging, bus hops) is hidden by overlap too
        "ideal_speedup_of_period": ratio(split["period_s"], bound) if bound > 0 else None,
    }
    pair = {"sync": sync_r.curve, "async": async_r.curve}
    if not all(pair.values()):  # not evaluated (--eval-every 0): no same-reward figures
        return out
    f = compare(pair, target if target is not None else default_target(*pair.values()))
    trivial = f["target_trivial"]
    return {
        **out,
        "target": f["target"], "target_trivial": trivial,
        "sync_s": f["sync_s"], "async_s": f["async_s"], "sync_steps": f["sync_steps"], "async_steps": f["async_steps"],
        "time_ratio": None if trivial else ratio(f["sync_s"], f["async_s"]),
        "steps_ratio": None if trivial else ratio(f["async_steps"], f["sync_steps"]),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    sides = [(m, lay) for lay in args.layouts for m in args.modes]
    try:
        runfile = example_run_file(args.example)
        for mode, layout in sides:  # every side's keys load and pass the start-up checks before the first run
            check_keys(args.example, side_overrides(args, runfile, mode, layout))
    except (ConfigError, BenchRunError) as e:
        print(f"longtail: {e}", file=sys.stderr)
        return 2
    cfg = runfile.services.trainer
    # a sample's tokens are all its assistant turns: the per-turn limit says nothing about a multi-turn total
    limit = cfg.sampling.max_new_tokens or None if args.quick or args.workload == "longtail" else None
    eval_prompts = args.eval_prompts if args.eval_prompts is not None else cfg.eval.prompts
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="rlbus-longtail-"))
    results: dict[str, RunResult] = {}
    figures: dict[str, dict[str, Any]] = {}
    try:
        for mode, layout in sides:
            name = f"{mode}-{layout}"
            if args.phase == "evaluate":  # an earlier --phase run's
                results[name] = read_run(name, work / name)
                results[name].checkpoint_write_s = read_write_times(work / name)
                continue
            results[name] = run_rlbus(name, work / name, side_overrides(args, runfile, mode, layout),
                                      example=args.example, timeout_s=args.timeout_s, env=TRACE_ALL,
                                      keep_versions=args.eval_every > 0)
            if not args.keep_run_files:
                prune_run_files(work / name)
        model_dir = example_model_dir(runfile, args.seed)
        for mode, layout in sides:
            name = f"{mode}-{layout}"
            r = results[name]
            offline: dict[str, Any] = {}
            if args.eval_every and args.phase != "run":
                r.curve, offline = run_curve(r, runfile, model_dir, eval_every=args.eval_every,
                                             eval_prompts=eval_prompts, threads=1, seed=args.seed,
                                             engine=args.eval_engine)
            else:  # the loop's own start and end rounds (one prompt, one sample) are no curve
                r.curve = []
            figures[name] = {**side_figures(r, limit, mode == "sync"), **offline}
    except (BenchRunError, ValueError) as e:
        print(f"longtail: {e}", file=sys.stderr)
        return 1
    layouts = {layout: layout_figures(figures[f"sync-{layout}"], figures[f"async-{layout}"],
                                      results[f"sync-{layout}"], results[f"async-{layout}"], args.target)
               for layout in args.layouts if {"sync", "async"} <= set(args.modes)}
    pooled_vs_shared = {mode: ratio(results[f"{mode}-shared"].stats.get("last_step_s"),
                                    results[f"{mode}-pooled"].stats.get("last_step_s"))
                        for mode in args.modes if set(LAYOUTS) <= set(args.layouts)}
    samples_per_step = cfg.groups_per_step * cfg.group_size
    out = {
        "bench": "longtail",
        "workload": args.workload,
        "quick": args.quick,
        "example": str(args.example.relative_to(REPO) if args.example.is_relative_to(REPO) else args.example),
        "model": runfile.model.name,
        "seed": args.seed,
        "steps": args.steps,
        "samples_per_step": samples_per_step,
        "sample_budget": samples_per_step * args.steps,
        "max_new_tokens": limit,
        "set": args.sets,
        "phase": args.phase,
        "eval_every": args.eval_every,
        "eval_prompts": eval_prompts,
        "eval_engine": args.eval_engine if args.eval_every and args.phase != "run" else None,
        "pool_cpus": list(pool_cpus()) if "pooled" in args.layouts else None,
        "layouts": layouts,
        # shared / pooled trainer clock for the whole budget (> 1: the disjoint pools are faster)
        "pooled_vs_shared": pooled_vs_shared,
        "sides": figures,
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
