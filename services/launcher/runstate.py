"""What ``rlbus run`` finds in the run directory before it starts, and what it does about it.

A run directory holds a run's JetStream store, metrics, checkpoints and, once it finished, ``summary.json``.
Starting ``rlbus run`` on it again resumes the run (the trainer continues from its checkpoint and saved
state; every stream is where it was). That is what a run that was stopped or crashed wants, and it is said
at start with the step it resumes from. A *finished* run is never resumed silently (it would train nothing
and print the old results): ``--fresh`` moves the old directory aside (``<dir>.1``, ``<dir>.2``, ...) and
starts over; ``--resume`` extends it, with a ``total_steps`` above the step it finished at.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Mode = Literal["auto", "fresh", "resume"]


class RunDirError(Exception):
    """The run directory's state and the asked mode disagree; the message says what to do."""


@dataclass
class Prior:
    """What an earlier run left in the directory."""

    finished: bool
    step: int
    """The last trainer step recorded (summary, checkpoint or metrics), 0 when none."""
    where: str
    """Where that step was read from."""


def inspect(run_dir: Path) -> Prior | None:
    """The earlier run in ``run_dir``, or None when there is none (no store, no metrics, no summary)."""
    summary = run_dir / "summary.json"
    if summary.is_file():
        try:
            step = int(json.loads(summary.read_text()).get("step", 0))
        except (ValueError, OSError, AttributeError):
            step = 0
        return Prior(True, step, str(summary))
    latest = run_dir / "checkpoints" / "latest"
    if latest.is_file():
        name = latest.read_text().strip()
        digits = "".join(c for c in name if c.isdigit())
        return Prior(False, int(digits) if digits else 0, f"checkpoint {run_dir / 'checkpoints' / name}")
    metrics = run_dir / "metrics.jsonl"
    step = 0
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            try:
                step = max(step, int(json.loads(line).get("step", 0)))
            except (ValueError, AttributeError):
                continue
    if step or (run_dir / "nats").is_dir():
        return Prior(False, step, str(metrics) if step else f"{run_dir / 'nats'} (no step recorded)")
    return None


def aside(run_dir: Path) -> Path:
    """The first free ``<dir>.N`` (N = 1, 2, ...) to move an old run to."""
    n = 1
    while run_dir.with_name(f"{run_dir.name}.{n}").exists():
        n += 1
    return run_dir.with_name(f"{run_dir.name}.{n}")


def prepare(run_dir: Path, run_id: str, mode: Mode, total_steps: int | None) -> str:
    """Apply ``mode`` to ``run_dir`` (moving an old run aside for ``fresh``) and return the line that says
    what this run does (it starts with "extending" when a finished run goes on); :class:`RunDirError` when
    a finished run would be resumed without ``--resume`` or extended to no more steps than it has."""
    prior = inspect(run_dir)
    if prior is not None and mode == "fresh":
        moved = aside(run_dir)
        run_dir.rename(moved)
        return (f"run {run_id}: starting fresh in {run_dir} (the previous run, "
                f"{'finished' if prior.finished else 'stopped'} at step {prior.step}, moved to {moved})")
    if prior is None:
        return f"run {run_id}: starting fresh in {run_dir}"
    if prior.finished:
        if mode != "resume":
            raise RunDirError(
                f"run {run_id} in {run_dir} already finished at step {prior.step} ({prior.where}); running it "
                f"again would train nothing. Start over with --fresh (the old run is moved to {aside(run_dir)}), "
                f"or extend it with --resume --set services.trainer.total_steps=N (N > {prior.step}), or give "
                "another run directory (--set run.dir=...)")
        if total_steps is not None and total_steps <= prior.step:
            raise RunDirError(f"--resume: run {run_id} finished at step {prior.step} and total_steps is "
                              f"{total_steps}: set services.trainer.total_steps above {prior.step} to extend it")
        target = total_steps if total_steps is not None else "total_steps"
        return f"extending run {run_id}, finished at step {prior.step} in {run_dir}, to step {target}"
    return f"run {run_id}: resuming in {run_dir} from step {prior.step} ({prior.where})"
