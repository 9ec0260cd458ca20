"""The trainer's bookkeeping: one TrainerState, written by its ledger, through KV and checkpoints; evaluation
rounds."""

from __future__ import annotations

import asyncio
import json

import nats

from proto import catalog
from proto.rollouts import Rollout
from proto.trajectories import ScoredTrajectory
from services.runtime import bus
from services.trainer.evaluation import Evaluations
from services.trainer.ledger import Ledger
from services.trainer.state import (
    TrainerState,
    from_checkpoint,
    load_from_kv,
    read_checkpoint_state,
    save_to_kv,
    to_checkpoint,
)


def _state() -> TrainerState:
    return TrainerState(step=7, version=9, data_position=40, in_flight={"g00000039": 8},
                        counters={"trained": 112, "dropped": 3}, eval_history=[(0, 0.25), (5, 0.5)])


async def test_state_round_trips_through_kv(nats_url):
    nc = await nats.connect(nats_url)
    kv = await bus.ensure_kv(nc.jetstream(), catalog.RUNS)
    assert await load_from_kv(kv, "staterun") is None  # nothing saved yet
    await save_to_kv(kv, "staterun", _state())
    back = await load_from_kv(kv, "staterun")
    assert back is not None and back.step == 7 and back.version == 9 and back.in_flight == {"g00000039": 8}
    assert back.eval_history == [(0, 0.25), (5, 0.5)] and back.counters["dropped"] == 3
    await kv.put("staterun.state", b"\xc1garbage")  # unreadable: treated as nothing saved, never a crash
    assert await load_from_kv(kv, "staterun") is None
    await nc.close()


def test_state_round_trips_through_a_checkpoint_file(tmp_path):
    (tmp_path / "trainer_state.json").write_text(json.dumps(to_checkpoint(_state())))
    back = read_checkpoint_state(tmp_path)
    assert back.step == 7 and back.data_position == 40 and back.eval_history == [(0, 0.25), (5, 0.5)]


def test_older_checkpoints_without_a_phase_still_load():
    old = {"step": 3, "version": 3, "data_position": 12, "in_flight": {}, "eval_history": [[0, 0.1]],
           "counters": {"trained": 48}, "run_id": "x"}
    st = from_checkpoint(old)
    assert st.state == "running" and st.step == 3 and st.eval_history == [(0, 0.1)]


def _eval_traj(version: int, group: str, index: int, reward: float) -> ScoredTrajectory:
    r = Rollout(run_id="r", task="addition", group_id=group, prompt_id="p", sample_index=index, group_size=2,
                prompt_ids=[1], turns=[], finish_reason="eos", policy_version=version, is_eval=True)
    return ScoredTrajectory(run_id="r", rollout=r, reward=reward)


async def test_the_ledger_writes_the_state_and_saves_what_is_in_flight(nats_url):
    nc = await nats.connect(nats_url)
    kv = await bus.ensure_kv(nc.jetstream(), catalog.RUNS)
    ledger = Ledger(_state(), kv, "ledgerrun", max_in_flight=3)
    assert ledger.admission.room() == 2  # the saved group in flight is restored into admission
    assert [ledger.admit_next(), ledger.admit_next()] == ["g00000040", "g00000041"]  # from the prompt position
    assert ledger.admission.room() == 0 and ledger.state.data_position == 42
    ledger.release("g00000039")
    ledger.count("trained", 8)
    ledger.advance()
    await ledger.save()
    back = await load_from_kv(kv, "ledgerrun")
    assert back is not None and (back.step, back.version, back.counters["trained"]) == (8, 10, 120)
    assert back.in_flight == {"g00000040": 9, "g00000041": 9}  # admitted at version 9, before the step
    ledger.record_eval(10, 0.75)
    ledger.finish("/final")
    ckpt = from_checkpoint(ledger.for_checkpoint())
    assert ckpt.state == "finished" and ckpt.eval_history[-1] == (10, 0.75) and ckpt.final_model == "/final"
    assert ledger.evaluated(10) and not ledger.evaluated(11)
    await nc.close()


async def test_an_evaluation_round_closes_once_every_sample_is_back():
    ledger = Ledger(TrainerState(), kv=None, run_id="r", max_in_flight=1)  # never saved here
    history = ledger.state.eval_history
    # rounds are opened and fed directly: no tickets go out, no figures are reported
    evals = Evaluations(prompts=["a", "b"], samples=2, ledger=ledger, tickets=None, reporter=None)  # type: ignore[arg-type]
    tickets = evals.open_round(version=3, step=10)
    assert [g for g, _ in tickets] == ["eval-v000003-0000", "eval-v000003-0001"]
    assert evals.open_round(version=3, step=10) == []  # once per version
    assert evals.record(_eval_traj(3, "eval-v000003-0000", 0, 1.0)) is None
    assert evals.record(_eval_traj(3, "eval-v000003-0000", 0, 1.0)) is None  # a redelivery counts once
    assert evals.record(_eval_traj(9, "eval-v000009-0000", 0, 1.0)) is None  # no round for version 9
    evals.record(_eval_traj(3, "eval-v000003-0000", 1, 0.0))
    waiter = asyncio.create_task(evals.wait_all(asyncio.Event()))
    done = evals.record(_eval_traj(3, "eval-v000003-0001", 0, 1.0))
    assert done is None and not waiter.done()
    done = evals.record(_eval_traj(3, "eval-v000003-0001", 1, 0.0))
    assert done is not None and done.mean == 0.5 and history == [(3, 0.5)]
    await asyncio.wait_for(waiter, 5)
    assert evals.open_round(version=3, step=10) == []  # a version already in the history is not evaluated again
