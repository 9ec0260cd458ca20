"""The channel table: every subject family, its message type, stream, consumer, publishers and subscribers.

One :class:`Channel` per kind of message on the bus binds its subject pattern
(``rlbus.{run}.<family>[.<token>...]``), its msgspec type, the stream that stores
it (None for core-NATS and request/reply subjects), the durable consumer its
subscribers share, and the service roles that publish and subscribe. Everything
else derives from :data:`CHANNELS`: ``ServiceContext.publish``/``consume``,
``rlbus tap``'s decoder (``proto/registry.py``), the NATS permissions of each role
(``services/launcher/permissions.py``) and the table in docs/ARCHITECTURE.md
(:func:`channel_table_markdown`).

Definitions are plain msgspec Structs; ``services.runtime.bus`` turns them into
JetStream calls idempotently. Streams use limits retention (with an age cap)
rather than work-queue retention, so that every stream can be tapped from its
start for debugging and accounting; work-queue semantics come from one shared
durable consumer per run, whose acks move it along.
"""

from __future__ import annotations

import re
import types
import typing
from typing import Any, Literal

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
    teacher,
    trajectories,
    weights,
)
from proto.codec import MAX_MESSAGE_BYTES

DAY = 24 * 3600.0

#: Who may be named as a publisher or subscriber: the service roles, ``launcher`` (the
#: supervisor), ``admin`` (the read-only CLI) and ``any`` (every service, through the harness).
ROLES = ("trainer", "rollout", "judge", "sandbox", "weightsync", "echo", "teacher", "launcher", "admin", "any")

_TOKEN = re.compile(r"^[^.*>\s]+$")
_PLACEHOLDER = re.compile(r"^\{([a-z_]+)\}$")


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


def union_members(typ: Any) -> tuple[type, ...]:
    """The classes of a type or of a union of types."""
    if typing.get_origin(typ) in (typing.Union, types.UnionType):
        return tuple(t for arg in typing.get_args(typ) for t in union_members(arg))
    return (typ,)


def type_label(typ: Any) -> str:
    return " | ".join(t.__name__ for t in union_members(typ))


class Channel(msgspec.Struct, kw_only=True, frozen=True):
    """One kind of message on the bus: where it travels, what it is, who sends and who receives it.

    ``pattern`` is ``rlbus.{run}.<family>`` followed by literal tokens and *suffix wildcards*:
    tokens in braces (``{role}``, ``{scope}``, ``{sandbox_id}`` ...), each one subject token
    given to :meth:`subject` in order. ``{role}`` is the publishing service's role name and
    ``{scope}`` a weight scope (the permissions pin both per role).
    """

    name: str
    family: str
    pattern: str
    #: the msgspec type of every message on the channel (a Struct or a union of Structs)
    msg_type: Any
    #: the stream storing the channel (None: core NATS, at most once; or request/reply)
    stream: StreamDef | None = None
    #: the durable consumer the subscribers share (None: subscribers read the subject or the stream)
    consumer: ConsumerDef | None = None
    #: request/reply channels: the type of the replies (sent to each request's own inbox)
    reply_type: Any = None
    publishers: tuple[str, ...] = ()
    subscribers: tuple[str, ...] = ()
    description: str = ""

    @property
    def suffix(self) -> tuple[str, ...]:
        """The names of the suffix wildcards, in order (``("role",)`` for ``rlbus.{run}.metrics.{role}``)."""
        return tuple(m.group(1) for t in self.pattern.split(".")[3:] if (m := _PLACEHOLDER.match(t)))

    @property
    def types(self) -> tuple[type, ...]:
        return union_members(self.msg_type)

    def subject(self, run_id: str, *rest: str) -> str:
        """The concrete subject: ``{run}`` and then each suffix wildcard filled in order."""
        if len(rest) != len(self.suffix):
            want = ", ".join(self.suffix) or "nothing"
            raise ValueError(f"channel {self.name} ({self.pattern}) takes {want} after the run id, got {rest!r}")
        for tok in rest:
            if not isinstance(tok, str) or not _TOKEN.match(tok):
                raise ValueError(f"channel {self.name}: {tok!r} is not one subject token (no '.', '*', '>', space)")
        return self.wildcard(run_id, **dict(zip(self.suffix, rest, strict=True)))

    def wildcard(self, run_id: str = "*", **fixed: str) -> str:
        """The subject with ``{run}`` set (``*``: every run) and the suffix wildcards not in ``fixed`` as ``*``."""
        if run_id != "*":
            subjects.check_run_id(run_id)
        out = []
        for tok in self.pattern.split("."):
            m = _PLACEHOLDER.match(tok)
            out.append(tok if m is None else run_id if m.group(1) == "run" else fixed.get(m.group(1), "*"))
        return ".".join(out)

    def matches(self, subject: str) -> bool:
        """Whether ``subject`` (concrete, any run) belongs to this channel."""
        return subjects.covers(self.wildcard(), subject)

    def check(self, msg: Any) -> None:
        """Raise TypeError unless ``msg`` is of the channel's message type."""
        if not isinstance(msg, self.types):
            raise TypeError(f"channel {self.name} ({self.pattern}) carries {type_label(self.msg_type)}, "
                            f"not {type(msg).__name__}")


# --- streams -------------------------------------------------------------------------------------

PROMPTS_STREAM = StreamDef(name="PROMPTS", subjects=[subjects.all_runs(prompts.FAMILY)], description="prompt tickets")
ROLLOUTS_STREAM = StreamDef(
    name="ROLLOUTS", subjects=[subjects.all_runs(rollouts.FAMILY)], description="finished rollouts"
)
TRAJECTORIES_STREAM = StreamDef(
    name="TRAJECTORIES", subjects=[subjects.all_runs(trajectories.FAMILY)], description="scored trajectories"
)
DLQ_STREAM = StreamDef(
    name="DLQ",
    subjects=[subjects.all_runs(deadletter.FAMILY, ">")],
    max_msg_size=2 * MAX_MESSAGE_BYTES,
    description="dead letters with reasons",
)
METRICS_STREAM = StreamDef(
    name="METRICS", subjects=[subjects.all_runs(metrics.FAMILY, ">")], max_age_s=3 * DAY, description="metrics reports"
)
OUTCOMES_STREAM = StreamDef(
    name="OUTCOMES", subjects=[subjects.all_runs(accounting.FAMILY)], description="what became of each trajectory"
)
#: limits-based retention: events are kept for a week or 1 GiB, whichever ends first
SANDBOX_EVENTS_STREAM = StreamDef(
    name="SANDBOX_EVENTS",
    subjects=[subjects.all_runs(sandbox.FAMILY, "events", ">")],
    max_bytes=1 << 30,
    duplicate_window_s=120.0,
    description="sandbox lifecycle events (created ... destroyed)",
)
ECHO_STREAM = StreamDef(name="ECHO", subjects=[subjects.all_runs(echo.FAMILY, ">")], description="echo workload")

STREAMS: dict[str, StreamDef] = {s.name: s for s in (
    PROMPTS_STREAM, ROLLOUTS_STREAM, TRAJECTORIES_STREAM, OUTCOMES_STREAM, DLQ_STREAM, METRICS_STREAM,
    SANDBOX_EVENTS_STREAM, ECHO_STREAM,
)}

# --- consumers (formatted per run; each is also its channel's ``consumer``) ----------------------

ROLLOUT_PROMPTS = ConsumerDef(
    stream=PROMPTS_STREAM.name, durable="rollout-{run}", filter_subject="rlbus.{run}.prompts",
    ack_wait_s=30.0, max_deliver=5, backoff_s=[5.0, 15.0, 60.0], max_ack_pending=1024,
    description="rollout workers share this consumer: each ticket goes to one worker",
)
JUDGE_ROLLOUTS = ConsumerDef(
    stream=ROLLOUTS_STREAM.name, durable="judge-{run}", filter_subject="rlbus.{run}.rollouts",
    ack_wait_s=30.0, max_deliver=5, backoff_s=[2.0, 10.0, 30.0], max_ack_pending=1024,
    description="judges share this consumer (queue group)",
)
TRAINER_TRAJECTORIES = ConsumerDef(
    stream=TRAJECTORIES_STREAM.name, durable="trainer-{run}", filter_subject="rlbus.{run}.trajectories",
    ack_wait_s=15.0, max_deliver=1000, max_ack_pending=100_000,
    description="the trainer acks a trajectory only once the version trained on it is sent and the state saved",
)
ECHO_IN = ConsumerDef(
    stream=ECHO_STREAM.name, durable="echo-{run}", filter_subject="rlbus.{run}.echo.in",
    ack_wait_s=10.0, max_deliver=3, backoff_s=[0.2, 0.5], max_ack_pending=256,
)

#: The tracker (services/tracker) follows these channels, keyed by channel name, with durable consumers
#: of its own: it reads every message without taking any from the channel's subscribers, resumes where it
#: stopped after a restart, and can follow a finished run's streams from their start.
TRACKER_READS: dict[str, ConsumerDef] = {
    name: ConsumerDef(stream=stream, durable="tracker-{run}", filter_subject=subject, ack_wait_s=30.0,
                      max_deliver=3, max_ack_pending=4096,
                      description=f"the tracker follows {name} (experiment tracking; takes nothing from its readers)")
    for name, stream, subject in (
        ("metrics", METRICS_STREAM.name, "rlbus.{run}.metrics.*"),
        ("trajectories", TRAJECTORIES_STREAM.name, "rlbus.{run}.trajectories"),
        ("outcomes", OUTCOMES_STREAM.name, "rlbus.{run}.outcomes"),
    )
}

# --- channels ------------------------------------------------------------------------------------

PROMPTS = Channel(
    name="prompts", family=prompts.FAMILY, pattern="rlbus.{run}.prompts", msg_type=prompts.PromptTicket,
    stream=PROMPTS_STREAM, consumer=ROLLOUT_PROMPTS, publishers=("trainer",), subscribers=("rollout",),
    description="the trainer's admitted work; rollout workers share one consumer (each ticket to one worker)",
)
ROLLOUTS = Channel(
    name="rollouts", family=rollouts.FAMILY, pattern="rlbus.{run}.rollouts",
    msg_type=rollouts.RolloutGroup,
    stream=ROLLOUTS_STREAM, consumer=JUDGE_ROLLOUTS, publishers=("rollout",), subscribers=("judge",),
    description="finished rollouts from rollout workers, a prompt group per message; judges share one consumer",
)
TRAJECTORIES = Channel(
    name="trajectories", family=trajectories.FAMILY, pattern="rlbus.{run}.trajectories",
    msg_type=trajectories.ScoredGroup, stream=TRAJECTORIES_STREAM,
    consumer=TRAINER_TRAJECTORIES, publishers=("judge",), subscribers=("trainer",),
    description="scored trajectories from the judges (their only publisher), a group per message, consumed by "
                "the trainer",
)
OUTCOMES = Channel(
    name="outcomes", family=accounting.FAMILY, pattern="rlbus.{run}.outcomes",
    msg_type=accounting.OutcomeBatch, stream=OUTCOMES_STREAM, publishers=("trainer",),
    subscribers=("launcher",),
    description="the trainer records what became of every trajectory; the launcher's accounting reads the stream",
)
METRICS = Channel(
    name="metrics", family=metrics.FAMILY, pattern="rlbus.{run}.metrics.{role}", msg_type=metrics.MetricsReport,
    stream=METRICS_STREAM, publishers=("any",), subscribers=("launcher",),
    description="every service reports under its role; the launcher's progress display reads them",
)
DEAD_LETTERS = Channel(
    name="dead_letters", family=deadletter.FAMILY, pattern="rlbus.{run}.dlq.{family}",
    msg_type=deadletter.DeadLetter, stream=DLQ_STREAM, publishers=("any",),
    description="the consume loop of any service, under the family of the failed message; "
                "kept for people and tools (rlbus tap), nothing consumes them automatically",
)
HEARTBEATS = Channel(
    name="heartbeats", family=membership.FAMILY, pattern="rlbus.{run}.heartbeat.{role}",
    msg_type=membership.Heartbeat, publishers=("any",), subscribers=("launcher",),
    description="every service, every few seconds (also in KV rlbus_members); the supervisor watches them",
)
WEIGHT_ANNOUNCEMENTS = Channel(
    name="weight_announcements", family=weights.FAMILY, pattern="rlbus.{run}.weights.announce.{scope}",
    msg_type=weights.WeightAnnouncement, publishers=("trainer", "weightsync"), subscribers=("rollout", "weightsync"),
    description="a stored weight version (trainer: scope main, weightsync relays: their scopes); a wake-up for "
                "engines and relays, the durable record is the scope's KV",
)
WEIGHT_BROADCASTS = Channel(
    name="weight_broadcasts", family=weights.FAMILY, pattern="rlbus.{run}.weights.broadcast.{scope}",
    msg_type=weights.BroadcastReady, publishers=("trainer",), subscribers=("rollout",),
    description="the trainer's broadcast sender is about to send a version; engines join the collective",
)
WEIGHT_VLLM_TRANSFER = Channel(
    name="weight_vllm_transfer", family=weights.FAMILY, pattern="rlbus.{run}.weights.vllm.{engine}",
    msg_type=weights.VllmTransferRequest, reply_type=weights.VllmTransferReply, publishers=("trainer",),
    subscribers=("rollout",),
    description="the trainer's vllm sender drives vLLM's weight-sync handshake (init, start, update, finish) "
                "on each engine; the weights themselves travel over NCCL/CUDA IPC, never the bus",
)
SANDBOX_REQUESTS = Channel(
    name="sandbox_requests", family=sandbox.FAMILY, pattern="rlbus.{run}.sandbox.api.{target}",
    msg_type=sandbox.CreateRequest | sandbox.InstanceRequest,
    reply_type=typing.Union[(*(t for t in sandbox.REPLY_TYPES.values() if t is not sandbox.ListReply),  # noqa: UP007
                             sandbox.ErrorReply)],
    publishers=("rollout", "judge"), subscribers=("sandbox",),
    description=f"sandbox API requests from agent loops and judges: target {sandbox.CREATE_TARGET!r} goes to "
                "any instance (queue group), an instance id to the instance owning the sandbox",
)
SANDBOX_LIST = Channel(
    name="sandbox_list", family=sandbox.FAMILY, pattern="rlbus.{run}.sandbox.list", msg_type=sandbox.ListRequest,
    reply_type=sandbox.ListReply | sandbox.ErrorReply, publishers=("rollout", "judge", "admin"),
    subscribers=("sandbox",),
    description="scatter/gather from clients and rlbus status: every sandbox instance answers",
)
SANDBOX_EVENTS = Channel(
    name="sandbox_events", family=sandbox.FAMILY, pattern="rlbus.{run}.sandbox.events.{sandbox_id}",
    msg_type=sandbox.SandboxEvent, stream=SANDBOX_EVENTS_STREAM, publishers=("sandbox",),
    description="one event per state change of a sandbox, from its instance; read by rlbus tap and monitors",
)
ECHO_REQUESTS = Channel(
    name="echo_requests", family=echo.FAMILY, pattern="rlbus.{run}.echo.in", msg_type=echo.EchoRequest,
    stream=ECHO_STREAM, consumer=ECHO_IN, publishers=("launcher",), subscribers=("echo",),
    description="the echo demo's work, driven by the launcher (or a test); echo workers share one consumer",
)
ECHO_REPLIES = Channel(
    name="echo_replies", family=echo.FAMILY, pattern="rlbus.{run}.echo.out", msg_type=echo.EchoReply,
    stream=ECHO_STREAM, publishers=("echo",),
    description="echo workers' replies, read from the stream by whoever drove the demo",
)
TEACHER_REQUESTS = Channel(
    name="teacher_requests", family=teacher.FAMILY, pattern="rlbus.{run}.teacher.logprobs",
    msg_type=teacher.TeacherRequest, reply_type=teacher.TeacherReply, publishers=("judge",), subscribers=("teacher",),
    description="on-policy distillation: the judge asks a teacher worker (queue group) for the teacher's logprobs "
                "of finished samples' tokens",
)

CHANNELS: dict[str, Channel] = {c.name: c for c in (
    PROMPTS, ROLLOUTS, TRAJECTORIES, OUTCOMES, METRICS, DEAD_LETTERS, HEARTBEATS, WEIGHT_ANNOUNCEMENTS,
    WEIGHT_BROADCASTS, WEIGHT_VLLM_TRANSFER, SANDBOX_REQUESTS, SANDBOX_LIST, SANDBOX_EVENTS, ECHO_REQUESTS,
    ECHO_REPLIES, TEACHER_REQUESTS,
)}


def check_channel(c: Channel) -> None:
    """Raise ValueError when a channel's definition is inconsistent (run for the table at import)."""
    toks = c.pattern.split(".")
    if toks[:3] != [subjects.PREFIX, "{run}", c.family]:
        raise ValueError(f"channel {c.name}: pattern {c.pattern!r} must start with rlbus.{{run}}.{c.family}")
    if any(not (_TOKEN.match(t) or _PLACEHOLDER.match(t)) or t == "{run}" for t in toks[3:]):
        raise ValueError(f"channel {c.name}: pattern {c.pattern!r} has a token that is neither literal nor {{name}}")
    for role in (*c.publishers, *c.subscribers):
        if role not in ROLES:
            raise ValueError(f"channel {c.name}: unknown role {role!r} (known: {', '.join(ROLES)})")
    if c.consumer is not None and (c.stream is None or c.consumer.stream != c.stream.name):
        raise ValueError(f"channel {c.name}: its consumer must read its own stream")
    if c.stream is not None and c.reply_type is not None:
        raise ValueError(f"channel {c.name}: a request/reply channel cannot be stored in a stream")


for _c in CHANNELS.values():
    check_channel(_c)


def members(msg: Any) -> list[Any]:
    """What one message carries, one record each: a group's rollouts or scored trajectories (each joined with
    the group's ticket), a batch's outcomes; any other message is its own single record."""
    if isinstance(msg, rollouts.RolloutGroup | trajectories.ScoredGroup | accounting.OutcomeBatch):
        return msg.records()
    return [msg]

# --- KV and object stores -----------------------------------------------------------------------

MEMBERS = KVDef(bucket=membership.MEMBERS_BUCKET, ttl_s=30.0, description="heartbeats of live members")
RUNS = KVDef(bucket="rlbus_runs", history=5, description="run state (gang, progress)")

KV_BUCKETS: dict[str, KVDef] = {k.bucket: k for k in (MEMBERS, RUNS)}


# --- documentation ------------------------------------------------------------------------------


def channel_table_markdown() -> str:
    """The channel table as Markdown (docs/ARCHITECTURE.md holds a copy; a test keeps them equal)."""

    def code(text: str) -> str:
        return f"`{text}`"

    rows = [
        "| Channel | Subject | Message type | Stream | Consumer | Publishers → subscribers |",
        "|---|---|---|---|---|---|",
    ]
    for c in CHANNELS.values():
        msg = " \\| ".join(t.__name__ for t in c.types)
        if c.reply_type is not None:
            msg += " (replies: " + " \\| ".join(t.__name__ for t in union_members(c.reply_type)) + ")"
        stream = c.stream.name if c.stream else ("— (request/reply)" if c.reply_type is not None else "— (core NATS)")
        consumer = code(c.consumer.durable) if c.consumer else "—"
        flow = f"{', '.join(c.publishers) or '—'} → {', '.join(c.subscribers) or '—'}"
        rows.append(f"| {code(c.name.upper())} | {code(c.pattern)} | {msg} | {stream} | {consumer} | {flow} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":  # python -m proto.catalog: the table for docs/ARCHITECTURE.md
    print(channel_table_markdown(), end="")
