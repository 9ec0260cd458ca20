"""How well ``rlbus simulate`` predicts real runs on this machine (goal: within 15 %).

Three runs of the default example (``rlbus run addition``, ``--steps`` trainer steps each, no evaluation
during the run): asynchronous (max_staleness 1) with one rollout worker, synchronous (max_staleness 0),
and asynchronous with two rollout workers. The model is fitted to the first (its rates from the run
directory: metrics.jsonl, traces, usage.jsonl) and predicts the other two, each with the cores other
tenants of this shared machine took while it ran. Printed: measured and predicted steps/s and mean
staleness, and the relative error of each prediction.

    .venv/bin/python bench/simulate_check.py            # three runs of 60 steps: about 3 minutes

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

from bench._rlbus_runs import run_rlbus  # noqa: E402
from services.launcher.simulate_fit import fit, measure, predict, shape_of  # noqa: E402

VARIANTS = {
    "async": {"services.trainer.max_staleness": 1},
    "sync": {"services.trainer.max_staleness": 0},
    "async_2_workers": {"services.trainer.max_staleness": 1, "launcher.services.rollout": 2},
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60, help="trainer steps per run (default 60)")
    args = p.parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(main())
