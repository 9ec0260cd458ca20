"""How well ``rlbus simulate`` predicts real runs on this machine (goal: within 15 %).

Three runs of the default example (``rlbus run addition``, ``--steps`` trainer steps each, no evaluation
during the run): asynchronous (max_staleness 1) with one rollout worker, synchronous (max_staleness 0),
and asynchronous with two rollout workers. The model is fitted to the first (its rates from the run
directory: metrics.jsonl, traces, usage.jsonl) and predicts the other two, each with the cores other
tenants of this shared machine took while it ran. Printed: measured and predicted steps/s and mean
staleness, and the relative error of each prediction.

    .venv/bin/python bench/simulate_check.py            # three runs of 60 steps: about 3 minutes

``--runs DIR`` checks runs that exist instead: each run directory in DIR (as bench/longtail.py's
``--work-dir`` leaves them: ``sync-shared``, ``async-shared``, ``sync-pooled``, ``async-pooled``). The model
is fitted to one (``--fit NAME``; default the first synchronous one, by name) and predicts each other from
that run's own shape: what differs between the two run files (max_staleness, the trainer's own pool
``trainer_cores``, thread counts, fleet, batch) is the change, and the fitted run's completion lengths and
rates stay. Each prediction gets the cores other tenants of the machine took during its target run
(usage.jsonl), as in the default mode.

    .venv/bin/python bench/simulate_check.py --runs /tmp/lt20 --cores 2       # fit sync-pooled, predict the rest

``--target-lengths``: each prediction is printed twice, with the fitted run's completion lengths (plain, the
only way to predict a run not yet made) and with the target run's own (its traces' distribution and its
batches' mean tokens, which change the learner's work too). Sampling differs with batching, so two runs at the
same seed need not make the same lengths; the second figure separates the layout model's error from that.

``--fit A,B`` (two runs whose learners had different thread counts, e.g. ``sync-pooled,sync-shared``): both are
fitted, the learner's scaling with threads (``Shape.learner_serial_fraction``) is taken from the two learner
rates, and the first predicts every other run with it. A prediction of B then uses a figure fitted from B.

``--background-yields``: the runs ran at normal priority while the machine's other tenants ran at
``nice -n 19`` (they took only the cores the runs left idle); without it they are taken to share every
core fairly. Which one holds decides much of a prediction on a shared machine: say which in the figures.

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

import msgspec

if __package__ in (None, ""):  # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._rlbus_runs import run_rlbus  # noqa: E402
from services.launcher.simulate_fit import (  # noqa: E402
    FitError,
    fit,
    lengths_of,
    measure,
    predict,
    serial_fraction,
    shape_of,
)
from services.launcher.simulate_model import Shape  # noqa: E402

VARIANTS = {
    "async": {"services.trainer.max_staleness": 1},
    "sync": {"services.trainer.max_staleness": 0},
    "async_2_workers": {"services.trainer.max_staleness": 1, "launcher.services.rollout": 2},
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60, help="trainer steps per run (default 60)")
    p.add_argument("--runs", type=Path, default=None, metavar="DIR",
                   help="check the run directories in DIR instead of running three new ones")
    p.add_argument("--fit", default=None, metavar="NAME[,NAME2]",
                   help="with --runs: the run to fit (default: the first synchronous one by name); NAME,NAME2: "
                   "also fit NAME2 and take the learner's scaling with threads from the two")
    p.add_argument("--target-lengths", action="store_true",
                   help="with --runs: also predict each run with its own completion lengths (beside the plain "
                   "prediction with the fitted run's)")
    p.add_argument("--cores", type=float, default=None,
                   help="with --runs: cores of the machine the runs had (default: this machine's)")
    p.add_argument("--sim-steps", type=int, default=60, help="with --runs: simulated steps per prediction")
    p.add_argument("--background-yields", action="store_true",
                   help="with --runs: the machine's other tenants ran at a lower priority than the runs (nice 19)")
    args = p.parse_args(argv)
    if args.runs is not None:
        try:
            figures = check_runs(args.runs, args.fit, args.cores, args.sim_steps, args.background_yields,
                                 args.target_lengths)
        except FitError as e:
            print(f"simulate_check: {e}", file=sys.stderr)
            return 2
        print(json.dumps(figures))
        return 0
    if args.fit is not None or args.cores is not None or args.target_lengths:
        p.error("--fit, --cores and --target-lengths go with --runs")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    root = Path(tempfile.mkdtemp(prefix="rlbus-bench-simulate-"))
    dirs = {}
    for label, keys in VARIANTS.items():
        run_rlbus(label, root / label, {**keys, "services.trainer.total_steps": args.steps,
                                        "services.trainer.eval.every": 0})
        dirs[label] = root / label
    shape, measured = shape_of(dirs["async"]), measure(dirs["async"])
    fitted, rates, reproduced = fit(shape, measured)
    figures = {"fitted_on": "async", "reproduced_error": reproduced.steps_per_s / measured.steps_per_s - 1}
    print(f"{'run':18s} {'measured':>9s} {'predicted':>9s} {'error':>7s} {'staleness':>9s} {'predicted':>9s}")
    for label, change in (("sync", {"max_staleness": 0}), ("async_2_workers", {"engines": 2})):
        target = measure(dirs[label])
        got = predict(fitted, rates, change, background_cores=target.background_cores)
        error = got.steps_per_s / target.steps_per_s - 1
        figures[label] = {"measured_steps_per_s": round(target.steps_per_s, 4),
                          "predicted_steps_per_s": round(got.steps_per_s, 4), "error": round(error, 4),
                          "measured_staleness": round(target.staleness_mean, 3),
                          "predicted_staleness": round(got.staleness_mean, 3),
                          "background_cores": round(target.background_cores, 2)}
        print(f"{label:18s} {target.steps_per_s:9.3f} {got.steps_per_s:9.3f} {error:+7.1%} "
              f"{target.staleness_mean:9.2f} {got.staleness_mean:9.2f}")
    figures["async_measured_steps_per_s"] = round(measured.steps_per_s, 4)
    figures["background_cores_async"] = round(measured.background_cores, 2)
    print(json.dumps(figures))
    return 0


#: Shape fields a fit sets from what the run recorded, not from its run file: never a change between runs
FITTED = frozenset({"completion_tokens", "length_quantiles", "background", "learner_serial_fraction"})


def run_dirs(root: Path) -> dict[str, Path]:
    """The run directories in ``root`` by name (those holding a config.resolved.json), in name order."""
    found = {d.name: d for d in sorted(root.iterdir()) if (d / "config.resolved.json").is_file()} \
        if root.is_dir() else {}
    if len(found) < 2:
        raise FitError(f"{root} holds {len(found)} run director{'y' if len(found) == 1 else 'ies'} (a folder with "
                       "config.resolved.json); the check fits one and predicts the others")
    return found


def changes_between(fitted: Shape, target: Shape) -> dict[str, Any]:
    """The Shape fields whose run-file values differ between two runs (what a prediction changes)."""
    return {k: getattr(target, k) for k in Shape.__struct_fields__
            if k not in FITTED and getattr(target, k) != getattr(fitted, k)}


def check_runs(root: Path, fit_name: str | None, cores: float | None, sim_steps: int,
               background_yields: bool = False, target_lengths: bool = False) -> dict[str, Any]:
    """Fit the model to one run in ``root`` (``fit_name``; "A,B": A, with the learner's scaling with threads
    from A and B) and predict every other from its own run file, with ``target_lengths`` also with its own
    completion lengths (module docstring); prints a table, returns the figures."""
    dirs = run_dirs(root)
    shapes = {name: msgspec.structs.replace(shape_of(d, cores), background_yields=background_yields)
              for name, d in dirs.items()}
    if fit_name is None:
        fit_name = next((n for n, sh in shapes.items() if sh.max_staleness == 0), next(iter(dirs)))
    names = fit_name.split(",")
    for name in names:
        if name not in dirs:
            raise FitError(f"--fit {fit_name}: {name!r} is not a run directory in {root} ({', '.join(dirs)})")
    if len(names) > 2 or len(set(names)) != len(names):
        raise FitError(f"--fit {fit_name}: one run, or two different runs (the second for the learner's scaling)")
    fit_name = names[0]
    measured = measure(dirs[fit_name])
    fitted, rates, reproduced = fit(shapes[fit_name], measured, steps=sim_steps)
    if len(names) == 2:
        other_shape, other_rates, _ = fit(shapes[names[1]], measure(dirs[names[1]]), steps=sim_steps)
        serial = serial_fraction((fitted, rates), (other_shape, other_rates))
        fitted = msgspec.structs.replace(fitted, learner_serial_fraction=serial)
    figures: dict[str, Any] = {
        "bench": "simulate_check", "runs": str(root), "fitted_on": fit_name, "background_yields": background_yields,
        "scaling_from": names if len(names) == 2 else None,
        "fitted": {"measured_steps_per_s": round(measured.steps_per_s, 5),
                   "reproduced_steps_per_s": round(reproduced.steps_per_s, 5),
                   "error": round(reproduced.steps_per_s / measured.steps_per_s - 1, 4),
                   "length_quantiles": fitted.length_quantiles, "completion_tokens": round(fitted.completion_tokens, 2),
                   "trainer_cores": fitted.trainer_cores, "trainer_threads": fitted.trainer_threads,
                   "learner_serial_fraction": round(fitted.learner_serial_fraction, 4),
                   "learn_fixed_s": round(rates.learn_fixed_s, 4), "learn_per_token_s": round(rates.learn_per_token_s, 6),
                   "iter_fixed_s": round(rates.iter_fixed_s, 5), "iter_per_seq_s": round(rates.iter_per_seq_s, 6)},
        "predicted": {}}
    scaling = (f"fitted from {' and '.join(names)}" if len(names) == 2 else "the default")
    print(f"fitted on {fit_name}: measured {measured.steps_per_s:.4f} steps/s, reproduced "
          f"{reproduced.steps_per_s:.4f} ({figures['fitted']['error']:+.1%}); learner serial fraction "
          f"{fitted.learner_serial_fraction:.3f} ({scaling}), {rates.learn_fixed_s:.2f} s + "
          f"{rates.learn_per_token_s * 1e3:.3f} ms/token at {fitted.trainer_threads:g} threads")
    own = f" {'own lengths':>11s} {'error':>7s}" if target_lengths else ""
    print(f"{'run':16s} {'measured':>9s} {'predicted':>9s} {'error':>7s}{own} {'staleness':>9s} {'predicted':>9s}"
          "  changes")
    errors, own_errors = [], []
    for name, d in dirs.items():
        if name == fit_name:
            continue
        change = changes_between(shapes[fit_name], shapes[name])
        try:
            target = measure(d)
        except FitError as e:  # a run still going, or one that stopped early
            figures.setdefault("skipped", {})[name] = str(e)
            print(f"{name:16s} skipped: {e}")
            continue
        got = predict(fitted, rates, change, steps=sim_steps, background_cores=target.background_cores)
        error = got.steps_per_s / target.steps_per_s - 1
        errors.append(abs(error))
        row = figures["predicted"][name] = {
            "changes": change, "measured_steps_per_s": round(target.steps_per_s, 5),
            "predicted_steps_per_s": round(got.steps_per_s, 5), "error": round(error, 4),
            "measured_staleness": round(target.staleness_mean, 3), "predicted_staleness": round(got.staleness_mean, 3),
            "background_cores": round(target.background_cores, 2), "measured_steps": target.steps,
            "completion_tokens": round(target.completion_tokens, 2)}
        line = f"{name:16s} {target.steps_per_s:9.4f} {got.steps_per_s:9.4f} {error:+7.1%}"
        if target_lengths:  # the same change, drawing the target's own lengths
            with_own = predict(fitted, rates, {**change, **lengths_of(target)}, steps=sim_steps,
                               background_cores=target.background_cores)
            own_error = with_own.steps_per_s / target.steps_per_s - 1
            own_errors.append(abs(own_error))
            row["target_lengths"] = {"predicted_steps_per_s": round(with_own.steps_per_s, 5),
                                     "error": round(own_error, 4),
                                     "predicted_staleness": round(with_own.staleness_mean, 3)}
            line += f" {with_own.steps_per_s:11.4f} {own_error:+7.1%}"
        print(f"{line} {target.staleness_mean:9.2f} {got.staleness_mean:9.2f}  {change}")
    if not errors:
        raise FitError(f"no run in {root} besides {fit_name} could be measured: {figures['skipped']}")
    figures["max_abs_error"] = round(max(errors), 4)
    figures["within_15pct"] = max(errors) <= 0.15
    if target_lengths:
        figures["max_abs_error_target_lengths"] = round(max(own_errors), 4)
        figures["within_15pct_target_lengths"] = max(own_errors) <= 0.15
    return figures


if __name__ == "__main__":
    sys.exit(main())
