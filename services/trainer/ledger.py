"""The trainer's bookkeeping, written in one place: :class:`Ledger` owns the run's
:class:`~services.trainer.state.TrainerState` and is its only writer.

The collector admits groups and releases their slots through it, the outcomes count through it, the
evaluation rounds record their rewards through it, and the training loop moves its step and version
through it; every other part reads ``ledger.state``. It saves the state to KV (``save``) and hands the
checkpoint its copy (``for_checkpoint``); the prompt groups in flight are its :class:`Admission`.
"""

from __future__ import annotations

from typing import Any

from services.trainer.admission import Admission
from services.trainer.state import TrainerState, save_to_kv, to_checkpoint


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

    # --- counters, steps, evaluations -------------------------------------------------------------

    def count(self, outcome: str, n: int = 1) -> None:
        self._state.count(outcome, n)

    def advance(self) -> None:
        """One optimiser step taken: the next step, and the version its weights go out as."""
        self._state.step += 1
        self._state.version += 1

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
