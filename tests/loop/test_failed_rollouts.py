"""A failed rollout (its sandbox died, its engine erred) is accounted as dropped with its error and
never trained on as a zero reward; its siblings train.

The real trainer service runs against a real nats-server with the tiny model. Rollout and judge are
played by this test (a stand-in that answers every prompt ticket with scored trajectories it makes
up), because the point is what the trainer does with a failed one.
"""

from __future__ import annotations

import asyncio
import json

import nats
import pytest

from proto import catalog, codec
from proto.prompts import PromptTicket
from proto.rollouts import Rollout, Turn
from proto.trajectories import ScoredTrajectory
from services.launcher import registry
from services.launcher.accounting import read_channel
from services.runtime import service
from services.runtime.config import load_service_config
from tests.conftest import run_file

RUN = "failrun"


@pytest.mark.slow
async def test_failed_rollout_is_dropped_with_its_error_and_siblings_train(nats_url, tmp_path, loop_model_dir):
    cfg = run_file(tmp_path, loop_model_dir, run_id=RUN, nats_url=nats_url,
                   trainer={"groups_per_step": 1, "group_size": 3, "total_steps": 1, "max_staleness": 0,
                            "sampling": {"max_new_tokens": 4},
                            "eval": {"prompts": 2}})
    cfg_cls, factory = registry.load("trainer")
    loaded = load_service_config("trainer", cfg_cls, cfg)
    trainer = asyncio.create_task(service.serve("trainer", factory, loaded, "trainer-0"))

    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    answered: list[str] = []

    async def answer(msg) -> None:  # the stand-in rollout + judge
        ticket = codec.decode(msg.data, PromptTicket)
        for i in range(ticket.group_size):
            failed = not ticket.is_eval and i == 0
            turn = Turn(role="assistant", token_ids=[5, 6, 7], logprobs=[-1.0, -1.5, -2.0],
                        versions=[ticket.policy_version] * 3, text="x")
            rollout = Rollout(run_id=RUN, task=ticket.task, group_id=ticket.group_id, prompt_id=ticket.prompt_id,
                              sample_index=i, group_size=ticket.group_size, prompt_ids=ticket.prompt_ids,
                              turns=[turn], finish_reason="error" if failed else "eos",
                              policy_version=ticket.policy_version, is_eval=ticket.is_eval,
                              error="sandbox sb-1: not_found (destroyed mid-rollout)" if failed else None)
            traj = ScoredTrajectory(run_id=RUN, rollout=rollout, reward=0.0 if failed or i == 2 else 1.0)
            traj.msg_id = f"{ticket.group_id}-{i}"
            await js.publish(f"rlbus.{RUN}.trajectories", codec.encode(traj), headers={"Nats-Msg-Id": traj.msg_id})
        answered.append(ticket.group_id)

    await nc.subscribe(f"rlbus.{RUN}.prompts.>", cb=answer)
    await nc.subscribe(f"rlbus.{RUN}.prompts", cb=answer)
    code = await asyncio.wait_for(trainer, 300)
    assert code == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["step"] == 1

    outcomes = await read_channel(js, catalog.OUTCOMES, RUN)
    await nc.close()
    train = [o for o in outcomes if o.outcome != "eval"]
    by_sample = {o.trajectory_id.rsplit("-", 1)[1]: o for o in train}
    assert sorted(by_sample) == ["0", "1", "2"], [o.trajectory_id for o in train]
    assert by_sample["0"].outcome == "dropped"
    assert by_sample["0"].reason.startswith("rollout failed: sandbox sb-1: not_found")
    assert by_sample["1"].outcome == "trained" and by_sample["2"].outcome == "trained"
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["trainer/dropped_total"] for m in metrics if "trainer/dropped_total" in m] == [1.0]
    assert [m["trainer/trained_total"] for m in metrics if "trainer/trained_total" in m] == [2.0]
