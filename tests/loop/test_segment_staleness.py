"""The staleness filter reads the oldest token over every segment of an episode: an episode whose newest
segment is fresh but whose first segment is older than ``max_staleness`` allows is dropped, its whole group
with it, with the reason; the run goes on and trains the group admitted in its place.

The real trainer service runs against a real nats-server with the tiny model; rollout and judge are played by
this test (a stand-in answering every prompt ticket with scored episodes it makes up), because the point is
what the trainer does with such an episode."""

from __future__ import annotations

import asyncio
import json

import nats
import pytest

from proto import catalog, codec
from proto.prompts import PromptTicket
from proto.rollouts import EpisodeSegment, Rollout, Turn
from proto.trajectories import ScoredGroup, ScoredTrajectory
from services.launcher import registry
from services.launcher.accounting import read_channel
from services.runtime import service
from services.runtime.config import load_service_config
from tests.conftest import run_file

RUN = "segstale"


def _turn(version: int) -> Turn:
    return Turn(role="assistant", token_ids=[5, 6, 7], logprobs=[-1.0, -1.5, -2.0], versions=[version] * 3, text="x")


@pytest.mark.slow
async def test_an_episode_whose_oldest_segment_is_too_old_is_dropped_whole(nats_url, tmp_path, loop_model_dir):
    cfg = run_file(tmp_path, loop_model_dir, run_id=RUN, nats_url=nats_url,
                   trainer={"groups_per_step": 1, "group_size": 2, "total_steps": 2, "max_staleness": 0,
                            "sampling": {"max_new_tokens": 4}})
    cfg_cls, factory = registry.load("trainer")
    trainer = asyncio.create_task(service.serve("trainer", factory, load_service_config("trainer", cfg_cls, cfg),
                                                "trainer-0"))
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    segmented: list[str] = []

    async def answer(msg) -> None:  # the stand-in rollout + judge
        ticket = codec.decode(msg.data, PromptTicket)
        v = ticket.policy_version
        trajs = []
        for i in range(ticket.group_size):
            extra = []
            if v == 1 and not segmented and i == 0:  # first segment from version 0, the second at the ticket's
                extra = [EpisodeSegment(prompt_ids=[1, 5, 4], turns=[_turn(v)])]
                segmented.append(ticket.group_id)
            rollout = Rollout(run_id=RUN, task=ticket.task, group_id=ticket.group_id, prompt_id=ticket.prompt_id,
                              sample_index=i, group_size=ticket.group_size, prompt_ids=ticket.prompt_ids,
                              turns=[_turn(v - 1 if extra else v)], finish_reason="eos", policy_version=v,
                              is_eval=ticket.is_eval, extra_segments=extra)
            trajs.append(ScoredTrajectory(run_id=RUN, msg_id=f"{ticket.group_id}-{i}", rollout=rollout,
                                          reward=float(i)))
        group = ScoredGroup.of(trajs, msg_id=f"{ticket.group_id}-g")
        await js.publish(f"rlbus.{RUN}.trajectories", codec.encode(group), headers={"Nats-Msg-Id": group.msg_id})

    await nc.subscribe(f"rlbus.{RUN}.prompts", cb=answer)
    assert await asyncio.wait_for(trainer, 300) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["step"] == 2
    outcomes = await read_channel(js, catalog.OUTCOMES, RUN)
    await nc.close()
    (gid,) = segmented
    dropped = [o for o in outcomes if o.trajectory_id.startswith(f"{gid}-")]
    assert sorted(o.trajectory_id for o in dropped) == [f"{gid}-0", f"{gid}-1"]  # the whole group
    for o in dropped:
        assert o.outcome == "dropped"
        assert o.reason == "stale: oldest token from version 0, trainer at 1, max_staleness 0"
    trained = [o for o in outcomes if o.outcome == "trained"]
    assert len(trained) == 4 and not any(o.trajectory_id.startswith(f"{gid}-") for o in trained)
