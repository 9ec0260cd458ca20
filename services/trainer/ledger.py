"""The trainer's bookkeeping, written in one place: :class:`Ledger` owns the run's
:class:`~services.trainer.state.TrainerState` and is its only writer.

The collector admits groups and releases their slots through it, the outcomes count through it, the
evaluation rounds record their rewards through it, and the training loop moves its step and version
through it; every other part reads ``ledger.state``. It saves the state to KV (``save``) and hands the
checkpoint its copy (``for_checkpoint``); the prompt groups in flight are its :class:`Admission`.

**Exactly one outcome per trajectory: the rule.** An outcome is written once, by the step (or the drop) that
owns it, and the trainer never rolls its bookkeeping back past a published version:

1. *Owed before written.* A drop, an evaluation or a committed step first puts its outcomes in the state
   (``owed``, one batch each with a fixed message id), saves the state, then publishes them and only then
   acks the trajectories. A crash after the save publishes them again on restart under the same ids
   (OUTCOMES de-duplicates within its window), never decides them anew.
2. *A step's bookkeeping is staged with its version* (``pending``: its groups and outcomes), saved before the
   version is sent. On restart the weight store decides: if it holds that version the step happened and is
   committed (rolled forward); if not, the step never happened and is discarded (its trajectories were not
   acked: they come back and are trained once, by a later step). So a crash between publishing version v and
   saving step v's commit continues from version v, with its outcomes, instead of an older checkpoint.
3. *Only groups in flight are trained.* A sample is accepted only for a group admitted and not yet finished
   (``in_flight``); a redelivered copy of a sample that has its outcome (``finished``, or in a step whose
   version is being sent) is settled without a second one; a sample of a group never admitted, or a first
   delivery of one already finished (a forged or replayed message), is dead-lettered
   (:func:`group_status`, used by the collector).

The alternative, rolling back to a checkpoint and retracting the rolled-back steps' outcomes, would need
OUTCOMES to take records back (a stream does not) and engines to forget versions they generated with; so only
the weights ever fall back (a transport that keeps no versions: broadcast, inproc), under a new version
number, while step numbers, the data position and every outcome stay where the saved state had them.
"""

from __future__ import annotations

from typing import Any

from proto.accounting import TrajectoryOutcome
from services.trainer.admission import Admission
from services.trainer.state import PendingStep, TrainerState, save_to_kv, to_checkpoint

#: finished groups remembered at least (their outcomed sample indices): a redelivery comes within ack_wait
FINISHED_KEPT = 256


def group_index(group_id: str) -> int | None:
    """The data position of a training group id (``g00000042`` -> 42); None for any other id."""
    if len(group_id) == 9 and group_id[0] == "g" and group_id[1:].isdigit():
        return int(group_id[1:])
    return None


def group_status(state: TrainerState, in_flight: dict[str, int], group_id: str, index: int) -> str:
    """What a training sample's group is to the trainer: ``in_flight`` (admitted, not finished: accept),
    ``outcome`` (its group finished and this sample has its outcome), ``finished`` (its group finished, this
    sample without an outcome: a late sample), ``forgotten`` (finished before the groups remembered) or
    ``never`` (never admitted)."""
    if group_id in in_flight:
        return "in_flight"
    done = state.finished.get(group_id)
    if done is not None:
        return "outcome" if index in done else "finished"
    pos = group_index(group_id)
    if pos is None or pos >= state.data_position:
        return "never"
    return "forgotten"


def resolve_pending(state: TrainerState, published: bool) -> None:
    """On restart: commit the staged step (``published``: its version is kept) or discard it (rule 2)."""
    p = state.pending
    if p is None:
        return
    state.pending = None
    if published:
        _commit(state, p)
    else:  # the step never happened: its groups stay in flight, its trajectories come back
        state.step, state.version = p.step - 1, p.version - 1


def _commit(state: TrainerState, p: PendingStep) -> None:
    for gid in p.groups:
        state.in_flight.pop(gid, None)
    _owe(state, p.outcomes, p.groups)


def _owe(state: TrainerState, outcomes: list[TrajectoryOutcome], groups: dict[str, list[int]]) -> None:
    for o in outcomes:
        state.count(o.outcome)
    if outcomes:
        state.owed.append(list(outcomes))
    for gid, idx in groups.items():
        if group_index(gid) is not None:
            state.finished[gid] = sorted(set(state.finished.pop(gid, [])) | set(idx))


class Ledger:
    """One run's :class:`TrainerState`, changed only by these methods, saved to KV by :meth:`save`."""

    def __init__(self, state: TrainerState, kv: Any, run_id: str, max_in_flight: int) -> None:
        self._state = state
        self.kv = kv
        self.run_id = run_id
        #: the prompt groups in flight (the state's ``in_flight``) and the bound on them
        self.admission = Admission(max_in_flight)
        self.admission.restore(state.in_flight)

    @property
    def state(self) -> TrainerState:
        """The state, to read (every change goes through a method of the ledger)."""
        return self._state

    # --- admission --------------------------------------------------------------------------------

    def admit_next(self) -> str:
        """Admit the next training prompt group (there must be room): its id, from the prompt stream's
        position, which moves on by one."""
        group_id = f"g{self._state.data_position:08d}"
        self.admission.admit(group_id, self._state.version)
        self._state.data_position += 1
        return group_id

    def release(self, group_id: str) -> None:
        """The group was trained on or dropped: its slot is free."""
        self.admission.finish(group_id)

    def abandon(self, group_id: str) -> None:
        """The group ends here (stale, timed out, every rollout failed, its ticket not publishable): its slot
        is free and it is finished, so a sample of it that comes later is dropped, never trained."""
        self.admission.finish(group_id)
        self._owe([], {group_id: []})

    # --- counters, steps, evaluations -------------------------------------------------------------

    def count(self, outcome: str, n: int = 1) -> None:
        self._state.count(outcome, n)

    def advance(self) -> None:
        """One optimiser step taken: the next step, and the version its weights go out as."""
        self._state.step += 1
        self._state.version += 1

    def stage(self, groups: dict[str, list[int]], outcomes: list[TrajectoryOutcome]) -> None:
        """The step just taken (:meth:`advance`) is being sent: its groups and outcomes wait in ``pending``
        (saved with the state) until :meth:`commit_pending`, or a restart decides (:func:`resolve_pending`)."""
        self._state.pending = PendingStep(step=self._state.step, version=self._state.version, groups=groups,
                                          outcomes=outcomes)

    def commit_pending(self) -> list[TrajectoryOutcome]:
        """The staged step's version is sent: its groups are released, its outcomes owed (returned)."""
        p = self._state.pending
        if p is None:
            return []
        self._state.pending = None
        for gid in p.groups:
            self.admission.finish(gid)
        self._owe(p.outcomes, p.groups)
        return p.outcomes

    def owe(self, outcomes: list[TrajectoryOutcome], groups: dict[str, list[int]]) -> None:
        """Outcomes decided now (drops, evaluations): counted and owed; ``groups``: the training groups they
        finish, by the indices of their samples that now have an outcome."""
        self._owe(outcomes, groups)

    def _owe(self, outcomes: list[TrajectoryOutcome], groups: dict[str, list[int]]) -> None:
        _owe(self._state, outcomes, groups)
        keep = max(FINISHED_KEPT, 4 * self.admission.max_in_flight)
        finished = self._state.finished
        while len(finished) > keep:
            del finished[next(iter(finished))]

    def written(self, batch: list[TrajectoryOutcome]) -> None:
        """An owed batch is on OUTCOMES."""
        self._state.owed = [b for b in self._state.owed if b is not batch]

    def status(self, group_id: str, index: int) -> str:
        """:func:`group_status` of a training sample now."""
        return group_status(self._state, self.admission.in_flight, group_id, index)

    def record_eval(self, version: int, reward: float) -> None:
        self._state.eval_history.append((version, reward))

    def evaluated(self, version: int) -> bool:
        return any(v == version for v, _ in self._state.eval_history)

    def finish(self, final_model: str) -> None:
        self._state.state, self._state.final_model = "finished", final_model

    def figures(self) -> dict[str, float]:
        """The bookkeeping's figures of a step's metrics."""
        st, adm = self._state, self.admission
        return {"trainer/version": float(st.version), "trainer/trained_total": float(st.counters.get("trained", 0)),
                "trainer/dropped_total": float(st.counters.get("dropped", 0)),
                "trainer/in_flight_groups": float(len(adm.in_flight)), "trainer/in_flight_peak": float(adm.peak),
                "trainer/admission_bound": float(adm.max_in_flight)}

    # --- persistence ------------------------------------------------------------------------------

    def _sync(self) -> None:
        self._state.in_flight = self.admission.state()

    async def save(self) -> None:
        """Write the state to KV (``<run>.state`` of ``rlbus_runs``): what a restarted trainer continues from."""
        self._sync()
        await save_to_kv(self.kv, self.run_id, self._state)

    def for_checkpoint(self) -> dict[str, Any]:
        """The state as a checkpoint's ``trainer_state.json`` holds it."""
        self._sync()
        return to_checkpoint(self._state)
