"""What a run's trace files show the simulator's fit (:mod:`services.launcher.simulate_fit`): weight transfer
and pipeline latency, the completion-length distribution, and how an engine's decode iteration cost grows
with its batch.

The traces are ``<run>/traces/<service>-<pid>.jsonl``, one span a line. A rollout's ``generate group`` span
carries its ``group_id`` (``eval...`` for evaluation groups), ``version`` and ``completion_tokens`` (each
sample's generated tokens).

**Iteration cost.** With equal completion lengths an engine's batch hardly changes size within a run, so a
run cannot tell a decode iteration's fixed cost ``a`` from its cost per running sequence ``b``. With
heavy-tailed lengths it can: a group's sequences start together and leave one by one, so the batch drains
while its longest one runs. A group of longest completion ``L`` lasts ``L`` iterations, and its duration is
``D = a * L + b * N`` where ``N`` sums the running sequences over those iterations. :func:`iteration_costs`
replays each engine's groups (every group it ran, evaluation ones too, joining at their recorded starts,
one token per sequence per iteration) to get each group's ``N`` under the current ``(a, b)``, then solves
the least squares of the recorded durations for ``(a, b)``, a few times until they settle.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

#: quantiles of the completion lengths a fit keeps (0 %, 3.125 %, ..., 100 %: the longest is kept)
FIT_QUANTILES = 33
#: least groups with lengths the iteration-cost fit needs
MIN_GROUPS = 6


def read_spans(folder: Path) -> list[dict[str, Any]]:
    """Every span of the trace files in ``folder``, each with ``process``: its file's name (one per process)."""
    out = []
    for path in sorted(folder.glob("*.jsonl")) if folder.is_dir() else []:
        for line in path.read_text().splitlines():
            try:
                span = json.loads(line)
            except ValueError:
                continue  # a line cut by a kill
            span["process"] = path.stem
            out.append(span)
    return out


def duration(span: dict[str, Any]) -> float:
    return (span["end_ns"] - span["start_ns"]) / 1e9


def groups(spans: list[dict[str, Any]], evaluation: bool = False) -> list[dict[str, Any]]:
    """The ``generate group`` spans of training groups (with ``evaluation``: of every group)."""
    return [s for s in spans if s["name"] == "generate group"
            and (evaluation or not str(s["attributes"].get("group_id", "")).startswith("eval"))]


def lengths(span: dict[str, Any]) -> list[int]:
    return [int(n) for n in span["attributes"].get("completion_tokens", [])]


def transfer_s(spans: list[dict[str, Any]]) -> float:
    """Mean time from the trainer's publish of a version to an engine starting to apply it."""
    published = {s["attributes"].get("version"): s["end_ns"] for s in spans if s["name"] == "publish weights"}
    gaps = [(s["start_ns"] - published[v]) / 1e9 for s in spans if s["name"] == "apply weights"
            and (v := s["attributes"].get("version")) in published and s["start_ns"] >= published[v]]
    return statistics.fmean(gaps) if gaps else 0.0


def latency_s(spans: list[dict[str, Any]]) -> float:
    """Median time from the rollout publishing a sample to the trainer handling its scored trajectory."""
    by_id = {s["span_id"]: s for s in spans}
    gaps = []
    for s in spans:
        if s["service"] != "trainer" or not s["name"].startswith("handle") or not s["name"].endswith(".trajectories"):
            continue
        judge_pub = by_id.get(s.get("parent_id") or "")
        judge_handle = by_id.get((judge_pub or {}).get("parent_id") or "")
        rollout_pub = by_id.get((judge_handle or {}).get("parent_id") or "")
        if rollout_pub is not None:
            gaps.append((s["start_ns"] - rollout_pub["start_ns"]) / 1e9)
    return statistics.median(gaps) if gaps else 0.0


def quantiles(values: list[int], count: int = FIT_QUANTILES) -> list[float]:
    """``values`` at ``count`` evenly spaced quantiles, the smallest first and the largest last (linear
    between the closest ranks); [] for no values."""
    ordered = sorted(values)
    if not ordered:
        return []
    out = []
    for k in range(count):
        pos = (len(ordered) - 1) * k / (count - 1)
        lo = int(pos)
        hi = min(lo + 1, len(ordered) - 1)
        out.append(round(ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo), 2))
    return out


def iteration_costs(spans: list[dict[str, Any]], skip_fraction: float = 0.2,
                    rounds: int = 6) -> tuple[float, float] | None:
    """A decode iteration's fixed cost and cost per running sequence ``(a, b)``, in seconds, fitted to the
    training groups' recorded durations (module docstring); the first ``skip_fraction`` of each engine's
    groups (cold start) are replayed but not fitted. None when the traces have fewer than MIN_GROUPS
    groups with lengths, or their durations do not show a cost per sequence clearly."""
    engines: dict[str, list[tuple[float, float, list[int], bool]]] = defaultdict(list)
    for s in groups(spans, evaluation=True):
        if lengths(s):
            train = not str(s["attributes"].get("group_id", "")).startswith("eval")
            engines[s.get("process", s["service"])].append((s["start_ns"] / 1e9, duration(s), lengths(s), train))
    for runs in engines.values():
        runs.sort(key=lambda g: g[0])
    if sum(g[3] for runs in engines.values() for g in runs) < MIN_GROUPS:
        return None
    a, b = statistics.median(g[1] / max(g[2]) for runs in engines.values() for g in runs), 0.0
    for _ in range(rounds):
        rows = []  # (L, N, D) of the fitted groups
        for runs in engines.values():
            summed = _replay(runs, a, b)
            rows += [(max(g[2]), n, g[1]) for g, n in list(zip(runs, summed, strict=True))[int(len(runs) * skip_fraction):]
                     if g[3]]
        solved = _least_squares(rows)
        if solved is None:
            return None
        if abs(solved[0] - a) <= 1e-3 * a and abs(solved[1] - b) <= 1e-3 * max(b, 1e-9):
            return solved
        a, b = solved
    return a, b


def _replay(runs: list[tuple[float, float, list[int], bool]], a: float, b: float) -> list[int]:
    """Each group's running sequences summed over its iterations, when one engine's groups join its batch at
    their recorded starts and an iteration of ``n`` sequences takes ``a + b * n``."""
    summed = [0] * len(runs)
    running: list[list[int]] = []  # [tokens left, group index]
    t, i = runs[0][0], 0
    while i < len(runs) or running:
        if not running:
            t = max(t, runs[i][0])
        while i < len(runs) and runs[i][0] <= t:
            running += [[n, i] for n in runs[i][2] if n > 0]
            i += 1
        n = len(running)
        for g in {r[1] for r in running}:
            summed[g] += n
        t += a + b * n
        for r in running:
            r[0] -= 1
        running = [r for r in running if r[0] > 0]
    return summed


def _least_squares(rows: list[tuple[int, int, float]]) -> tuple[float, float] | None:
    """``(a, b) >= 0`` minimising the squared error of ``D = a * L + b * N`` over ``rows`` of (L, N, D);
    None when ``b`` is not clearly above its noise (less than three standard errors): the group times
    then do not show the batch's share, and the caller keeps one cost per iteration. Groups slowed by
    something else (their time more than three robust deviations off the first fit) are left out."""
    first = _solve(rows)
    if first is None:
        return None
    misses = [abs(d - first[0] * n_l - first[1] * n_n) for n_l, n_n, d in rows]
    spread = 1.4826 * statistics.median(misses)
    if spread > 1e-9 * max(r[2] for r in rows):  # not an exact fit: leave the far misses out
        rows = [r for r, miss in zip(rows, misses, strict=True) if miss <= 3 * spread]
    solved = _solve(rows)
    if solved is None:
        return None
    a, b, se_b = solved
    if b <= 3 * se_b:
        return None
    if a <= 0:  # all of it per sequence
        return 1e-6, sum(r[1] * r[2] for r in rows) / sum(r[1] * r[1] for r in rows)
    return a, b


def _solve(rows: list[tuple[int, int, float]]) -> tuple[float, float, float] | None:
    """The unconstrained least squares ``(a, b)`` and the standard error of ``b``; None when the rows
    cannot tell the two apart."""
    ll = sum(r[0] * r[0] for r in rows)
    ln = sum(r[0] * r[1] for r in rows)
    nn = sum(r[1] * r[1] for r in rows)
    ld = sum(r[0] * r[2] for r in rows)
    nd = sum(r[1] * r[2] for r in rows)
    det = ll * nn - ln * ln
    if len(rows) < 3 or ll <= 0 or det <= 1e-9 * ll * nn:
        return None  # every group alike
    a, b = (ld * nn - nd * ln) / det, (nd * ll - ld * ln) / det
    residual = sum((d - a * n_l - b * n_n) ** 2 for n_l, n_n, d in rows) / (len(rows) - 2)
    return a, b, (residual * ll / det) ** 0.5
