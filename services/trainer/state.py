"""The trainer's durable bookkeeping: one typed :class:`TrainerState`, saved and restored here only.

It lives in two places, written by the same code:

* KV ``rlbus_runs`` key ``<run>.state`` after every step (msgpack) — with the weights of
  ``version`` (kept by a store transport) it is what a restarted trainer continues from,
  and what ``rlbus run`` / ``rlbus status`` watch;
* ``trainer_state.json`` inside each checkpoint (JSON), next to the optimiser moments.

:mod:`services.trainer.resume` decides which of the two a restarted trainer uses. What makes every
trajectory end with exactly one outcome across crashes is kept here too (the rule: :mod:`services.trainer.ledger`):
the step whose weights are being sent (``pending``), the outcomes owed to OUTCOMES (``owed``) and the sample
indices of recently finished groups (``finished``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Literal

import msgspec

from proto import codec
from proto.accounting import TrajectoryOutcome
from services.runtime import tracing

Phase = Literal["running", "finished", "failed"]


class PendingStep(msgspec.Struct, kw_only=True):
    """A step whose weight version was being sent when the state was saved: its bookkeeping, applied when the
    version turns out to be published (the step happened) and discarded when it does not (it never did)."""

    step: int
    version: int
    #: the groups the step trained on or dropped (released when it commits), with their samples' indices
    groups: dict[str, list[int]] = {}
    #: the step's outcomes: its trained batch (in batch order) and its failed rollouts (dropped)
    outcomes: list[TrajectoryOutcome] = []


class TrainerState(msgspec.Struct, kw_only=True):
    """Everything the trainer must not lose besides model and optimiser tensors."""

    state: Phase = "running"
    #: optimiser steps taken
    step: int = 0
    #: weight version of the current weights (published, or about to be)
    version: int = 0
    #: index of the next training prompt (the prompt stream resumes here)
    data_position: int = 0
    #: prompt groups admitted and not yet trained on or dropped: group id -> version at admission
    in_flight: dict[str, int] = {}
    #: trajectories by outcome (trained, dropped, eval, duplicate)
    counters: dict[str, int] = {}
    #: (version, held-out reward) of every finished evaluation round
    eval_history: list[tuple[int, float]] = []
    #: the step whose version is being sent (``step``/``version`` above are already its own); None: none is
    pending: PendingStep | None = None
    #: outcome batches decided and not yet known to be on OUTCOMES (each published under its own fixed id)
    owed: list[list[TrajectoryOutcome]] = []
    #: recently finished training groups -> the indices of their samples that have an outcome (newest last)
    finished: dict[str, list[int]] = {}
    final_model: str = ""
    reason: str = ""
    #: seconds of training when this state was saved: a restarted trainer counts on from here, so
    #: ``[services.trainer] max_wall_s`` bounds the run, not each process of it
    trained_s: float = 0.0
    updated_at: float = msgspec.field(default_factory=time.time)

    def count(self, outcome: str, n: int = 1) -> None:
        self.counters[outcome] = self.counters.get(outcome, 0) + n


def state_key(run_id: str) -> str:
    return f"{run_id}.state"


async def save_to_kv(kv: Any, run_id: str, state: TrainerState) -> None:
    state.updated_at = time.time()
    data = codec.encode(state)
    with tracing.span("save state", bytes=len(data)):  # on a synchronous step's critical path (bench/bus_gaps.py)
        await kv.put(state_key(run_id), data)


async def load_from_kv(kv: Any, run_id: str) -> TrainerState | None:
    """The state the trainer last saved for ``run_id``; None when there is none (or it is unreadable)."""
    try:
        entry = await kv.get(state_key(run_id))
    except Exception:  # nats.js.errors.KeyNotFoundError and friends: nothing saved yet
        return None
    if entry.value is None:
        return None
    try:
        return codec.decode(entry.value, TrainerState, max_bytes=None)
    except codec.DecodeError:
        return None


def to_checkpoint(state: TrainerState) -> dict[str, Any]:
    """What ``Learner.save_checkpoint`` writes as ``trainer_state.json``."""
    return msgspec.to_builtins(state)


def from_checkpoint(data: dict[str, Any]) -> TrainerState:
    """The state a checkpoint's ``trainer_state.json`` holds (unknown keys of older checkpoints ignored)."""
    return msgspec.convert(data, TrainerState, strict=False)


def summary_of(state: TrainerState, wall_s: float, **extra: Any) -> dict[str, Any]:
    """A finished run's ``summary.json``."""
    return {"step": state.step, "version": state.version, "eval_history": state.eval_history,
            "counters": state.counters, "wall_s": wall_s, "final_model": state.final_model, **extra}


def read_checkpoint_state(ckpt: Path) -> TrainerState:
    return from_checkpoint(msgspec.json.decode((ckpt / "trainer_state.json").read_bytes()))
