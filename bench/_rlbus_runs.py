"""Shared helpers of the RL benchmarks: launch ``rlbus run`` and read its metrics.

The pure part (eval curves, time to a target reward, reward at a given time) is
unit-tested in ``tests/bench/test_bench_helpers.py``; :func:`run_rlbus` is the
only function that starts processes.

Clock. Every time here is seconds since the trainer finished loading (the
``elapsed_s`` of ``metrics.jsonl``). An evaluation of weight version ``v`` is
placed at the moment version ``v`` existed: the ``elapsed_s`` of the trainer
step that produced it (0 for version 0). Evaluated in the loop
(:func:`eval_curve`), the latency of an evaluation does not count as time to a
reward, but its load does: the rollout engine generates it beside training on
the same machine, which slows the steps. Evaluated offline
(:class:`VersionKeeper` keeps the checkpointed versions, :func:`offline_curve`
places their rewards the same way), evaluating costs the run nothing; writing
the checkpoints does (:func:`checkpoint_cost`). The competitor bench takes its
evaluation time off its clock.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Callable, Iterable, Mapping, Sequence
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
    #: where the profiled service's time went (``bench/_profile.py``); empty when not profiled
    profile: dict[str, Any] = field(default_factory=dict)
    #: seconds each kept checkpoint took to write, by step (``keep_versions``); empty otherwise
    checkpoint_write_s: dict[int, float] = field(default_factory=dict)

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


def parse_set_item(item: str, key_of: Callable[[str], str] = str.strip) -> tuple[str, object]:
    """A bench's ``--set KEY=VALUE``: ``(key_of(KEY), value)``, the value a TOML literal, else the text itself
    (``lr=2e-5``: a float, ``type=vllm``: the string). ``key_of`` maps what was typed to the full config key.

    Raises:
        ValueError: no ``=`` or no key (and whatever ``key_of`` raises).
    """
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ValueError(f"expected KEY=VALUE, got {item!r}")
    key = key_of(key)
    try:
        return key, tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return key, text


def set_args(overrides: Mapping[str, object]) -> list[str]:
    """``["--set", "k=v", ...]`` for ``rlbus run``."""
    out: list[str] = []
    for key, value in overrides.items():
        out += ["--set", f"{key}={toml_value(value)}"]
    return out


def example_run_file(example: Path = EXAMPLE, overrides: Sequence[str] = ()) -> Any:
    """``example`` as the launcher reads it: a :class:`~services.launcher.runfile.RunFile`, every default
    filled in, ``key=value`` ``overrides`` on top (no ``RLBUS__`` variables: the bench's settings are the
    file's). Raises ``ConfigError`` naming the key when it does not load."""
    from services.launcher.runfile import RunFile

    return RunFile.load(example, env={}, overrides=overrides)


def resolved_run_file(run_dir: Path) -> Any | None:
    """The run file a finished run ran with (its ``config.resolved.json``: every key, defaults included),
    or None when the directory has none or it does not load in this rlbus (written by an older one)."""
    from services.launcher.runfile import RunFile
    from services.runtime.config import ConfigError

    path = run_dir / "config.resolved.json"
    if not path.is_file():
        return None
    try:
        return RunFile.from_tree(json.loads(path.read_text()))
    except (ConfigError, ValueError) as e:
        log.warning("%s does not load in this rlbus: %s", path, e)
        return None


def example_model_dir(runfile: Any, seed: int, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The local directory of the run file's ``[model]`` for ``seed`` (builtin models are built and cached on
    first use), in ``cache_dir`` when given, else the file's ``[model] cache_dir``, else rlbus's cache."""
    from services.tasks.models import resolve_model

    model = runfile.model
    cache = str(cache_dir) if cache_dir else (model.cache_dir or None)
    return resolve_model(model.name, cache, seed=seed, revision=model.revision or None)


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


# --- offline evaluation: kept weight versions ---------------------------------------------------

#: where :class:`VersionKeeper` keeps a run's checkpointed models (inside the run directory)
KEPT_DIR = "bench_versions"


def checkpoint_step(path: Path) -> int | None:
    """The step of a checkpoint directory named ``step-<N>`` (None for anything else: ``.tmp-*``, ``latest``)."""
    name = path.name
    if not name.startswith("step-") or not name[5:].isdigit():
        return None
    return int(name[5:])


def kept_versions(kept: Path) -> dict[int, Path]:
    """``{step: model directory}`` of the versions a :class:`VersionKeeper` kept under ``kept``, step order."""
    if not kept.is_dir():
        return {}
    found = {checkpoint_step(p): p for p in kept.iterdir() if p.is_dir() and (p / "config.json").is_file()}
    return {s: found[s] for s in sorted(s for s in found if s is not None)}


def offline_curve(metrics: Iterable[Mapping[str, Any]], rewards: Mapping[int, float]) -> list[EvalPoint]:
    """The eval curve of versions evaluated after the run (``rewards``: ``{trainer step: reward}``, step 0
    the initial model), each placed, as :func:`eval_curve` places in-loop evaluations, at the trainer
    clock time of the step that produced it (the ``elapsed_s`` of that step's line; step 0 at 0 s). An
    offline evaluation costs the run nothing, so it counts as reported the moment its version existed.

    Raises:
        BenchRunError: a step has no step line in the metrics (not a version this run made).
    """
    made: dict[int, tuple[int, float]] = {0: (0, 0.0)}
    for r in metrics:
        if "trainer/version" in r:
            made[int(r["step"])] = (int(r["trainer/version"]), float(r["elapsed_s"]))
    points = []
    for step in sorted(rewards):
        if step not in made:
            raise BenchRunError(f"kept version of step {step} has no step line in the run's metrics")
        version, t = made[step]
        points.append(EvalPoint(version=version, step=step, reward=float(rewards[step]), t=t, reported_s=t))
    return points


def checkpoint_cost(metrics: Iterable[Mapping[str, Any]], every: int) -> dict[str, float]:
    """What checkpointing every ``every`` steps cost a run's clock, from its step lines: the mean gap
    before a step that follows a checkpoint (the trainer writes it between the two steps) less the mean
    gap before the other steps (the first step, which fills the pipeline, left out), times the number
    of checkpoints written inside the run (the one written after the last step is off the clock)."""
    steps = [(int(r["step"]), float(r["elapsed_s"])) for r in metrics if "trainer/version" in r]
    after, other = [], []
    for (prev_step, prev_t), (_step, t) in zip(steps, steps[1:], strict=False):
        (after if every and prev_step % every == 0 else other).append(t - prev_t)
    if not after or not other:
        return {}
    extra = sum(after) / len(after) - sum(other) / len(other)
    return {"checkpoint_extra_s_per_write": round(extra, 3), "checkpoint_writes_on_clock": len(after),
            "checkpoint_cost_s": round(extra * len(after), 2)}


#: the kept versions' write times, ``{step: seconds}``, beside them (:class:`VersionKeeper`)
WRITE_TIMES = "write_s.json"


def read_write_times(run_dir: Path) -> dict[int, float]:
    """The write times :class:`VersionKeeper` recorded for ``run_dir``'s kept versions (empty if none)."""
    path = run_dir / KEPT_DIR / WRITE_TIMES
    if not path.is_file():
        return {}
    return {int(k): float(v) for k, v in json.loads(path.read_text()).items()}


class VersionKeeper:
    """Keeps every checkpoint a running trainer writes under ``<run_dir>/checkpoints/`` (which keeps only
    the two newest) as a loadable model directory ``<run_dir>/bench_versions/step-<N>/``: a thread polls
    the checkpoints and hard-links each new one's top-level files (the Hugging Face model directory,
    ``services.lib.model_io.load_policy`` reads it; ``dcp/``, the optimiser shards, is left out). A
    checkpoint is renamed into place whole, so a ``step-<N>`` seen is complete. Records each write's
    duration (newest minus oldest file time, ``dcp/`` included) in ``write_s``."""

    def __init__(self, run_dir: Path, poll_s: float = 0.2) -> None:
        self.src = run_dir / "checkpoints"
        self.dst = run_dir / KEPT_DIR
        self.poll_s = poll_s
        self.write_s: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-version-keeper", daemon=True)

    def __enter__(self) -> VersionKeeper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sweep()  # what the last poll missed (the final checkpoint)
        if self.dst.is_dir():  # for a later evaluation from the run directory alone (read_write_times)
            (self.dst / WRITE_TIMES).write_text(json.dumps({str(k): v for k, v in sorted(self.write_s.items())}))

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.sweep()
            except OSError as e:  # a checkpoint pruned while being linked: the next poll goes on
                log.debug("version keeper: %s", e)

    def sweep(self) -> None:
        if not self.src.is_dir():
            return
        for ckpt in sorted(self.src.iterdir()):
            step = checkpoint_step(ckpt)
            if step is None or not ckpt.is_dir() or (self.dst / ckpt.name / "config.json").is_file():
                continue
            with contextlib.suppress(FileNotFoundError):  # pruned meanwhile: a poll too slow, reported later
                self._keep(step, ckpt)

    def _keep(self, step: int, ckpt: Path) -> None:
        times = [p.stat().st_mtime for p in ckpt.rglob("*") if p.is_file()]
        tmp = self.dst / f".tmp-{ckpt.name}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for f in ckpt.iterdir():
            if f.is_file():
                try:
                    os.link(f, tmp / f.name)
                except OSError:
                    shutil.copy2(f, tmp / f.name)
        shutil.rmtree(self.dst / ckpt.name, ignore_errors=True)
        os.replace(tmp, self.dst / ckpt.name)
        if times:
            self.write_s[step] = max(times) - min(times)


# --- running ------------------------------------------------------------------------------------


def rlbus_bin() -> list[str]:
    """The command that runs the rlbus CLI with this interpreter."""
    exe = Path(sys.executable).with_name("rlbus")
    return [str(exe)] if exe.is_file() else [sys.executable, "-m", "services.launcher.cli"]


def run_rlbus(label: str, run_dir: Path, overrides: Mapping[str, object], *, example: Path = EXAMPLE,
              timeout_s: float = 1800.0, env: Mapping[str, str] | None = None,
              profile: str | None = None, keep_versions: bool = False) -> RunResult:
    """Run ``rlbus run example`` to completion in ``run_dir`` (wiped first) and read its metrics.

    ``overrides`` are config keys (``services.trainer.total_steps``...) set with ``--set``;
    ``run.dir`` and ``run.id`` are set here; ``env`` adds environment variables (the services
    inherit them). The CLI's output goes to ``<run_dir>.log``. ``profile`` names a service
    (``trainer``) to record with py-spy from its start to its exit (``<run_dir>.<service>.pyspy``);
    the result's ``profile`` says where its time went. ``keep_versions``: every checkpoint the trainer
    writes is kept as a model directory under ``<run_dir>/bench_versions/`` (:class:`VersionKeeper`; set
    ``services.trainer.checkpoint_every`` for which), their write times in the result's ``checkpoint_write_s``.

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
    profiler = None
    keeper = VersionKeeper(run_dir) if keep_versions else None
    with open(log_path, "w") as out, contextlib.ExitStack() as stack:
        if keeper is not None:
            stack.enter_context(keeper)
        if profile:
            from bench._profile import ServiceProfile

            profiler = stack.enter_context(ServiceProfile(run_dir, profile, run_dir.with_name(
                f"{run_dir.name}.{profile}.pyspy")))
        try:
            rc = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, timeout=timeout_s,
                                env={**os.environ, **(env or {})}).returncode
        except subprocess.TimeoutExpired as e:
            raise BenchRunError(f"{label}: rlbus run did not finish within {timeout_s:.0f}s; see {log_path}") from e
    launch_s = time.monotonic() - t0
    if rc != 0 or not (run_dir / "metrics.jsonl").is_file():
        raise BenchRunError(f"{label}: rlbus run exited with {rc}; see {log_path} and {run_dir / 'logs'}")
    result = read_run(label, run_dir, launch_s)
    if keeper is not None:
        result.checkpoint_write_s = dict(keeper.write_s)
    if profiler is not None:
        result.profile = profiler.summary()
        log.info("%s: %s profile %s", label, profile, json.dumps(result.profile))
    return result


#: what a finished run leaves that no bench figure reads and that fills a disk: the trainer's checkpoints
#: (model and optimiser state, ~2 GB each for SmolLM2), the JetStream store (weight versions) and the final model
HEAVY_RUN_FILES = ("checkpoints", "nats", "final_model")


def prune_run_files(run_dir: Path) -> int:
    """Remove :data:`HEAVY_RUN_FILES` from a finished run's directory; return the bytes freed. Metrics, traces,
    logs, the resolved config and the versions a :class:`VersionKeeper` kept (hard links of their own, so a
    checkpoint's removal leaves them whole) stay, so the run can still be read and evaluated."""
    freed = 0
    for name in HEAVY_RUN_FILES:
        path = run_dir / name
        if not path.exists():
            continue
        seen: set[tuple[int, int]] = set()
        for f in [path, *path.rglob("*")] if path.is_dir() else [path]:
            st = f.lstat()
            if f.is_file() and st.st_nlink == 1 and (st.st_dev, st.st_ino) not in seen:  # a kept version's link stays
                seen.add((st.st_dev, st.st_ino))
                freed += st.st_size
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    log.info("%s: removed %s (%.1f GB)", run_dir.name, ", ".join(HEAVY_RUN_FILES), freed / 1e9)
    return freed


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
