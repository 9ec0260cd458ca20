"""The accounting identity when the trainer refused a message: a trajectory has one verdict.

A message the trainer trained and then refused on a later delivery (the bus lost its ack and delivery count, as
a nats-server killed mid-run can: the trainer takes the redelivery for a copy) is counted once, by its outcome;
a *different* message copying trajectories that already have their outcome (replayed or forged) is counted as
dead-lettered. Real nats-server; the messages are written as the trainer and the judge write them.
"""

from __future__ import annotations

import nats

from proto import catalog
from proto.accounting import OutcomeBatch, TrajectoryOutcome
from proto.deadletter import DeadLetter
from proto.trajectories import ScoredGroup
from services.launcher.accounting import accounting
from services.runtime import bus
from tests.distributed.rank_script import batch

RUN = "refused"


def _group(prefix: str):
    out = batch(3, groups=1, group_size=2)
    for i, t in enumerate(out):
        t.run_id = t.rollout.run_id = RUN
        t.msg_id = f"{prefix}-{i}"
    return out


async def _store(js, trajectories, msg_id: str = "") -> int:
    group = ScoredGroup.of(trajectories)
    group.msg_id = msg_id or group.msg_id  # another id: a new message, not a retry JetStream would drop
    ack = await bus.publish(js, catalog.TRAJECTORIES.subject(RUN), group)
    return ack.seq


async def _trained(js, trajectories) -> None:
    await bus.publish(js, catalog.OUTCOMES.subject(RUN), OutcomeBatch(run_id=RUN, outcomes=[TrajectoryOutcome(
        run_id=RUN, trajectory_id=t.msg_id, group_id=t.rollout.group_id, outcome="trained", step=1, version=0,
        sample_version=0, batch_index=i) for i, t in enumerate(trajectories)]))


async def _refused(js, seq: int, reason: str) -> None:
    await bus.publish(js, catalog.DEAD_LETTERS.subject(RUN, "trajectories"), DeadLetter(
        run_id=RUN, service="trainer", original_subject=catalog.TRAJECTORIES.subject(RUN), reason=reason,
        error_type="Poison", payload=b"", stream=catalog.TRAJECTORIES.stream.name, stream_seq=seq))


async def test_a_trained_message_refused_later_counts_once_and_a_copy_counts_as_dead_lettered(nats_url):
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    try:
        await bus.provision_all(js)
        trained = _group("a")
        seq = await _store(js, trained)
        await _trained(js, trained)
        await _refused(js, seq, "group already finished: a redelivery whose delivery count the bus lost")

        acc = await accounting(js, RUN)
        assert acc["published"] == acc["trained"] == 2 and acc["dead_lettered"] == 0
        assert acc["refused_after_outcome"] == 2 and acc["identity_holds"] and acc["lost"] == 0

        copy = await _store(js, trained, msg_id="forged-copy")  # a second message carrying the same trajectories: replayed or forged
        await _refused(js, copy, "group already finished: a new message carrying it is never trained")
        acc = await accounting(js, RUN)
        assert acc["published"] == 4 and acc["unique_published"] == 2 and acc["trained"] == 2
        # the copy's trajectories are dead-lettered; the first message's second look is still not counted again
        assert acc["dead_lettered"] == 2 and acc["refused_after_outcome"] == 2 and acc["identity_holds"]
    finally:
        await nc.close()
