"""Streams, consumers, KV buckets and object stores — all in one place.

Definitions are plain msgspec Structs; ``services.runtime.provision`` turns them
into JetStream calls idempotently. Streams use limits retention (with an age
cap) rather than work-queue retention, so that every stream can be tapped from
its start for debugging and accounting; work-queue semantics come from one
shared durable consumer per run, whose acks move it along.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from proto import (
    accounting,
    deadletter,
    echo,
    membership,
    metrics,
    prompts,
    rollouts,
    sandbox,
    subjects,
    trajectories,
)
from proto.codec import MAX_MESSAGE_BYTES

DAY = 24 * 3600.0


class StreamDef(msgspec.Struct, kw_only=True, frozen=True):
    name: str
    subjects: list[str]
    retention: Literal["limits", "workqueue", "interest"] = "limits"
    max_age_s: float = 7 * DAY
    max_bytes: int = -1
    max_msgs: int = -1
    max_msg_size: int = MAX_MESSAGE_BYTES
    #: retried publishes with the same Nats-Msg-Id within this window are stored once
    duplicate_window_s: float = 1800.0
    storage: Literal["file", "memory"] = "file"
    description: str = ""


class ConsumerDef(msgspec.Struct, kw_only=True, frozen=True):
    """A durable pull consumer; its name and filter are formatted with the run id.

    ``ack_wait_s`` is how long a silent handler holds a message before it is redelivered
    (the consume loop sends ``in_progress`` every third of it while it works), so a dead
    worker's messages come back after at most that long. ``backoff_s`` are the delays
    of the consume loop's naks after failures (client side; the server's own backoff
    would override ack_wait, so it is not used).
    """

    stream: str
    durable: str  # e.g. "rollout-{run}"
    filter_subject: str  # e.g. "rlbus.{run}.prompts"
    ack_wait_s: float = 60.0
    max_deliver: int = 5
    backoff_s: list[float] = []
    max_ack_pending: int = 1024
    description: str = ""

    def for_run(self, run_id: str) -> ConsumerDef:
        subjects.check_run_id(run_id)
        return msgspec.structs.replace(
            self, durable=self.durable.format(run=run_id), filter_subject=self.filter_subject.format(run=run_id)
        )


class KVDef(msgspec.Struct, kw_only=True, frozen=True):
    bucket: str
    history: int = 1
    ttl_s: float = 0.0
    description: str = ""


class ObjectStoreDef(msgspec.Struct, kw_only=True, frozen=True):
    bucket: str
    description: str = ""


# --- streams -------------------------------------------------------------------------------------

PROMPTS = StreamDef(name="PROMPTS", subjects=[subjects.all_runs(prompts.FAMILY)], description="prompt tickets")
ROLLOUTS = StreamDef(name="ROLLOUTS", subjects=[subjects.all_runs(rollouts.FAMILY)], description="finished rollouts")
TRAJECTORIES = StreamDef(
    name="TRAJECTORIES", subjects=[subjects.all_runs(trajectories.FAMILY)], description="scored trajectories"
)
DLQ = StreamDef(
    name="DLQ",
    subjects=[subjects.all_runs(deadletter.FAMILY, ">")],
    max_msg_size=2 * MAX_MESSAGE_BYTES,
    description="dead letters with reasons",
)
METRICS = StreamDef(
    name="METRICS", subjects=[subjects.all_runs(metrics.FAMILY, ">")], max_age_s=3 * DAY, description="metrics reports"
)
OUTCOMES = StreamDef(
    name="OUTCOMES", subjects=[subjects.all_runs(accounting.FAMILY)], description="what became of each trajectory"
)
SANDBOX_EVENTS = StreamDef(**sandbox.SANDBOX_EVENTS_STREAM)
ECHO = StreamDef(name="ECHO", subjects=[subjects.all_runs(echo.FAMILY, ">")], description="echo workload")

STREAMS: dict[str, StreamDef] = {s.name: s for s in (PROMPTS, ROLLOUTS, TRAJECTORIES, OUTCOMES, DLQ, METRICS, SANDBOX_EVENTS, ECHO)}

# --- consumers (formatted per run) ---------------------------------------------------------------

ROLLOUT_PROMPTS = ConsumerDef(
    stream="PROMPTS", durable="rollout-{run}", filter_subject="rlbus.{run}.prompts",
    ack_wait_s=30.0, max_deliver=5, backoff_s=[5.0, 15.0, 60.0], max_ack_pending=1024,
    description="rollout workers share this consumer: each ticket goes to one worker",
)
JUDGE_ROLLOUTS = ConsumerDef(
    stream="ROLLOUTS", durable="judge-{run}", filter_subject="rlbus.{run}.rollouts",
    ack_wait_s=30.0, max_deliver=5, backoff_s=[2.0, 10.0, 30.0], max_ack_pending=1024,
    description="judges share this consumer (queue group)",
)
TRAINER_TRAJECTORIES = ConsumerDef(
    stream="TRAJECTORIES", durable="trainer-{run}", filter_subject="rlbus.{run}.trajectories",
    ack_wait_s=15.0, max_deliver=1000, max_ack_pending=100_000,
    description="the trainer acks only once the step that used a trajectory is durable",
)
ECHO_IN = ConsumerDef(
    stream="ECHO", durable="echo-{run}", filter_subject="rlbus.{run}.echo.in",
    ack_wait_s=10.0, max_deliver=3, backoff_s=[0.2, 0.5], max_ack_pending=256,
)

# --- KV and object stores -----------------------------------------------------------------------

MEMBERS = KVDef(bucket=membership.MEMBERS_BUCKET, ttl_s=30.0, description="heartbeats of live members")
RUNS = KVDef(bucket="rlbus_runs", history=5, description="run state (gang, progress)")

KV_BUCKETS: dict[str, KVDef] = {k.bucket: k for k in (MEMBERS, RUNS)}
