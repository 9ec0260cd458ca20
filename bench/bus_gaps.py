"""Where a synchronous step's time goes between two learner steps, read from a run's traces.

In a synchronous run (``max_staleness = 0``) everything between the end of learner step k-1 and the
start of learner step k is the bus's round trip: the trainer snapshots and sends version k, commits the
batch of step k-1 (state, outcomes, acks) and issues the tickets of step k; the rollout applies version k
and generates; the judge scores; the trainer has the batch. This reads the spans every service writes
(``<run dir>/traces/*.jsonl``; run with ``OTEL_TRACES_SAMPLER=always_on`` so every group and step is
traced) and prints, per stage, the median over steps of:

* ``snapshot``      learner step k-1 ends -> ``publish weights`` of version k starts
* ``publish``       the ``publish weights`` span (stored and announced)
* ``to_apply``      publish ends -> the engine's ``apply weights`` of version k starts (watch + fetch)
* ``apply``         the ``apply weights`` span
* ``to_tickets``    publish ends -> the first ticket of step k is admitted (commit of step k-1 before it)
* ``tickets``       first ``admit group`` starts -> last one ends (the tickets published)
* ``to_rollout``    first ticket admitted -> the rollout's handler of it starts (fetch of PROMPTS)
* ``to_generate``   the rollout's first handler starts -> the first ``generate group`` starts (waiting
  for version k when the ticket came first)
* ``generate``      first ``generate group`` starts -> last one ends
* ``to_judged``     last generation ends -> the judge's last handler of the batch ends (fetch, grade, publish)
* ``to_trainer``    -> the trainer's last handler of the batch ends (fetch of TRAJECTORIES)
* ``to_learner``    -> learner step k starts (collect() wakes up and takes the batch)
* ``round_trip``    learner step k-1 ends -> learner step k starts (the sum of the chain above)
* ``uncovered``     time in ``round_trip`` during which no span of any service runs: waits on a fetch,
  a timer, a wake-up. CPU noise stretches spans; it does not open gaps, so this is the structural part.

    OTEL_TRACES_SAMPLER=always_on rlbus run addition --set services.trainer.max_staleness=0 ...
    .venv/bin/python bench/bus_gaps.py RUN_DIR [--skip 5]

or ``bench/bus_overhead.py --gaps``, which runs the synchronous side traced and prints these figures
beside its ratio. The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

STAGES = ("snapshot", "publish", "to_apply", "apply", "to_tickets", "tickets", "to_rollout", "to_generate",
          "generate", "to_judged", "to_trainer", "to_learner", "round_trip", "uncovered")


def read_spans(run_dir: Path) -> list[dict[str, Any]]:
    """Every span the run's services wrote (``traces/*.jsonl``); a torn last line is skipped."""
    spans = []
    for path in sorted((run_dir / "traces").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                spans.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    if not spans:
        raise SystemExit(f"no spans under {run_dir / 'traces'}: run with OTEL_TRACES_SAMPLER=always_on")
    return spans


def _union_ns(intervals: list[tuple[int, int]], lo: int, hi: int) -> int:
    """Nanoseconds of [lo, hi] covered by ``intervals``."""
    covered, end = 0, lo
    for a, b in sorted(intervals):
        a, b = max(a, end), min(b, hi)
        if b > a:
            covered += b - a
            end = b
    return covered


def step_gaps(spans: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Per synchronous step (from the second traced one), each stage of :data:`STAGES` in milliseconds."""
    by_trace: dict[str, list[dict[str, Any]]] = defaultdict(list)
    by_id = {}
    for s in spans:
        by_trace[s["trace_id"]].append(s)
        by_id[s["span_id"]] = s
    steps = {s["attributes"]["step"]: s for s in spans if s["name"] == "train step" and "step" in s["attributes"]}
    children: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    for s in spans:
        if s.get("parent_id") and s["name"] in ("learner step", "publish weights"):
            children[s["parent_id"]][s["name"]] = s
    applies = {s["attributes"]["version"]: s for s in spans if s["name"] == "apply weights"}
    # spans that mean work (or a message on its way); the rollout's ticket handler also holds its wait for
    # the version, and a step span holds everything, so they do not count as covering
    work = [(s["start_ns"], s["end_ns"]) for s in spans
            if s["name"] != "train step" and not (s["service"] == "rollout" and s["name"].startswith("handle "))]
    out = []
    for k in sorted(steps):
        prev, cur = steps.get(k - 1), steps[k]
        if prev is None:
            continue
        learn_prev = children[prev["span_id"]].get("learner step")
        pub = children[prev["span_id"]].get("publish weights")
        learn = children[cur["span_id"]].get("learner step")
        if learn_prev is None or pub is None or learn is None:
            continue
        apply = applies.get(pub["attributes"].get("version"))
        groups = {link["trace_id"] for link in cur.get("links", [])}
        mine = [s for g in groups for s in by_trace.get(g, [])]
        admits = [s for s in mine if s["name"] == "admit group"]
        handles = {svc: [s for s in mine if s["service"] == svc and s["name"].startswith("handle ")]
                   for svc in ("rollout", "judge", "trainer")}
        gens = [s for s in mine if s["name"] == "generate group"]
        if not (admits and gens and apply and all(handles.values())):
            continue
        t0, t_end = learn_prev["end_ns"], learn["start_ns"]
        first_admit = min(s["start_ns"] for s in admits)
        first_handle = min(s["start_ns"] for s in handles["rollout"])
        first_gen, last_gen = min(s["start_ns"] for s in gens), max(s["end_ns"] for s in gens)
        judged = max(s["end_ns"] for s in handles["judge"])
        trained = max(s["end_ns"] for s in handles["trainer"])
        ns = {
            "snapshot": pub["start_ns"] - t0,
            "publish": pub["end_ns"] - pub["start_ns"],
            "to_apply": apply["start_ns"] - pub["end_ns"],
            "apply": apply["end_ns"] - apply["start_ns"],
            "to_tickets": first_admit - pub["end_ns"],
            "tickets": max(s["end_ns"] for s in admits) - first_admit,
            "to_rollout": first_handle - first_admit,
            "to_generate": first_gen - first_handle,
            "generate": last_gen - first_gen,
            "to_judged": judged - last_gen,
            "to_trainer": trained - judged,
            "to_learner": t_end - trained,
            "round_trip": t_end - t0,
            "uncovered": (t_end - t0) - _union_ns(work, t0, t_end),
        }
        out.append({"step": k, **{name: v / 1e6 for name, v in ns.items()}})
    return out


def summarize(rows: list[dict[str, float]], skip: int = 0) -> dict[str, Any]:
    """Per-stage medians (ms) over the steps after the first ``skip``."""
    kept = rows[skip:]
    if not kept:
        return {"steps": 0}
    return {"steps": len(kept), "median_ms": {k: round(statistics.median(r[k] for r in kept), 2) for k in STAGES}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path)
    p.add_argument("--skip", type=int, default=5, help="steps left out at the start (warm-up; default 5)")
    args = p.parse_args(argv)
    summary = summarize(step_gaps(read_spans(args.run_dir)), args.skip)
    for k, v in summary.get("median_ms", {}).items():
        print(f"{k:12s} {v:9.2f} ms")
    print(json.dumps({"run_dir": str(args.run_dir), **summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
