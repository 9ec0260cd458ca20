"""``rlbus simulate``: predictions from a run directory, or a planning table from a plan file."""

from __future__ import annotations

import argparse
import json
import tomllib
from pathlib import Path
from typing import Any

import msgspec

from services.launcher.simulate import Simulation
from services.launcher.simulate_fit import (
    FitError,
    changed_shape,
    fit,
    lengths_of,
    measure,
    predict,
    shape_of,
)
from services.launcher.simulate_model import Rates, Result, Shape
from services.runtime.config import ConfigError

DESCRIPTION = (
    "A discrete-event model of the loop (engines with a tokens/s-vs-batch curve, judges, sandboxes, the "
    "trainer's step, weight sync, admission bound and staleness filter). With RUN_DIR it fits its rates to "
    "what that run recorded (metrics.jsonl, traces/, usage.jsonl), shows how well it reproduces the run, "
    "then predicts the run with other settings: by default synchronous (max_staleness=0), asynchronous "
    "(max_staleness=1), one more rollout worker and, for a pooled run, everything shared (trainer_cores=0); "
    "--set KEY=VALUE (repeatable) predicts one variant "
    "instead (keys: the fields of the plan file's [shape]). The fit reads the run's layout from its run "
    "file: where [placement] pins the trainer to CPUs no other service has, the trainer gets its own pool "
    "(trainer_cores) and every other part shares the rest of --cores (--set trainer_cores=0 predicts the "
    "run with everything shared; --set trainer_cores=1 on a shared run predicts disjoint pools). It draws "
    "completion lengths from the run's own distribution (length_quantiles, from the traces' generate group "
    "spans; a synchronous step waits for its longest completion) and takes how an engine's iteration cost "
    "grows with its batch from the group times, and the learner's cost per token from its steps' times. "
    "--lengths-from OTHER_RUN_DIR predicts with that run's completion lengths instead (two runs at one seed "
    "need not sample the same lengths: this tells the model's error from that). A changed trainer_threads "
    "rescales the learner by Amdahl's law (learner_serial_fraction, settable). With --plan FILE it prints a "
    "table for a cluster from the rates in FILE ([rates], [shape], and [sweep] lists of shape values), with each "
    "part's idle fraction. The last line is JSON.")


def add_parser(sub: Any) -> None:
    sim = sub.add_parser("simulate", help="predict steps/s, staleness and idle time from a run or a plan file",
                         description=DESCRIPTION)
    sim.add_argument("run_dir", nargs="?", metavar="RUN_DIR", help="a run directory to fit the rates to")
    sim.add_argument("--plan", metavar="FILE", help="a plan file (TOML): rates, shape and a sweep")
    sim.add_argument("--set", dest="changes", action="append", default=[], metavar="KEY=VALUE",
                     help="a shape setting of the predicted run (repeatable), e.g. max_staleness=0, engines=2")
    sim.add_argument("--steps", type=int, default=60, metavar="N", help="simulated trainer steps (default 60)")
    sim.add_argument("--cores", type=float, default=None, metavar="N",
                     help="cores of the machine the run had (default: this machine's)")
    sim.add_argument("--lengths-from", metavar="RUN_DIR", default=None,
                     help="with RUN_DIR: predict with this other run's completion lengths (its traces' "
                     "distribution and its batches' mean) instead of the fitted run's")
    sim.add_argument("--background-yields", action="store_true",
                     help="the machine's other tenants ran at a lower priority than the run (nice 19): they "
                     "took only the cores it left idle (default: they shared every core fairly with it)")


def main(args: argparse.Namespace) -> int:
    if (args.run_dir is None) == (args.plan is None):
        raise ConfigError("rlbus simulate: give a RUN_DIR or --plan FILE (one of them)")
    if args.steps < 1:
        raise ConfigError("rlbus simulate: --steps takes a positive number")
    changes = _changes(args.changes)
    if args.plan is not None and args.lengths_from is not None:
        raise ConfigError("rlbus simulate: --lengths-from goes with a RUN_DIR (a plan file's [shape] gives lengths)")
    if args.plan is not None:
        return _plan(Path(args.plan), changes, args.steps)
    try:
        run_dir = Path(args.run_dir)
        shape, measured = shape_of(run_dir, args.cores), measure(run_dir)
        shape = msgspec.structs.replace(shape, background_yields=args.background_yields)
        changed_shape(shape, changes)  # a bad --set fails before the fit
        shape, rates, reproduced = fit(shape, measured, steps=args.steps)
        drawn = lengths_of(measure(Path(args.lengths_from))) if args.lengths_from is not None else {}
    except FitError as e:
        raise ConfigError(f"rlbus simulate: {e}") from e
    print(f"measured  {measured.steps_per_s:6.3f} steps/s  staleness {measured.staleness_mean:.2f}  "
          f"learner {measured.learner_s * 1e3:.0f} ms  (other tenants took {measured.background_cores:.2f} cores)")
    q = shape.length_quantiles
    lengths = (f"p50 {q[len(q) // 2]:.0f}, p90 {q[round(0.9 * (len(q) - 1))]:.0f}, max {q[-1]:.0f}" if q
               else f"mean {shape.completion_tokens:.0f} (Gaussian: no lengths in the traces)")
    pools = (f"trainer {shape.trainer_cores:g} + the rest {shape.cores - shape.trainer_cores:g} cores"
             if shape.trainer_cores else f"one pool of {shape.cores:g} cores" if shape.cores else "a device each")
    print(f"shape     lengths {lengths} tokens; {pools}")
    print(f"model     {reproduced.steps_per_s:6.3f} steps/s  staleness {reproduced.staleness_mean:.2f}  "
          f"learner {reproduced.learner_s * 1e3:.0f} ms  (fitted)")
    print("fitted rates: " + ", ".join(f"{k}={v:.4g}" for k, v in msgspec.to_builtins(rates).items() if v))
    if drawn:
        print(f"lengths   from {args.lengths_from}: mean {drawn['completion_tokens']:.0f} tokens (fitted run: "
              f"{shape.completion_tokens:.0f})")
    variants = [changes] if changes else [{"max_staleness": 0}, {"max_staleness": 1}, {"engines": shape.engines + 1},
                                          *([{"trainer_cores": 0}] if shape.trainer_cores else [])]
    rows = []
    for change in variants:
        try:
            result = predict(shape, rates, {**change, **drawn}, steps=args.steps)
        except FitError as e:
            raise ConfigError(f"rlbus simulate: {e}") from e
        rows.append({"set": change, **({"lengths_from": args.lengths_from} if drawn else {}), **_row(result)})
        print(f"predicted {_label(change):24s} {_line(result)}")
    print(json.dumps({"measured": msgspec.to_builtins(measured), "rates": msgspec.to_builtins(rates),
                      "reproduced": _row(reproduced), "predicted": rows}))
    return 0


def _plan(path: Path, changes: dict[str, Any], steps: int) -> int:
    try:
        doc = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"rlbus simulate --plan {path}: {e}") from e
    unknown = set(doc) - {"rates", "shape", "sweep", "notes"}
    if unknown:
        raise ConfigError(f"{path}: unknown sections {sorted(unknown)} (expected rates, shape, sweep)")
    try:
        rates = msgspec.convert(doc.get("rates", {}), Rates)
        shape = msgspec.convert({**doc.get("shape", {}), **changes}, Shape)
    except msgspec.ValidationError as e:
        raise ConfigError(f"{path}: {e}") from e
    sweep = doc.get("sweep", {})
    for key, values in sweep.items():
        if key not in Shape.__struct_fields__ or not isinstance(values, list) or not values:
            raise ConfigError(f"{path}: [sweep] {key} must be a non-empty list of values of a [shape] field")
    grid: list[dict[str, Any]] = [{}]
    for key, values in sweep.items():
        grid = [{**g, key: v} for g in grid for v in values]
    rows = []
    header = " ".join(f"{k:>14s}" for k in sweep) + f" {'steps/h':>9s} {'staleness':>9s} {'dropped':>7s}  idle"
    print(header)
    for point in grid:
        try:
            variant = msgspec.convert({**msgspec.to_builtins(shape), **point}, Shape)
        except msgspec.ValidationError as e:
            raise ConfigError(f"{path}: [sweep] {point}: {e}") from e
        result = Simulation(variant, rates).run(steps)
        rows.append({"set": point, **_row(result)})
        idle = "  ".join(f"{k} {v:.0%}" for k, v in result.idle.items())
        print(" ".join(f"{v!s:>14s}" for v in point.values())
              + f" {result.steps_per_s * 3600:9.1f} {result.staleness_mean:9.2f} {result.dropped_groups:7d}  {idle}",
              flush=True)
    print(json.dumps({"plan": str(path), "rows": rows}))
    return 0


def _changes(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in Shape.__struct_fields__:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE with KEY one of {', '.join(Shape.__struct_fields__)}")
        try:
            out[key] = json.loads(value)
        except ValueError:
            raise ConfigError(f"--set {item!r}: the value must be a number, true/false or (length_quantiles) a "
                              "list such as [4, 30, 512]") from None
    return out


def _row(r: Result) -> dict[str, Any]:
    return {"steps_per_s": round(r.steps_per_s, 4), "staleness": r.staleness,
            "staleness_mean": round(r.staleness_mean, 4), "dropped_groups": r.dropped_groups, "idle": r.idle}


def _label(change: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in change.items())


def _line(r: Result) -> str:
    idle = " ".join(f"{k} {v:.0%}" for k, v in r.idle.items())
    return f"{r.steps_per_s:6.3f} steps/s  staleness {r.staleness_mean:.2f} {r.staleness}  idle: {idle}"
