"""Groups only on the wire: the ticket travels once per group, and an older bare record (or a schema-1 group)
is decoded as today's group of one wherever it is read (consume loop, accounting reader, tap), on a real
nats-server."""

from __future__ import annotations

import asyncio
import json

import msgspec
import nats
import pytest

from proto import catalog, codec, registry
from proto.accounting import OutcomeBatch, TrajectoryOutcome
from proto.prompts import PromptTicket, Sampling
from proto.rollouts import Rollout, RolloutGroup, RolloutGroupV1, RolloutSample, Turn, split
from proto.trajectories import ScoredGroup, ScoredGroupV1, ScoredTrajectory, scored
from services.launcher.accounting import read_channel
from services.launcher.tap import render
from services.runtime import bus
from services.runtime.config import CommonSection, Loaded, NatsSection, RunSection
from services.runtime.service import ServiceContext

RUN = "wire"


def bare_rollout(index: int = 0, **kw) -> Rollout:
    base = dict(run_id=RUN, msg_id=f"{RUN}-g1-s{index}", task="addition", group_id="g1", prompt_id="p1",
                sample_index=index, group_size=2, prompt_ids=[5, 6, 7], prompt_text="2+2=", policy_version=3,
                metadata={"answer": "4"}, turns=[Turn(role="assistant", token_ids=[9], logprobs=[-0.5], versions=[4],
                                                      text="4")], finish_reason="eos")
    return Rollout(**{**base, **kw})


def ticket() -> PromptTicket:
    return PromptTicket(run_id=RUN, task="addition", group_id="g1", prompt_id="p1", prompt_ids=[5, 6, 7],
                        prompt_text="2+2=", group_size=2, policy_version=3, metadata={"answer": "4"},
                        sampling=Sampling(max_new_tokens=8, temperature=0.7))


def test_a_group_carries_the_ticket_once_and_its_records_join_it():
    samples = [RolloutSample(id=f"{RUN}-g1-s{i}", sample_index=i, turns=[Turn(role="assistant", token_ids=[9])],
                             finish_reason="eos", metadata={"sandbox_retries": "1"} if i else {}) for i in range(2)]
    group = RolloutGroup(run_id=RUN, ticket=ticket(), rollouts=samples)
    assert group.schema == 2 and group.group_id == "g1"
    wire = msgspec.to_builtins(group)
    # the ticket's fields are not repeated per sample (a sample names its own prompt only when it has one)
    assert all(r["prompt_ids"] is None for r in wire["rollouts"])
    assert "prompt_text" not in json.dumps(wire["rollouts"]) and "policy_version" not in json.dumps(wire["rollouts"])
    got = codec.decode(codec.encode(group), RolloutGroup)
    assert got == group
    first, second = got.records()
    assert (first.msg_id, first.prompt_ids, first.policy_version, first.group_size) == (samples[0].id, [5, 6, 7], 3, 2)
    assert first.metadata == {"answer": "4"} and second.metadata == {"answer": "4", "sandbox_retries": "1"}
    assert second.min_version() == 3  # no policy tokens: the ticket's admission version

    judged = ScoredGroup(run_id=RUN, ticket=group.ticket, trajectories=[scored(s, 1.0, [], "j0") for s in samples])
    t = codec.decode(codec.encode(judged), ScoredGroup).records()[1]
    assert (t.msg_id, t.reward, t.judge, t.rollout.msg_id, t.rollout.prompt_text) == (samples[1].id, 1.0, "j0",
                                                                                      samples[1].id, "2+2=")


@pytest.mark.parametrize("old, current", [
    (bare_rollout(), RolloutGroup),
    (RolloutGroupV1(run_id=RUN, group_id="g1", rollouts=[bare_rollout(0), bare_rollout(1)]), RolloutGroup),
    (ScoredTrajectory(run_id=RUN, msg_id="t-0", rollout=bare_rollout(), reward=0.5), ScoredGroup),
    (ScoredGroupV1(run_id=RUN, group_id="g1", trajectories=[
        ScoredTrajectory(run_id=RUN, msg_id=f"t-{i}", rollout=bare_rollout(i), reward=i) for i in range(2)]), ScoredGroup),
    (TrajectoryOutcome(run_id=RUN, trajectory_id="t-0", group_id="g1", outcome="trained", step=1, version=1,
                       sample_version=0), OutcomeBatch),
], ids=lambda v: type(v).__name__ if not isinstance(v, type) else v.__name__)
def test_older_layouts_decode_as_the_current_group(old, current):
    got = codec.decode(codec.encode(old), current)
    assert isinstance(got, current) and got.msg_id == old.msg_id
    before = {RolloutGroupV1: lambda: old.rollouts, ScoredGroupV1: lambda: old.trajectories}.get(type(old), lambda: [old])()
    assert [comparable(r) for r in catalog.members(got)] == [comparable(r) for r in before]


def comparable(record) -> dict:
    """A record's fields but the times (a group's records share its time) and a trajectory's rollout id (a
    trajectory and its rollout are one sample, named by the trajectory's id)."""
    d = msgspec.to_builtins(record)
    d.pop("created_at")
    if "rollout" in d:
        del d["rollout"]["created_at"], d["rollout"]["msg_id"]
    return d


def test_a_message_neither_layout_reads_names_the_current_one():
    bad = msgspec.to_builtins(bare_rollout())
    bad["policy_version"] = "three"
    with pytest.raises(codec.DecodeError, match="cannot decode RolloutGroup"):
        codec.decode(msgspec.msgpack.encode(bad), RolloutGroup)
    empty = RolloutGroupV1(run_id=RUN, group_id="g1", rollouts=[])  # an old group of nothing is not a group
    with pytest.raises(codec.DecodeError, match="RolloutGroup"):
        codec.decode(codec.encode(empty), RolloutGroup)


async def test_an_old_bare_record_on_the_channel_is_consumed_and_read_as_a_group_of_one(nats_url):
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    await bus.provision_all(js)
    loaded = Loaded(run=RunSection(id=RUN), nats=NatsSection(url=nats_url), common=CommonSection())
    ctx = ServiceContext("judge", "j0", loaded, nc)
    old = bare_rollout()
    subject = catalog.ROLLOUTS.subject(RUN)
    await js.publish(subject, codec.encode(old), headers={"Nats-Msg-Id": old.msg_id})  # as an older writer did
    with pytest.raises(TypeError, match="rollouts"):  # today's writers publish groups only
        await ctx.publish(catalog.ROLLOUTS, old)
    await ctx.publish(catalog.ROLLOUTS, RolloutGroup.of([bare_rollout(1)], msg_id="new-group"))

    seen: list[RolloutGroup] = []

    async def handle(msg, d) -> None:
        seen.append(msg)
        if len(seen) == 2:
            ctx.stop.set()

    await asyncio.wait_for(ctx.consume(catalog.ROLLOUTS, handle, concurrency=1), 30)
    assert [type(m) for m in seen] == [RolloutGroup, RolloutGroup]
    assert seen[0].msg_id == old.msg_id and seen[0].records() == [old]
    assert [r.sample_index for r in seen[1].records()] == [1]

    stored = await read_channel(js, catalog.ROLLOUTS, RUN)  # the accounting reader: one record per sample
    assert [r.msg_id for r in stored] == [old.msg_id, f"{RUN}-g1-s1"]
    line = json.loads(render(subject, codec.encode(old), None, raw=False))  # rlbus tap
    assert line["message"] == old.msg_id and line["data"]["prompt_ids"] == [5, 6, 7]
    assert isinstance(registry.decode_any(subject, codec.encode(old)), RolloutGroup)
    await nc.close()


def test_a_dead_lettered_group_is_fixed_field_by_field_in_its_ticket_and_samples():
    from services.launcher.replay import ReplayError, fix_payload

    subject = catalog.ROLLOUTS.subject(RUN)
    group = RolloutGroup.of([bare_rollout(0), bare_rollout(1)], msg_id="g1-parts")
    fixed = codec.decode(fix_payload(subject, codec.encode(group), [
        'ticket.metadata.answer="5"', 'rollouts.1.turns.0.text="five"']), RolloutGroup)
    assert [r.metadata["answer"] for r in fixed.records()] == ["5", "5"]
    assert [r.text() for r in fixed.records()] == ["4", "five"]
    with pytest.raises(ReplayError, match="refused, so nothing was sent: cannot decode RolloutGroup"):
        fix_payload(subject, codec.encode(group), ['ticket.policy_version="late"'])
    old = codec.decode(fix_payload(subject, codec.encode(bare_rollout()), ["policy_version=7"]), RolloutGroup)
    assert old.records()[0].policy_version == 7  # an older bare record: fixed as stored, read as a group of one


def test_a_sample_with_its_own_prompt_keeps_it_through_the_group():
    """A black-box agent's sample starts from the prompt its first call rendered: readers get that prompt."""
    own = RolloutSample(id=f"{RUN}-g1-s0", sample_index=0, turns=[Turn(role="assistant", token_ids=[9])],
                        finish_reason="eos", prompt_ids=[1, 2])
    group = codec.decode(codec.encode(RolloutGroup(run_id=RUN, ticket=ticket(), rollouts=[own])), RolloutGroup)
    [record] = group.records()
    assert record.prompt_ids == [1, 2]
    assert split(record, ticket()).prompt_ids == [1, 2]
    assert split(bare_rollout(), ticket()).prompt_ids is None  # the ticket's prompt is not repeated
