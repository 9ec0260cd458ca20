"""Where a run's step time went, from its trace files: the pure part of ``bench/longtail.py`` (unit-tested
in ``tests/bench/test_longtail_bench.py``).

The runs are traced whole (``OTEL_TRACES_SAMPLER=always_on``): every ``train step`` (``step`` = k) with its
child ``learner step``, the rollout's ``apply weights`` (``version`` = k: the weights step k made) and
``generate group`` (``version``: the engine's weights when the group started; ``completion_tokens``: each
sample's generated tokens). In a synchronous run (max_staleness 0) step k+1 trains on groups generated at
version k, so per step:

* generation ``g``: first ``generate group`` start to last end among the groups of one version (the batch
  waits for its longest completion: the tail is in here);
* training ``t``: the ``learner step`` span;
* weight sync ``w``: end of step k's ``learner step`` to end of the engine's ``apply weights`` of version
  k (snapshot, publish, transfer and apply; the engine cannot start step k+1's groups before it).

What is left of the step's period (judging, bus hops, admission) is ``other``. With generation and training
fully overlapped, a step costs ``max(g, t)`` instead of ``g + t + w``: the ideal asynchronous speedup is
``(g + t + w) / max(g, t)`` (issue 30).
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any


def read_spans(run_dir: Path) -> list[dict[str, Any]]:
    """Every span of the run's trace files (``<run_dir>/traces/*.jsonl``; a line cut by a kill is skipped)."""
    out = []
    folder = run_dir / "traces"
    for path in sorted(folder.glob("*.jsonl")) if folder.is_dir() else []:
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def _s(ns: int) -> float:
    return ns / 1e9


def training_groups(spans: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The ``generate group`` spans of training groups (evaluation groups' ids start with ``eval``)."""
    return [s for s in spans if s["name"] == "generate group"
            and not str(s["attributes"].get("group_id", "")).startswith("eval")]


def completion_lengths(spans: Iterable[Mapping[str, Any]]) -> list[int]:
    """Every generated training sample's tokens, from its group's ``completion_tokens`` attribute (groups
    generated but never trained, in flight when the run stopped, included)."""
    return [int(n) for s in training_groups(spans) for n in s["attributes"].get("completion_tokens", [])]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation between the closest ranks."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def length_figures(lengths: Sequence[int], limit: int | None = None) -> dict[str, Any]:
    """The completion-length distribution: count, mean, p50/p90/p99/max, max/p50 (the tail's weight) and the
    share that hit ``limit`` (cut at ``max_new_tokens``)."""
    if not lengths:
        return {"count": 0}
    p50 = percentile(lengths, 50)
    out: dict[str, Any] = {
        "count": len(lengths), "mean": round(statistics.fmean(lengths), 1), "p50": round(p50, 1),
        "p90": round(percentile(lengths, 90), 1), "p99": round(percentile(lengths, 99), 1), "max": max(lengths),
        "max_over_p50": round(max(lengths) / p50, 2) if p50 > 0 else None,
    }
    if limit:
        out["at_limit_frac"] = round(sum(n >= limit for n in lengths) / len(lengths), 4)
    return out


def step_split(spans: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per-step generation g, training t and weight sync w of a synchronous run (module docstring): their
    medians over the steps that have each (the mean of t, w too), and how many steps each was seen in.

    Raises:
        ValueError: no learner step or no training group was traced (the run was not traced whole).
    """
    by_id = {s["span_id"]: s for s in spans}
    learner_end: dict[int, float] = {}
    learner_s: list[float] = []
    for s in spans:
        if s["name"] != "learner step":
            continue
        parent = by_id.get(s.get("parent_id") or "")
        if parent is None or "step" not in parent["attributes"]:
            continue
        learner_end[int(parent["attributes"]["step"])] = _s(s["end_ns"])
        learner_s.append(_s(s["end_ns"] - s["start_ns"]))
    applied: dict[int, float] = {}
    for s in spans:
        if s["name"] == "apply weights" and "version" in s["attributes"]:
            v = int(s["attributes"]["version"])
            applied[v] = min(applied.get(v, math.inf), _s(s["end_ns"]))  # the first engine to have it
    weight_s = [applied[k] - end for k, end in learner_end.items() if k in applied and applied[k] >= end]
    windows: dict[int, list[float]] = defaultdict(lambda: [math.inf, -math.inf])
    for s in training_groups(spans):
        w = windows[int(s["attributes"].get("version", 0))]
        w[0], w[1] = min(w[0], _s(s["start_ns"])), max(w[1], _s(s["end_ns"]))
    # version v's groups are step v+1's batch: a window no traced step trained on (made after the last) is left out
    gen_s = [end - start for v, (start, end) in windows.items() if v + 1 in learner_end]
    if not learner_s or not gen_s:
        raise ValueError(f"the traces hold {len(learner_s)} learner step(s) and {len(gen_s)} generation "
                         "window(s); run with OTEL_TRACES_SAMPLER=always_on so every step is traced")
    g, t = statistics.median(gen_s), statistics.median(learner_s)
    w = statistics.median(weight_s) if weight_s else 0.0
    return {"g_s": round(g, 3), "t_s": round(t, 3), "w_s": round(w, 3),
            "t_mean_s": round(statistics.fmean(learner_s), 3),
            "w_mean_s": round(statistics.fmean(weight_s), 3) if weight_s else 0.0,
            "steps_seen": {"g": len(gen_s), "t": len(learner_s), "w": len(weight_s)}}


def tool_figures(spans: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Where an agentic workload's episodes wait on tools: the rollout's ``sandbox.*`` calls (create, exec,
    destroy...: each a request over the bus to the sandbox service) against its ``episode`` spans. ``calls``
    and ``tool_s`` per episode, and ``tool_share``: the calls' time over the episodes' time (episodes run
    concurrently, so this is the share of an episode's own wall time spent waiting on its sandbox). An
    episode whose tools run in-process (the calculator) shows none."""
    episodes = [s for s in spans if s["name"] == "episode" and s.get("service") == "rollout"]
    calls = [s for s in spans if str(s["name"]).startswith("sandbox.") and s.get("service") == "rollout"]
    if not episodes:
        return {"episodes": 0}
    episode_s = sum(_s(s["end_ns"] - s["start_ns"]) for s in episodes)
    tool_s = sum(_s(s["end_ns"] - s["start_ns"]) for s in calls)
    by_verb: dict[str, list[float]] = defaultdict(list)
    for s in calls:
        by_verb[str(s["name"]).removeprefix("sandbox.")].append(_s(s["end_ns"] - s["start_ns"]))
    return {
        "episodes": len(episodes), "calls_per_episode": round(len(calls) / len(episodes), 2),
        "episode_s_mean": round(episode_s / len(episodes), 3), "tool_s_per_episode": round(tool_s / len(episodes), 3),
        "tool_share": round(tool_s / episode_s, 4) if episode_s > 0 else None,
        "p50_ms_by_call": {v: round(1000 * statistics.median(d), 1) for v, d in sorted(by_verb.items())},
    }


def ideal_speedup(g: float, t: float, w: float) -> float | None:
    """``(g + t + w) / max(g, t)``: a synchronous step against one whose generation and training overlap
    fully (weight sync hidden); None when both are 0."""
    bound = max(g, t)
    return round((g + t + w) / bound, 3) if bound > 0 else None
