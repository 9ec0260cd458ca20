"""A stopped trainer continues where its durable state says: the kept weight version when the saved
state is newer than the checkpoint, else the checkpoint (with versions moved past the lost timeline).

The real trainer service runs against a real nats-server with the tiny model and the store transport.
Rollout and judge are played by this test (a stand-in that answers every prompt ticket with made-up
scored trajectories), because the point is what the trainer does on restart.
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
from services.runtime import bus, service
from services.runtime.config import load_service_config
from services.trainer.state import TrainerState, load_from_kv, read_checkpoint_state
from tests.conftest import run_file, wait_for_async

RUN = "resumerun"


def _config(tmp_path, nats_url, model_dir, total_steps: int, checkpoint_every: int, **trainer):
    """The trainer's config of these tests; ``trainer`` overrides keys of ``[services.trainer]``."""
    cfg = run_file(tmp_path, model_dir, run_id=RUN, nats_url=nats_url, trainer={
        "groups_per_step": 1, "group_size": 2, "sampling": {"max_new_tokens": 4}, "total_steps": total_steps,
        "max_staleness": 0, "eval": {"every": 0, "prompts": 1}, "checkpoint_every": checkpoint_every, **trainer})
    cfg_cls, _ = registry.load("trainer")
    return load_service_config("trainer", cfg_cls, cfg)


async def _stand_in(nc, tickets: list[PromptTicket], unsaved: list[str] | None = None) -> None:
    """Answers every prompt ticket with scored trajectories (the rollout and judge of this test).

    ``unsaved`` collects the training groups whose ticket arrived before the trainer's saved state had admitted
    them (a trainer stopped then would restart behind its own tickets: it must save first, then issue)."""
    js = nc.jetstream()

    async def answer(msg) -> None:
        ticket = codec.decode(msg.data, PromptTicket)
        tickets.append(ticket)
        if unsaved is not None and not ticket.is_eval:
            saved = await _saved_state(js)
            if saved is None or int(ticket.group_id[1:]) >= saved.data_position:
                unsaved.append(ticket.group_id)
        for i in range(ticket.group_size):
            turn = Turn(role="assistant", token_ids=[5, 6, 7], logprobs=[-1.0, -1.5, -2.0],
                        versions=[ticket.policy_version] * 3, text="x")
            rollout = Rollout(run_id=RUN, task=ticket.task, group_id=ticket.group_id, prompt_id=ticket.prompt_id,
                              sample_index=i, group_size=ticket.group_size, prompt_ids=ticket.prompt_ids,
                              turns=[turn], finish_reason="eos", policy_version=ticket.policy_version,
                              is_eval=ticket.is_eval)
            traj = ScoredTrajectory(run_id=RUN, rollout=rollout, reward=float(i % 2))
            traj.msg_id = f"{ticket.group_id}-v{ticket.policy_version}-{i}"
            await js.publish(f"rlbus.{RUN}.trajectories", codec.encode(traj), headers={"Nats-Msg-Id": traj.msg_id})

    await nc.subscribe(f"rlbus.{RUN}.prompts", cb=answer)


async def _saved_state(js) -> TrainerState | None:
    return await load_from_kv(await bus.ensure_kv(js, catalog.RUNS), RUN)


@pytest.mark.slow
async def test_trainer_resumes_from_the_kept_version_then_from_its_checkpoint(nats_url, tmp_path, loop_model_dir):
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    tickets: list[PromptTicket] = []
    unsaved: list[str] = []
    await _stand_in(nc, tickets, unsaved)
    factory = registry.load("trainer")[1]

    # 1. train without checkpoints, stop after step 2: only the saved state and the kept weights remain
    stop = asyncio.Event()
    first = asyncio.create_task(service.serve("trainer", factory, _config(tmp_path, nats_url, loop_model_dir, 10, 0),
                                              "trainer-0", stop=stop))
    async def at_step_2() -> bool:
        assert not first.done(), "the trainer stopped before step 2"
        st = await _saved_state(js)
        return st is not None and st.step >= 2

    await wait_for_async(at_step_2, 240, "the trainer's saved state to reach step 2")
    stop.set()
    assert await asyncio.wait_for(first, 60) == 0
    stopped = await _saved_state(js)
    assert stopped is not None and stopped.state == "running" and stopped.step >= 2
    assert not (tmp_path / "run" / "checkpoints" / "latest").exists()

    # 2. restart: no checkpoint, so it must continue from the kept version of the saved state
    code = await asyncio.wait_for(service.serve("trainer", factory,
                                                _config(tmp_path, nats_url, loop_model_dir, stopped.step + 1, 0),
                                                "trainer-1"), 240)
    assert code == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["step"] == stopped.step + 1  # one more step, not a fresh start
    assert summary["version"] == stopped.version + 1
    # the run's clock went on: max_wall_s bounds the run, not each process (the first one's time is counted)
    assert stopped.trained_s > 0 and summary["wall_s"] >= stopped.trained_s
    done = await _saved_state(js)
    assert done is not None and done.state == "finished" and done.data_position > stopped.data_position
    assert done.trained_s > stopped.trained_s
    assert done.counters["trained"] == 2 * (stopped.step + 1)  # group_size 2 per step, none trained twice
    ckpt = read_checkpoint_state(tmp_path / "run" / "checkpoints" / (tmp_path / "run" / "checkpoints" / "latest")
                                 .read_text().strip())
    assert ckpt.step == stopped.step + 1

    # 3. restart once more with a larger budget: it continues from the final checkpoint (same step as the
    # saved state), and its first version is new, so every engine takes it
    code = await asyncio.wait_for(service.serve("trainer", factory,
                                                _config(tmp_path, nats_url, loop_model_dir, stopped.step + 2, 0),
                                                "trainer-2"), 240)
    assert code == 0
    again = await _saved_state(js)
    assert again is not None and again.step == stopped.step + 2
    train_versions = [t.policy_version for t in tickets if not t.is_eval]
    assert max(train_versions) >= done.version + 1  # tickets after the restart carry the new numbers
    assert again.version == done.version + 2  # the resumed version (+1) and one more step (+1)
    assert not unsaved, f"tickets sent before their groups' admission was saved: {unsaved}"
    await nc.close()
