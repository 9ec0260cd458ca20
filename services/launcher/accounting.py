"""The accounting identity of a run, read from its streams.

Every trajectory ever published (stream TRAJECTORIES) was trained on, dropped
with a recorded reason, used for evaluation (stream OUTCOMES has one outcome per
trajectory), or is still pending on the trainer's durable consumer. Nothing else.
"""

from __future__ import annotations

from typing import Any

import nats
from nats.js import api

from proto import catalog, codec
from proto.accounting import TrajectoryOutcome
from proto.trajectories import ScoredTrajectory


async def read_all(js: Any, stream: str, subject: str, typ: Any, idle_s: float = 2.0) -> list[Any]:
    """Every stored message of ``subject`` in ``stream``, decoded (ordered consumer from the start)."""
    info = await js.stream_info(stream)
    if info.state.messages == 0:
        return []
    out = []
    sub = await js.subscribe(subject, stream=stream, ordered_consumer=True,
                             config=api.ConsumerConfig(deliver_policy=api.DeliverPolicy.ALL))
    try:
        while True:
            try:
                m = await sub.next_msg(timeout=idle_s)
            except nats.errors.TimeoutError:
                break
            out.append(codec.decode(m.data, typ, max_bytes=None))
            if m.metadata.num_pending == 0:
                break
    finally:
        await sub.unsubscribe()
    return out


async def read_channel(js: Any, channel: catalog.Channel, run_id: str) -> list[Any]:
    """Every stored message of one run's ``channel`` (a stream channel), decoded as its type."""
    if channel.stream is None:
        raise ValueError(f"channel {channel.name} is not stored in a stream")
    return await read_all(js, channel.stream.name, channel.wildcard(run_id), channel.msg_type)


async def accounting(js: Any, run_id: str) -> dict[str, Any]:
    trajectories: list[ScoredTrajectory] = await read_channel(js, catalog.TRAJECTORIES, run_id)
    outcomes: list[TrajectoryOutcome] = await read_channel(js, catalog.OUTCOMES, run_id)
    by_id: dict[str, list[TrajectoryOutcome]] = {}
    for o in outcomes:
        by_id.setdefault(o.trajectory_id, []).append(o)
    published = {t.msg_id for t in trajectories}
    try:
        cdef = catalog.TRAINER_TRAJECTORIES.for_run(run_id)
        ci = await js.consumer_info(cdef.stream, cdef.durable)
        held = ci.num_ack_pending + ci.num_pending
    except Exception:
        held = 0
    counts = {k: sum(1 for o in outcomes if o.outcome == k) for k in ("trained", "dropped", "eval")}
    no_outcome = published - set(by_id)
    return {
        "published": len(trajectories),
        "unique_published": len(published),
        **counts,
        "pending": len(no_outcome),
        "held_by_trainer_consumer": held,
        "outcomes_without_trajectory": len(set(by_id) - published),
        "multiple_outcomes": sum(1 for v in by_id.values() if len(v) > 1),
        "dropped_reasons": sorted({o.reason.split(":")[0] for o in outcomes if o.outcome == "dropped"}),
        # the identity: nothing vanished
        "lost": len(no_outcome) - held if len(no_outcome) > held else 0,
    }
