"""The channel table: consistent with its streams and consumers, documented, and enforced by the harness."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import nats
import pytest

from proto import catalog, registry, subjects
from proto.echo import EchoReply, EchoRequest
from proto.membership import Heartbeat
from proto.metrics import MetricsReport
from proto.prompts import PromptTicket
from services.runtime import bus
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


async def make_ctx(nats_url: str) -> ServiceContext:
    """A service context on a real nats-server, with the run's streams provisioned."""
    nc = await nats.connect(nats_url)
    await bus.provision_all(nc.jetstream())
    loaded = Loaded(run=RunSection(id=RUN), nats=NatsSection(url=nats_url), common=CommonSection(), service=None)
    return ServiceContext("echo", "e0", loaded, nc)


async def test_publish_checks_the_message_type_and_builds_the_subject(nats_url):
    ctx = await make_ctx(nats_url)
    core: asyncio.Queue[str] = asyncio.Queue()

    async def seen(m) -> None:
        core.put_nowait(m.subject)

    await ctx.nc.subscribe(f"rlbus.{RUN}.>", cb=seen)
    with pytest.raises(TypeError, match="echo_replies"):
        await ctx.publish(catalog.ECHO_REPLIES, EchoRequest(run_id=RUN, text="wrong way round"))
    with pytest.raises(TypeError, match="heartbeats"):
        await ctx.publish(catalog.HEARTBEATS, MetricsReport(run_id=RUN, service="echo", instance="e0"), "echo")
    ack = await ctx.publish(catalog.ECHO_REPLIES, EchoReply(run_id=RUN, text="hi", worker="e0", deliveries=1))
    assert ack is not None and ack.stream == catalog.ECHO_STREAM.name  # a stream channel: JetStream
    assert await asyncio.wait_for(core.get(), 5) == f"rlbus.{RUN}.echo.out"  # the wrongly typed ones sent nothing
    assert await ctx.publish(catalog.HEARTBEATS, ctx.heartbeat(), "echo") is None  # core NATS: no ack
    assert await asyncio.wait_for(core.get(), 5) == f"rlbus.{RUN}.heartbeat.echo"
    assert (await ctx.js.stream_info(catalog.ECHO_STREAM.name)).state.messages == 1
    with pytest.raises(ValueError, match="role"):
        await ctx.publish(catalog.METRICS, MetricsReport(run_id=RUN, service="echo", instance="e0"))
    assert isinstance(ctx.heartbeat(), Heartbeat)
    await ctx.nc.close()


async def test_consume_needs_a_channel_with_a_consumer(nats_url):
    ctx = await make_ctx(nats_url)
    with pytest.raises(ValueError, match="no durable consumer"):
        await ctx.consume(catalog.ECHO_REPLIES, lambda m, d: None)
    await ctx.nc.close()
