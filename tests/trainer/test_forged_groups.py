"""The trainer trains only samples of groups it admitted and still holds in flight: a scored group for ids it
never issued, and a new message copying a group it already trained, are dead-lettered with the reason and
counted, never trained; the accounting identity holds with them.

The real trainer service runs against a real nats-server with the tiny model; rollout and judge are played by
this test (a stand-in answering every ticket), which also publishes the forged messages, as a judge's
credentials allow.
"""

from __future__ import annotations

import asyncio
import json

import nats
import pytest

from proto import catalog, codec
from proto.deadletter import DeadLetter
from proto.prompts import PromptTicket
from proto.rollouts import Rollout, Turn
from proto.trajectories import ScoredTrajectory
from services.launcher import registry
from services.launcher.accounting import accounting, read_all, read_channel
from services.runtime import service
from services.runtime.config import load_service_config
from tests.conftest import run_file

RUN = "forgedrun"
STEPS = 4


def _traj(group_id: str, i: int, size: int, version: int, reward: float, prompt_ids: list[int],
          is_eval: bool = False) -> ScoredTrajectory:
    turn = Turn(role="assistant", token_ids=[5, 6, 7], logprobs=[-1.0, -1.5, -2.0], versions=[version] * 3, text="x")
    rollout = Rollout(run_id=RUN, task="addition", group_id=group_id, prompt_id="p", sample_index=i, group_size=size,
                      prompt_ids=prompt_ids, turns=[turn], finish_reason="eos", policy_version=version,
                      is_eval=is_eval)
    traj = ScoredTrajectory(run_id=RUN, rollout=rollout, reward=reward)
    traj.msg_id = f"{RUN}-{group_id}-s{i}"
    return traj


@pytest.mark.slow
async def test_forged_and_copied_groups_are_dead_lettered_never_trained(nats_url, tmp_path, loop_model_dir):
    cfg = run_file(tmp_path, loop_model_dir, run_id=RUN, nats_url=nats_url,
                   trainer={"groups_per_step": 1, "group_size": 2, "total_steps": STEPS, "max_staleness": 0,
                            "sampling": {"max_new_tokens": 4}})
    cfg_cls, factory = registry.load("trainer")
    loaded = load_service_config("trainer", cfg_cls, cfg)
    trainer = asyncio.create_task(service.serve("trainer", factory, loaded, "trainer-0"))

    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    first_group: list[bytes] = []
    forged_at = asyncio.Event()

    async def publish(traj: ScoredTrajectory, msg_id: str) -> None:
        await js.publish(f"rlbus.{RUN}.trajectories", codec.encode(traj), headers={"Nats-Msg-Id": msg_id})

    async def answer(msg) -> None:  # the stand-in rollout + judge: one message per sample
        ticket = codec.decode(msg.data, PromptTicket)
        if ticket.group_id == "g00000002":  # the trainer is past step 1: forge now, before answering
            await forged_at.wait()
        for i in range(ticket.group_size):
            traj = _traj(ticket.group_id, i, ticket.group_size, ticket.policy_version, float(i),
                         ticket.prompt_ids, ticket.is_eval)
            if ticket.group_id == "g00000000":
                first_group.append(codec.encode(traj))
            await publish(traj, traj.msg_id)

    await nc.subscribe(f"rlbus.{RUN}.prompts", cb=answer)
    try:
        async with asyncio.timeout(240):
            while not (tmp_path / "run" / "metrics.jsonl").is_file() or '"step": 1' not in (
                    tmp_path / "run" / "metrics.jsonl").read_text():
                await asyncio.sleep(0.2)
        # never admitted: 2 samples at reward 1.0, and 8 more of another id
        for i in range(2):
            await publish(_traj("g99999999", i, 2, 0, 1.0, [1, 2]), f"forged-a-{i}")
        for i in range(8):
            await publish(_traj("g88888888", i % 2, 2, 0, 1.0, [1, 2]), f"forged-b-{i}")
        # a new message copying group g00000000, already trained at step 1
        await js.publish(f"rlbus.{RUN}.trajectories", first_group[0], headers={"Nats-Msg-Id": "replayed-copy"})
        forged_at.set()
        code = await asyncio.wait_for(trainer, 300)
    finally:
        forged_at.set()
    assert code == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["step"] == STEPS and summary["counters"]["rejected"] == 11, summary

    outcomes = await read_channel(js, catalog.OUTCOMES, RUN)
    assert not [o for o in outcomes if o.group_id in ("g99999999", "g88888888")]  # no outcome: never trained
    trained = [o for o in outcomes if o.outcome == "trained"]
    assert len(trained) == STEPS * 2 and len({o.trajectory_id for o in outcomes}) == len(outcomes)
    letters = await read_all(js, catalog.DLQ_STREAM.name, catalog.DEAD_LETTERS.subject(RUN, "trajectories"),
                             DeadLetter)
    reasons = sorted(d.reason.split(":")[0] for d in letters)
    assert reasons == ["group already finished"] + ["never admitted"] * 10, reasons
    assert all(d.service == "trainer" and d.stream == "TRAJECTORIES" and d.stream_seq > 0 for d in letters)

    acc = await accounting(js, RUN)
    await nc.close()
    assert acc["dead_lettered"] == 11 and acc["lost"] == 0 and acc["multiple_outcomes"] == 0, acc
    assert acc["identity_holds"], acc
