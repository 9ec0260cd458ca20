"""Steps per second of the default example with 1, 2 and 3 rollout workers on this machine.

    .venv/bin/python bench/fleet.py --steps 40 --rounds 1

Each layout is ``rlbus run addition`` (trainer, judge, weightsync) with ``launcher.services.rollout = N``
(each worker its own process and engine), to ``--steps`` trainer steps; layouts alternate
(1, 2, 3, then 3, 2, 1, ...) so a machine getting busier does not favour one. The figure is the trainer's
mean seconds per step from ``metrics.jsonl`` (start-up excluded), with the mean staleness beside it. The
last line is JSON, with each layout's steps/s relative to one worker.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._rlbus_runs import run_rlbus  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--workers", default="1,2,3", help="rollout worker counts to compare")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    root = Path(tempfile.mkdtemp(prefix="rlbus-bench-fleet-"))
    counts = [int(n) for n in args.workers.split(",")]
    per: dict[int, list[float]] = {n: [] for n in counts}
    stale: dict[int, list[float]] = {n: [] for n in counts}
    for r in range(args.rounds):
        for n in counts if r % 2 == 0 else counts[::-1]:
            keys = {"services.trainer.total_steps": args.steps, "services.trainer.max_wall_s": 0.0,
                    "services.trainer.eval.every": 0, "services.trainer.eval.prompts": 16,
                    "services.trainer.checkpoint_every": 0,
                    "launcher.services.rollout": n}
            res = run_rlbus(f"rollout{n}-{r}", root / f"rollout{n}-{r}", keys)
            per[n].append(res.stats["s_per_step"])
            stale[n].append(res.stats["staleness_mean"])
    base = statistics.median(per[counts[0]])
    out = {"steps": args.steps, "rounds": args.rounds, "cpus": os.cpu_count(),
           "s_per_step": {str(n): v for n, v in per.items()},
           "steps_per_s": {str(n): round(1 / statistics.median(v), 3) for n, v in per.items()},
           "speedup_vs_first": {str(n): round(base / statistics.median(v), 3) for n, v in per.items()},
           "staleness_mean": {str(n): round(statistics.median(v), 3) for n, v in stale.items()}}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
