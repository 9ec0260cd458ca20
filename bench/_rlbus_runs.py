"""Shared helpers of the RL benchmarks: launch ``rlbus run`` and read its metrics.

The pure part (eval curves, time to a target reward, reward at a given time) is
unit-tested in ``tests/bench/test_bench_helpers.py``; :func:`run_rlbus` is the
only function that starts processes.

Clock. Every time here is seconds since the trainer finished loading (the
``elapsed_s`` of ``metrics.jsonl``). An evaluation of weight version ``v`` is
placed at the moment version ``v`` existed: the ``elapsed_s`` of the trainer
step that produced it (0 for version 0). So the cost of evaluating, which runs
beside training and comes back later, does not count as time to a reward; the
competitor bench measures its side the same way (its evaluation time is taken
off its clock).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("rlbus.bench")

REPO = Path(__file__).resolve().parents[1]
#: the addition example (tiny model, 2-digit addition) every RL bench runs
EXAMPLE = REPO / "examples" / "addition.toml"
#: reward comparisons allow this much float slack (rewards are means over prompts)
EPS = 1e-9


class BenchRunError(RuntimeError):
    """A benchmark run failed or left no usable metrics."""


@dataclass(frozen=True)
class EvalPoint:
    """One held-out evaluation of a run.

    Attributes:
        version: the weight version evaluated.
        step: trainer steps done when that version existed.
        reward: mean held-out reward in [0, 1].
        t: seconds (trainer clock) at which the evaluated version existed.
        reported_s: seconds at which the evaluation result came back.
    """

    version: int
    step: int
    reward: float
    t: float
    reported_s: float


@dataclass
class RunResult:
    """What one rlbus run left behind, reduced to the figures benches print."""

    label: str
    run_dir: Path
    curve: list[EvalPoint]
    stats: dict[str, float]
    launch_s: float
    summary: dict[str, Any] = field(default_factory=dict)

    @property
    def final_reward(self) -> float:
        return final_reward(self.curve)


# --- pure helpers -------------------------------------------------------------------------------


def toml_value(value: object) -> str:
    """``value`` written as a TOML literal for ``--set key=value``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    raise TypeError(f"cannot write {type(value).__name__} {value!r} as a --set value; use bool, int, float or str")


def set_args(overrides: Mapping[str, object]) -> list[str]:
    """``["--set", "k=v", ...]`` for ``rlbus run``."""
    out: list[str] = []
    for key, value in overrides.items():
        out += ["--set", f"{key}={toml_value(value)}"]
    return out


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a ``metrics.jsonl`` (a torn last line is skipped)."""
    records = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            log.warning("skipping an unreadable metrics line in %s: %.80s", path, line)
    return records


def eval_curve(metrics: Iterable[Mapping[str, Any]]) -> list[EvalPoint]:
    """Evaluations in version order, each placed at the time its version existed.

    A version's time is the ``elapsed_s`` of the step line whose ``trainer/version``
    equals it; version 0 is at 0 s. Where no step line names the version (it
    should not happen), the time the evaluation was reported is used instead.
    """
    records = list(metrics)
    made_at: dict[int, float] = {0: 0.0}
    for r in records:
        if "trainer/version" in r:
            made_at[int(r["trainer/version"])] = float(r["elapsed_s"])
    points: dict[int, EvalPoint] = {}
    for r in records:
        if "eval/reward" not in r:
            continue
        version = int(r.get("eval/version", r["step"]))
        reported = float(r["elapsed_s"])
        points[version] = EvalPoint(version=version, step=int(r["step"]), reward=float(r["eval/reward"]),
                                    t=made_at.get(version, reported), reported_s=reported)
    return [points[v] for v in sorted(points)]


def time_to_reward(curve: Sequence[EvalPoint], target: float) -> float | None:
    """Seconds until the first evaluation at or above ``target``; None if none gets there."""
    for p in curve:
        if p.reward >= target - EPS:
            return p.t
    return None


def step_to_reward(curve: Sequence[EvalPoint], target: float) -> int | None:
    """Trainer steps until the first evaluation at or above ``target``; None if none gets there."""
    for p in curve:
        if p.reward >= target - EPS:
            return p.step
    return None


def reward_at(curve: Sequence[EvalPoint], t: float) -> float | None:
    """The newest evaluated reward of a version that existed by time ``t``; None before the first."""
    best: EvalPoint | None = None
    for p in curve:
        if p.t <= t + EPS and (best is None or p.t >= best.t):
            best = p
    return None if best is None else best.reward


def final_reward(curve: Sequence[EvalPoint]) -> float:
    """The last evaluation's reward.

    Raises:
        BenchRunError: the curve is empty.
    """
    if not curve:
        raise BenchRunError("the run has no evaluation; check its metrics.jsonl and logs/")
    return curve[-1].reward


def smooth_curve(curve: Sequence[EvalPoint], window: int) -> list[EvalPoint]:
    """Each reward replaced by the mean of it and up to ``window - 1`` evaluations before it.

    Evaluations on a few hundred prompts are noisy (about +-3.5 points at 200 prompts
    and a 40 % reward); a trailing mean makes "first reached" less a matter of luck.
    Both sides of a comparison evaluate at the same steps, so the lag is the same in steps.
    """
    if window < 1:
        raise ValueError(f"smoothing window must be >= 1, got {window}")
    out = []
    for i, p in enumerate(curve):
        recent = curve[max(0, i - window + 1) : i + 1]
        out.append(EvalPoint(version=p.version, step=p.step, reward=sum(q.reward for q in recent) / len(recent),
                             t=p.t, reported_s=p.reported_s))
    return out


def default_target(*curves: Sequence[EvalPoint]) -> float:
    """The lowest of the runs' final rewards: a level every run reached at least once."""
    return min(final_reward(c) for c in curves)


def compare(curves: Mapping[str, Sequence[EvalPoint]], target: float) -> dict[str, Any]:
    """Time (and steps) each run took to ``target`` and, where one never got there,
    the reward each had at the shortest common time.

    Returns a dict with ``<name>_s`` and ``<name>_steps`` per run (None when not reached),
    and when any is None, ``equal_time_s`` with ``<name>_reward_at_equal_time`` per run.
    """
    out: dict[str, Any] = {"target": round(target, 4)}
    # a target every run met at its first evaluation says nothing about speed
    out["target_trivial"] = all(c and c[0].reward >= target - EPS for c in curves.values())
    missed = False
    for name, curve in curves.items():
        t = time_to_reward(curve, target)
        out[f"{name}_s"] = None if t is None else round(t, 2)
        out[f"{name}_steps"] = step_to_reward(curve, target)
        missed |= t is None
    if missed:
        horizon = min(c[-1].t for c in curves.values() if c)
        out["equal_time_s"] = round(horizon, 2)
        for name, curve in curves.items():
            r = reward_at(curve, horizon)
            out[f"{name}_reward_at_equal_time"] = None if r is None else round(r, 4)
    return out


def ratio(slow_s: float | None, fast_s: float | None) -> float | None:
    """``slow_s / fast_s``, or None when either is missing; a zero ``fast_s`` (both at 0) is 1."""
    if slow_s is None or fast_s is None:
        return None
    if fast_s <= 0:
        return 1.0 if slow_s <= 0 else None
    return round(slow_s / fast_s, 3)


def run_stats(metrics: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """Loop figures of a run: steps, mean seconds per step, staleness, drops, in-flight peak."""
    steps = [r for r in metrics if "trainer/version" in r]
    if not steps:
        return {"steps": 0}
    last = steps[-1]
    times = [float(r["elapsed_s"]) for r in steps]
    per_step = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else times[0]

    def mean(key: str) -> float:
        vals = [float(r[key]) for r in steps if key in r]
        return round(sum(vals) / len(vals), 4) if vals else float("nan")

    return {
        "steps": len(steps),
        "last_step_s": round(times[-1], 2),
        "s_per_step": round(per_step, 3),
        "learner_step_s": mean("time/step_s"),
        "publish_s": mean("time/publish_s"),
        "staleness_mean": mean("trainer/staleness_mean"),
        "staleness_max": max(float(r.get("trainer/staleness_max", 0)) for r in steps),
        "dropped": float(last.get("trainer/dropped_total", 0)),
        "trained": float(last.get("trainer/trained_total", 0)),
        "in_flight_peak": float(last.get("trainer/in_flight_peak", 0)),
    }


def curve_json(curve: Sequence[EvalPoint]) -> list[list[float]]:
    """``[[step, seconds, reward], ...]`` for a compact JSON record of a curve."""
    return [[p.step, round(p.t, 1), round(p.reward, 4)] for p in curve]


# --- running ------------------------------------------------------------------------------------


def rlbus_bin() -> list[str]:
    """The command that runs the rlbus CLI with this interpreter."""
    exe = Path(sys.executable).with_name("rlbus")
    return [str(exe)] if exe.is_file() else [sys.executable, "-m", "services.launcher.cli"]


def run_rlbus(label: str, run_dir: Path, overrides: Mapping[str, object], *, example: Path = EXAMPLE,
              timeout_s: float = 1800.0, env: Mapping[str, str] | None = None) -> RunResult:
    """Run ``rlbus run example`` to completion in ``run_dir`` (wiped first) and read its metrics.

    ``overrides`` are config keys (``services.trainer.total_steps``...) set with ``--set``;
    ``run.dir`` and ``run.id`` are set here; ``env`` adds environment variables (the services
    inherit them). The CLI's output goes to ``<run_dir>.log``.

    Raises:
        BenchRunError: the run failed, timed out or left no evaluation.
    """
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    run_id = "".join(c if c.isalnum() or c in "-_" else "-" for c in f"bench-{label}-{os.getpid()}")
    keys = {"run.dir": str(run_dir), "run.id": run_id, **overrides}
    argv = [*rlbus_bin(), "run", str(example), *set_args(keys)]
    log_path = run_dir.with_name(run_dir.name + ".log")
    log.info("%s: %s", label, " ".join(argv))
    t0 = time.monotonic()
    with open(log_path, "w") as out:
        try:
            rc = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, timeout=timeout_s,
                                env={**os.environ, **(env or {})}).returncode
        except subprocess.TimeoutExpired as e:
            raise BenchRunError(f"{label}: rlbus run did not finish within {timeout_s:.0f}s; see {log_path}") from e
    launch_s = time.monotonic() - t0
    if rc != 0 or not (run_dir / "metrics.jsonl").is_file():
        raise BenchRunError(f"{label}: rlbus run exited with {rc}; see {log_path} and {run_dir / 'logs'}")
    return read_run(label, run_dir, launch_s)


def read_run(label: str, run_dir: Path, launch_s: float = 0.0) -> RunResult:
    """The figures of a finished run in ``run_dir`` (one :func:`run_rlbus` just ran, or an earlier one).

    Raises:
        BenchRunError: the run left no metrics or no evaluation.
    """
    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.is_file():
        raise BenchRunError(f"{label}: no {metrics_path}")
    metrics = read_metrics(metrics_path)
    curve = eval_curve(metrics)
    if not curve:
        raise BenchRunError(f"{label}: no evaluation in {metrics_path}; see {run_dir.with_name(run_dir.name + '.log')}")
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    result = RunResult(label=label, run_dir=run_dir, curve=curve, stats=run_stats(metrics), launch_s=launch_s,
                       summary=summary)
    log.info("%s: %d steps in %.1fs (%.1fs with start and stop), eval %s", label, result.stats.get("steps", 0),
             result.stats.get("last_step_s", 0.0), launch_s, curve_json(curve))
    return result
