"""The rule behind "one outcome per trajectory" (services/trainer/ledger.py): outcomes owed before written, a
step's bookkeeping staged with its version and settled by what the weight store kept, only groups in flight
accepted."""

from __future__ import annotations

import nats

from proto import catalog
from proto.accounting import TrajectoryOutcome
from services.runtime import bus
from services.trainer.ledger import Ledger, group_status, resolve_pending
from services.trainer.state import TrainerState, load_from_kv


def _outcome(key: str, group: str, outcome: str = "trained", step: int = 3) -> TrajectoryOutcome:
    return TrajectoryOutcome(run_id="r", trajectory_id=key, group_id=group, outcome=outcome, step=step,  # type: ignore[arg-type]
                             version=step, sample_version=step - 1, msg_id=f"{key}-outcome")


def _staged() -> Ledger:
    """Step 3 staged (version 3 being sent) on groups g0 and g1, g2 still in flight."""
    ledger = Ledger(TrainerState(step=2, version=2), kv=None, run_id="r", max_in_flight=4)
    gids = [ledger.admit_next() for _ in range(3)]
    assert gids == ["g00000000", "g00000001", "g00000002"]
    ledger.advance()
    ledger.stage({"g00000000": [0, 1], "g00000001": [0, 1]},
                 [_outcome(f"r-g00000000-s{i}", "g00000000") for i in range(2)]
                 + [_outcome(f"r-g00000001-s{i}", "g00000001") for i in range(2)])
    return ledger


def test_a_staged_step_whose_version_was_published_is_committed_on_restart():
    saved = msgspec_copy(_staged().for_checkpoint())
    resolve_pending(saved, published=True)
    assert (saved.step, saved.version, saved.pending) == (3, 3, None)
    assert list(saved.in_flight) == ["g00000002"]  # the step's groups released
    assert saved.counters == {"trained": 4} and [len(b) for b in saved.owed] == [4]  # owed once, not decided anew
    assert group_status(saved, saved.in_flight, "g00000000", 1) == "outcome"
    assert group_status(saved, saved.in_flight, "g00000002", 0) == "in_flight"


def test_a_staged_step_whose_version_never_came_out_is_discarded_on_restart():
    saved = msgspec_copy(_staged().for_checkpoint())
    resolve_pending(saved, published=False)
    assert (saved.step, saved.version, saved.pending) == (2, 2, None)  # the step never happened
    assert sorted(saved.in_flight) == ["g00000000", "g00000001", "g00000002"]  # its groups come back to train
    assert saved.counters == {} and saved.owed == [] and saved.finished == {}


def test_committing_owes_the_outcomes_once_and_flushing_writes_them_off():
    ledger = _staged()
    outcomes = ledger.commit_pending()
    assert len(outcomes) == 4 and ledger.state.pending is None and ledger.commit_pending() == []
    assert ledger.admission.room() == 3 and ledger.state.counters["trained"] == 4
    ledger.written(ledger.state.owed[0])
    assert ledger.state.owed == []


def test_only_groups_admitted_and_in_flight_are_accepted():
    ledger = _staged()
    ledger.commit_pending()
    ledger.abandon("g00000002")  # timed out with none of its samples back
    assert ledger.status("g00000002", 0) == "finished"  # a late sample: dropped, never trained
    assert ledger.status("g00000001", 1) == "outcome"  # a copy of one trained: no second outcome
    assert ledger.status("g99999999", 0) == "never"  # never admitted (forged): dead-lettered
    assert ledger.status("g00000003", 0) == "never"  # not admitted yet
    assert ledger.status("../etc", 0) == "never"
    fresh = ledger.admit_next()
    assert ledger.status(fresh, 0) == "in_flight"


def test_finished_groups_are_remembered_within_a_bound():
    ledger = Ledger(TrainerState(), kv=None, run_id="r", max_in_flight=1)
    for _ in range(300):
        ledger.abandon(ledger.admit_next())
    assert len(ledger.state.finished) == 256 and "g00000299" in ledger.state.finished
    assert ledger.status("g00000000", 0) == "forgotten"  # finished long ago: a redelivery is settled silently


async def test_the_staged_step_and_owed_outcomes_round_trip_through_kv(nats_url):
    nc = await nats.connect(nats_url)
    kv = await bus.ensure_kv(nc.jetstream(), catalog.RUNS)
    ledger = _staged()
    ledger.kv, ledger.run_id = kv, "stagedrun"
    await ledger.save()
    back = await load_from_kv(kv, "stagedrun")
    assert back is not None and back.pending is not None and back.pending.version == 3
    assert [o.trajectory_id for o in back.pending.outcomes][:1] == ["r-g00000000-s0"]
    resolve_pending(back, published=True)
    assert back.owed[0][3].trajectory_id == "r-g00000001-s1"
    await nc.close()


def msgspec_copy(data: dict) -> TrainerState:
    from services.trainer.state import from_checkpoint

    return from_checkpoint(data)
