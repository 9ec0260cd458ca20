"""What the bus costs: the same GRPO step in one process vs through rlbus, synchronous (goal <= 1.1x).

(a) ``examples/grpo_reference.py``: one process samples a batch with ``model.generate``, scores it,
    and takes the GRPO step with the trainer's own loss, optimiser and model I/O; no bus.
(b) ``rlbus run addition`` with ``max_staleness = 0``: the same model, batch (16 prompts x 8), completion
    length, learning rate and thread count (1), every service its own process, so each step waits for
    its batch to be generated, judged and carried over NATS, then for the new weights to reach the engine.

Both run ``--steps`` steps; the figure is seconds per step (a: the reference's RL time per step, b: the
trainer's clock between steps, start-up excluded) and their ratio b / a. Sides alternate over
``--rounds`` (a b, b a, ...) because this machine is shared; the ratio of the medians is printed.
What (b) spends beyond (a) is visible in its metrics (time/step_s learner, time/publish_s, time/commit_s)
and in ``rlbus simulate RUN_DIR``.

    .venv/bin/python bench/bus_overhead.py --steps 60 --rounds 2

``--gaps`` runs the rlbus side with every span traced (``OTEL_TRACES_SAMPLER=always_on``) and adds, per run,
the per-stage medians of its round trip between learner steps (``bench/bus_gaps.py``: weights published and
applied, tickets out, generation, judging, the batch back, and the time no span runs). Tracing every
publish costs the rlbus side some time, so take the ratio from a run without ``--gaps``.

The last stdout line is one JSON object of the figures.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._rlbus_runs import REPO, BenchRunError, read_metrics, run_rlbus, run_stats  # noqa: E402
from bench.bus_gaps import read_spans, step_gaps, summarize  # noqa: E402

log = logging.getLogger("rlbus.bench.bus_overhead")


def reference(steps: int) -> dict[str, float]:
    argv = [sys.executable, str(REPO / "examples" / "grpo_reference.py"), "--max-steps", str(steps),
            "--budget-s", "100000", "--eval-every", str(10 * steps), "--threads", "1"]
    out = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=3600)
    if out.returncode != 0:
        raise BenchRunError(f"grpo_reference exited {out.returncode}: {out.stderr[-2000:]}")
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    return {"s_per_step": summary["s_per_step"], "steps": summary["steps"]}


def through_rlbus(steps: int, run_dir: Path, gaps: bool = False) -> dict[str, Any]:
    result = run_rlbus("sync", run_dir, {"services.trainer.max_staleness": 0, "services.trainer.total_steps": steps,
                                         "services.trainer.eval.every": 0},
                       env={"OTEL_TRACES_SAMPLER": "always_on"} if gaps else None)
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "trainer/version" in r]
    kept = rows[len(rows) // 5:]  # start-up and the first compiles left out
    stats = run_stats(kept)
    return {"s_per_step": stats["s_per_step"], "steps": result.stats["steps"],
            "learner_s": stats["learner_step_s"], "publish_s": stats["publish_s"],
            "commit_s": round(statistics.mean(r.get("time/commit_s", 0.0) for r in kept), 4),
            **({"gaps": summarize(step_gaps(read_spans(run_dir)), skip=len(rows) // 5)} if gaps else {})}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60, help="steps per side and round (default 60)")
    p.add_argument("--rounds", type=int, default=2, help="rounds, sides alternating (default 2)")
    p.add_argument("--gaps", action="store_true", help="trace the rlbus side and add its per-stage round trip")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    root = Path(tempfile.mkdtemp(prefix="rlbus-bench-bus-"))
    ref, bus = [], []
    for r in range(args.rounds):
        for side in ("reference", "rlbus") if r % 2 == 0 else ("rlbus", "reference"):
            if side == "reference":
                ref.append(reference(args.steps))
            else:
                bus.append(through_rlbus(args.steps, root / f"sync-{r}", args.gaps))
            log.info("%s round %d: %s", side, r, (ref if side == "reference" else bus)[-1])
    a = statistics.median(x["s_per_step"] for x in ref)
    b = statistics.median(x["s_per_step"] for x in bus)
    print(f"one process  {a:.3f} s/step   rlbus sync  {b:.3f} s/step   ratio {b / a:.2f}x (goal <= 1.1x)")
    for i, run in enumerate(bus):
        if "gaps" in run:
            print(f"rlbus run {i} round trip (ms, medians): " + ", ".join(
                f"{k} {v:.1f}" for k, v in run["gaps"].get("median_ms", {}).items()))
    print(json.dumps({"reference_s_per_step": round(a, 4), "rlbus_sync_s_per_step": round(b, 4),
                      "ratio": round(b / a, 3), "reference_runs": ref, "rlbus_runs": bus,
                      "run_dirs": str(root)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
