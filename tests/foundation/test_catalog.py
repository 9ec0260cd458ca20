"""The channel table: consistent with its streams and consumers, documented, and enforced by the harness."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest

from proto import catalog, registry, subjects
from proto.echo import EchoReply, EchoRequest
from proto.membership import Heartbeat
from proto.metrics import MetricsReport
from proto.prompts import PromptTicket
from services.runtime.config import CommonSection, Loaded, NatsSection, RunSection
from services.runtime.service import ServiceContext

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "ARCHITECTURE.md"
BEGIN, END = "<!-- channels:begin -->", "<!-- channels:end -->"
RUN = "r1"
CHANNELS = list(catalog.CHANNELS.values())
IDS = [c.name for c in CHANNELS]


def example_subject(c: catalog.Channel) -> str:
    return c.subject(RUN, *(f"x-{name}" for name in c.suffix))


def test_the_architecture_doc_holds_the_current_table():
    text = DOC.read_text()
    assert text.count(BEGIN) == 1 and text.count(END) == 1, f"{DOC} needs one {BEGIN} ... {END} region"
    inside = text.split(BEGIN, 1)[1].split(END, 1)[0]
    assert inside.strip() == catalog.channel_table_markdown().strip(), (
        "docs/ARCHITECTURE.md's channel table is stale: paste `python -m proto.catalog` between the markers")


def test_table_names_and_module_constants_agree():
    for name, c in catalog.CHANNELS.items():
        assert c.name == name and getattr(catalog, name.upper()) is c
        catalog.check_channel(c)
    assert set(catalog.STREAMS) == {s.name for s in vars(catalog).values() if isinstance(s, catalog.StreamDef)}
    assert catalog.PROMPTS.consumer is catalog.ROLLOUT_PROMPTS
    assert catalog.ROLLOUTS.consumer is catalog.JUDGE_ROLLOUTS
    assert catalog.TRAJECTORIES.consumer is catalog.TRAINER_TRAJECTORIES
    assert catalog.ECHO_REQUESTS.consumer is catalog.ECHO_IN


@pytest.mark.parametrize("c", CHANNELS, ids=IDS)
def test_every_stream_covers_its_channels_and_no_other_stream_captures_them(c):
    wild = c.wildcard()
    capturing = {s.name for s in catalog.STREAMS.values() if any(subjects.overlaps(f, wild) for f in s.subjects)}
    if c.stream is None:
        assert capturing == set(), f"{c.name} is core NATS / request-reply but stream(s) {capturing} capture it"
        return
    assert c.stream is catalog.STREAMS[c.stream.name]
    assert any(subjects.covers(f, wild) for f in c.stream.subjects), (c.stream.subjects, wild)
    assert capturing == {c.stream.name}


def test_every_stream_subject_belongs_to_its_channels():
    """A stream stores nothing but its channels: each of its subjects is covered by their patterns."""
    for s in catalog.STREAMS.values():
        mine = [c for c in CHANNELS if c.stream is s]
        assert mine, f"stream {s.name} has no channel"
        for c in CHANNELS:
            if c.stream is not s:
                assert not any(subjects.overlaps(f, c.wildcard()) for f in s.subjects), (s.name, c.name)


@pytest.mark.parametrize("c", [c for c in CHANNELS if c.consumer is not None], ids=lambda c: c.name)
def test_every_consumer_filter_is_its_channel(c):
    cdef = c.consumer.for_run(RUN)
    assert cdef.stream == c.stream.name
    assert cdef.filter_subject == c.wildcard(RUN)
    assert cdef.durable.endswith(RUN) and "{run}" in c.consumer.durable


def test_channels_are_disjoint():
    for a, b in itertools.combinations(CHANNELS, 2):
        assert not subjects.overlaps(a.wildcard(), b.wildcard()), (a.name, b.name)


@pytest.mark.parametrize("c", CHANNELS, ids=IDS)
def test_subjects_and_the_tap_decoder_follow_the_table(c):
    subj = example_subject(c)
    assert c.matches(subj) and subjects.run_of(subj) == RUN and subjects.family_of(subj) == c.family
    assert registry.channel_for_subject(subj) is c
    assert registry.type_for_subject(subj) == c.msg_type


def test_subject_checks_its_suffix():
    assert catalog.METRICS.subject(RUN, "judge") == "rlbus.r1.metrics.judge"
    assert catalog.SANDBOX_EVENTS.wildcard(RUN) == "rlbus.r1.sandbox.events.*"
    assert catalog.WEIGHT_ANNOUNCEMENTS.wildcard(scope="main") == "rlbus.*.weights.announce.main"
    for bad in ((), ("a", "b"), ("a.b",), ("*",), (">",), ("",), ("a b",)):
        with pytest.raises(ValueError, match="metrics"):
            catalog.METRICS.subject(RUN, *bad)
    with pytest.raises(ValueError, match="takes nothing"):
        catalog.PROMPTS.subject(RUN, "extra")
    with pytest.raises(subjects.InvalidRunId):
        catalog.PROMPTS.subject("bad.run")


def test_family_subjects_of_no_channel_decode_as_any_type_of_the_family():
    assert set(catalog.union_members(registry.type_for_subject("rlbus.x.echo"))) == {EchoRequest, EchoReply}
    assert registry.type_for_subject("rlbus.x.nosuchfamily") is None


def test_a_bad_channel_is_refused():
    ok = dict(name="n", family="prompts", msg_type=PromptTicket)
    for pattern in ("rlbus.{run}.other", "rlbus.x.prompts", "rlbus.{run}.prompts.a*b", "rlbus.{run}.prompts.{run}"):
        with pytest.raises(ValueError):
            catalog.check_channel(catalog.Channel(pattern=pattern, **ok))
    with pytest.raises(ValueError, match="unknown role"):
        catalog.check_channel(catalog.Channel(pattern="rlbus.{run}.prompts", publishers=("nobody",), **ok))
    with pytest.raises(ValueError, match="own stream"):
        catalog.check_channel(catalog.Channel(pattern="rlbus.{run}.prompts", consumer=catalog.ECHO_IN, **ok))


# --- the harness enforces the table --------------------------------------------------------------


class FakeJS:
    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []

    async def publish(self, subject: str, data: bytes, headers: Any = None, timeout: float = 0.0) -> str:
        self.sent.append((subject, data))
        return "ack"


class FakeNC:
    def __init__(self) -> None:
        self.js = FakeJS()
        self.sent: list[tuple[str, bytes]] = []

    def jetstream(self, timeout: float = 0.0) -> FakeJS:
        return self.js

    async def publish(self, subject: str, data: bytes, headers: Any = None) -> None:
        self.sent.append((subject, data))


def make_ctx() -> tuple[ServiceContext, FakeNC]:
    nc = FakeNC()
    loaded = Loaded(run=RunSection(id=RUN), nats=NatsSection(), common=CommonSection(), service=None, tree={})
    return ServiceContext("echo", "e0", loaded, nc), nc  # type: ignore[arg-type]


async def test_publish_checks_the_message_type_and_builds_the_subject():
    ctx, nc = make_ctx()
    with pytest.raises(TypeError, match="echo_replies"):
        await ctx.publish(catalog.ECHO_REPLIES, EchoRequest(run_id=RUN, text="wrong way round"))
    with pytest.raises(TypeError, match="heartbeats"):
        await ctx.publish(catalog.HEARTBEATS, MetricsReport(run_id=RUN, service="echo", instance="e0"), "echo")
    assert nc.sent == [] and nc.js.sent == []
    assert await ctx.publish(catalog.ECHO_REPLIES, EchoReply(run_id=RUN, text="hi", worker="e0", deliveries=1)) == "ack"
    assert [s for s, _ in nc.js.sent] == ["rlbus.r1.echo.out"]  # a stream channel: JetStream
    assert await ctx.publish(catalog.HEARTBEATS, ctx.heartbeat(), "echo") is None
    assert [s for s, _ in nc.sent] == ["rlbus.r1.heartbeat.echo"]  # core NATS
    with pytest.raises(ValueError, match="role"):
        await ctx.publish(catalog.METRICS, MetricsReport(run_id=RUN, service="echo", instance="e0"))
    assert isinstance(ctx.heartbeat(), Heartbeat)


async def test_consume_needs_a_channel_with_a_consumer():
    ctx, _ = make_ctx()
    with pytest.raises(ValueError, match="no durable consumer"):
        await ctx.consume(catalog.ECHO_REPLIES, lambda m, d: None)
