"""The accounting identity of a run, read from its streams.

Every trajectory ever published (stream TRAJECTORIES) was trained on, dropped
with a recorded reason, used for evaluation (stream OUTCOMES has one outcome per
trajectory), or is still pending on the trainer's durable consumer; or its message was refused and
dead-lettered by the trainer (a group it never admitted, a copy of a finished one: DLQ names the message's
stream sequence). Nothing else:

    published = trained + dropped + eval + pending + dead_lettered      (``identity_holds``)

with no trajectory holding more than one outcome (``multiple_outcomes``); a message the trainer trained and later
refused again (a redelivery whose ack the bus lost) counts once, by its outcome (``refused_after_outcome``). Messages carry groups
(``catalog.members``); every figure here counts trajectories.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import nats
from nats.js import api

from proto import catalog, codec
from proto.accounting import TrajectoryOutcome
from proto.deadletter import DeadLetter
from proto.trajectories import ScoredTrajectory

log = logging.getLogger("rlbus.accounting")


@dataclass
class Undecodable:
    """Stored messages a reader skipped because they do not decode as their channel's type (hostile or
    corrupt bytes): how many per stream, and the first few stream sequences with why."""

    counts: dict[str, int] = field(default_factory=dict)
    examples: list[str] = field(default_factory=list)

    def add(self, stream: str, seq: int, error: Exception) -> None:
        self.counts[stream] = self.counts.get(stream, 0) + 1
        if len(self.examples) < 5:
            self.examples.append(f"{stream} #{seq}: {str(error)[:120]}")

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def note(self) -> str:
        """One line for a report ("" when nothing was skipped)."""
        if not self.total:
            return ""
        per = ", ".join(f"{n} in {s}" for s, n in sorted(self.counts.items()))
        return (f"skipped {self.total} undecodable stored message(s) ({per}; e.g. {self.examples[0]}); "
                "`rlbus tap --raw` shows them")


async def read_all(js: Any, stream: str, subject: str, typ: Any, idle_s: float = 2.0,
                   with_seq: bool = False, skipped: Undecodable | None = None) -> list[Any]:
    """Every stored message of ``subject`` in ``stream``, decoded (ordered consumer from the start);
    ``with_seq``: as ``(stream sequence, message)`` pairs. A message that does not decode is skipped,
    counted in ``skipped`` and logged (a warning per read with the count), never raised."""
    info = await js.stream_info(stream)
    if info.state.messages == 0:
        return []
    out = []
    bad = Undecodable()
    sub = await js.subscribe(subject, stream=stream, ordered_consumer=True,
                             config=api.ConsumerConfig(deliver_policy=api.DeliverPolicy.ALL))
    try:
        while True:
            try:
                m = await sub.next_msg(timeout=idle_s)
            except nats.errors.TimeoutError:
                break
            seq = m.metadata.sequence.stream
            try:
                msg = codec.decode(m.data, typ, max_bytes=None)
            except codec.DecodeError as e:
                bad.add(stream, seq, e)
            else:
                out.append((seq, msg) if with_seq else msg)
            if m.metadata.num_pending == 0:
                break
    finally:
        await sub.unsubscribe()
    if bad.total:
        log.warning("%s (subject %s)", bad.note(), subject)
        if skipped is not None:
            for name, n in bad.counts.items():
                skipped.counts[name] = skipped.counts.get(name, 0) + n
            skipped.examples += bad.examples[:max(0, 5 - len(skipped.examples))]
    return out


async def read_channel(js: Any, channel: catalog.Channel, run_id: str,
                       skipped: Undecodable | None = None) -> list[Any]:
    """Every record stored on one run's ``channel`` (a stream channel), decoded as its type, one record each:
    a group message gives its rollouts, scored trajectories or outcomes (``catalog.members``). Messages that
    do not decode are skipped and counted in ``skipped``."""
    if channel.stream is None:
        raise ValueError(f"channel {channel.name} is not stored in a stream")
    msgs = await read_all(js, channel.stream.name, channel.wildcard(run_id), channel.msg_type, skipped=skipped)
    return [r for m in msgs for r in catalog.members(m)]


async def _refused_seqs(js: Any, run_id: str, stream: str) -> set[int]:
    """Stream sequences of ``stream``'s messages that were dead-lettered (the trainer's family: trajectories)."""
    subject = catalog.DEAD_LETTERS.subject(run_id, "trajectories")
    try:
        letters = await read_all(js, catalog.DLQ_STREAM.name, subject, DeadLetter)
    except Exception:  # no DLQ stream: nothing was refused
        return set()
    return {d.stream_seq for d in letters if d.stream == stream}


async def accounting(js: Any, run_id: str) -> dict[str, Any]:
    """The identity's terms, in trajectories. A message of the trajectories stream carries a prompt group;
    the trainer's consumer counts messages, so what it still holds is found per message: those it was not
    yet delivered, and those delivered but not acked (above its ack floor) whose trajectories have no outcome."""
    ch = catalog.TRAJECTORIES
    assert ch.stream is not None
    skipped = Undecodable()
    msgs = await read_all(js, ch.stream.name, ch.wildcard(run_id), ch.msg_type, with_seq=True, skipped=skipped)
    trajectories: list[ScoredTrajectory] = [t for _, m in msgs for t in catalog.members(m)]
    outcomes: list[TrajectoryOutcome] = await read_channel(js, catalog.OUTCOMES, run_id, skipped)
    by_id: dict[str, list[TrajectoryOutcome]] = {}
    for o in outcomes:
        by_id.setdefault(o.trajectory_id, []).append(o)
    refused = await _refused_seqs(js, run_id, ch.stream.name)
    dead = [t for seq, m in msgs if seq in refused for t in catalog.members(m)]
    # one verdict per stored copy of a trajectory: its outcome, or a refusal of the message carrying it. When every
    # message carrying it was refused and it also has its outcome, one refusal was a second look at the message
    # that was trained (the bus lost the ack and the delivery count, e.g. a nats-server killed mid-run, so the
    # trainer took the redelivery for a copy): the outcome is the verdict, that refusal is not counted again
    copies, refusals = Counter(t.msg_id for t in trajectories), Counter(t.msg_id for t in dead)
    refused_after_outcome = sum(max(0, (t_id in by_id) + r - copies[t_id]) for t_id, r in refusals.items())
    dead_lettered = len(dead) - refused_after_outcome
    published = {t.msg_id for t in trajectories}
    no_outcome = published - set(by_id) - {t.msg_id for t in dead}
    try:
        cdef = catalog.TRAINER_TRAJECTORIES.for_run(run_id)
        ci = await js.consumer_info(cdef.stream, cdef.durable)
        floor, delivered, unacked = ci.ack_floor.stream_seq or 0, ci.delivered.stream_seq or 0, ci.num_ack_pending
        held_messages = ci.num_ack_pending + ci.num_pending
    except Exception:  # no trainer consumer (yet): it holds nothing
        floor = delivered = unacked = held_messages = 0
    open_msgs = [(seq, ids) for seq, m in msgs if (ids := {t.msg_id for t in catalog.members(m)} & no_outcome)]
    undelivered = [ids for seq, ids in open_msgs if seq > delivered]
    in_flight = sorted((ids for seq, ids in open_msgs if floor < seq <= delivered), key=len, reverse=True)
    held = sum(map(len, undelivered)) + sum(map(len, in_flight[:unacked]))
    counts = {k: sum(1 for o in outcomes if o.outcome == k) for k in ("trained", "dropped", "eval")}
    return {
        "published": len(trajectories),
        "unique_published": len(published),
        "messages": len(msgs),
        **counts,
        "pending": len(no_outcome),
        "held_by_trainer_consumer": held,
        "held_messages": held_messages,
        "outcomes_without_trajectory": len(set(by_id) - published),
        "multiple_outcomes": sum(1 for v in by_id.values() if len(v) > 1),
        "dropped_reasons": sorted({o.reason.split(":")[0] for o in outcomes if o.outcome == "dropped"}),
        # trajectories of messages the trainer refused (dead-lettered): never admitted, or copies of ones with an outcome
        "dead_lettered": dead_lettered,
        # trajectories with their outcome whose message was later also refused (one verdict each: the outcome)
        "refused_after_outcome": refused_after_outcome,
        "identity_holds": len(trajectories) == sum(counts.values()) + len(no_outcome) + dead_lettered,
        # stored messages that do not decode (garbage published on the streams): skipped, not counted above;
        # the trainer dead-letters such a trajectories message, so it carries no trajectory to account for
        "undecodable": dict(skipped.counts),
        # the identity: nothing vanished (a trajectory without an outcome whose message the trainer acked)
        "lost": len(no_outcome) - held,
    }
