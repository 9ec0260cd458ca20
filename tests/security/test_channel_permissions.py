"""The NATS permissions of every role follow the channel table (no server needed)."""

from __future__ import annotations

import msgspec
import pytest

from proto import catalog, subjects
from proto.prompts import PromptTicket
from services.launcher import permissions

RUN = "r1"
RELAY = "node-a"
SERVICE_ROLES = [r for r, spec in permissions.ROLES.items() if spec.service]


def perms(role: str) -> permissions.Permissions:
    return permissions.flatten(permissions.grants_for(role, RUN, relay_scopes=(RELAY,)))


def may(role: str, kind: str, subject: str) -> bool:
    return any(subjects.covers(p, subject) for p in getattr(perms(role), kind))


def named(role: str, names: tuple[str, ...]) -> bool:
    spec = permissions.ROLES[role]
    return role in names or any(r in names for r in spec.acts_as) or ("any" in names and spec.service)


def example(c: catalog.Channel, role: str) -> str:
    fill = {"role": role, "scope": permissions.weights.MAIN_SCOPE if role == "trainer" else RELAY}
    return c.subject(RUN, *(fill.get(name, f"x-{name}") for name in c.suffix))


@pytest.mark.parametrize("c", list(catalog.CHANNELS.values()), ids=list(catalog.CHANNELS))
def test_publishers_and_only_they_may_publish(c):
    for role in permissions.ROLES:
        allowed = may(role, "publish", example(c, role))
        if named(role, c.publishers):
            assert allowed, (role, c.name)
        elif role in SERVICE_ROLES:
            assert not allowed, f"{role} may publish on {c.name} without being one of its publishers"


@pytest.mark.parametrize("c", list(catalog.CHANNELS.values()), ids=list(catalog.CHANNELS))
def test_subscribers_get_the_consumer_or_the_subject(c):
    for role in SERVICE_ROLES:
        p = perms(role)
        if c.consumer is not None:
            cdef = c.consumer.for_run(RUN)
            pulls = f"$JS.API.CONSUMER.MSG.NEXT.{cdef.stream}.{cdef.durable}" in p.publish
            assert pulls == named(role, c.subscribers), (role, c.name)
        else:
            reads = any(subjects.covers(s, example(c, "judge")) for s in p.subscribe)
            assert reads == named(role, c.subscribers), (role, c.name)
        if c.reply_type is not None and named(role, c.subscribers):
            assert p.allow_responses


def test_a_channel_added_to_the_table_reaches_the_permissions_of_its_roles(monkeypatch):
    new = catalog.Channel(
        name="hints", family="hints", pattern="rlbus.{run}.hints.{role}", msg_type=PromptTicket,
        publishers=("judge",), subscribers=("trainer", "rollout"), description="test: judge → trainer, rollout",
    )
    stored = catalog.Channel(
        name="notes", family="notes", pattern="rlbus.{run}.notes", msg_type=PromptTicket,
        stream=catalog.StreamDef(name="NOTES", subjects=["rlbus.*.notes"]),
        consumer=catalog.ConsumerDef(stream="NOTES", durable="echo-notes-{run}", filter_subject="rlbus.{run}.notes"),
        publishers=("trainer",), subscribers=("echo",),
    )
    before = {role: perms(role) for role in permissions.ROLES}
    assert not may("judge", "publish", "rlbus.r1.hints.judge")
    monkeypatch.setattr(catalog, "CHANNELS", {**catalog.CHANNELS, "hints": new, "notes": stored})

    assert may("judge", "publish", "rlbus.r1.hints.judge")
    assert not may("judge", "publish", "rlbus.r1.hints.trainer")  # {role} pins the publisher
    assert not may("rollout", "publish", "rlbus.r1.hints.rollout")
    assert may("trainer", "subscribe", "rlbus.r1.hints.judge") and may("rollout", "subscribe", "rlbus.r1.hints.x")
    assert not may("sandbox", "subscribe", "rlbus.r1.hints.judge")
    assert may("trainer", "publish", "rlbus.r1.notes")
    assert "$JS.API.CONSUMER.MSG.NEXT.NOTES.echo-notes-r1" in perms("echo").publish
    for role in ("weightsync", "sandbox"):
        assert perms(role) == before[role]


def test_suffix_pins_follow_the_roles():
    assert may("trainer", "publish", "rlbus.r1.heartbeat.trainer")
    assert not may("trainer", "publish", "rlbus.r1.heartbeat.judge")
    assert may("trainer", "publish", "rlbus.r1.weights.announce.main")
    assert not may("trainer", "publish", f"rlbus.r1.weights.announce.{RELAY}")
    assert may("weightsync", "publish", f"rlbus.r1.weights.announce.{RELAY}")
    assert not may("weightsync", "publish", "rlbus.r1.weights.announce.main")
    for scope in ("main", RELAY):
        assert may("rollout", "subscribe", f"rlbus.r1.weights.announce.{scope}")
    assert not may("rollout", "subscribe", "rlbus.r1.weights.announce.elsewhere")
    assert msgspec.structs.asdict(perms("sandbox"))["allow_responses"] is True
