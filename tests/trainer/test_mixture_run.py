"""A mixture of two environments (addition and a dataset) through the real trainer service on a real
nats-server: every training ticket names the environment its prompt was drawn from, with that environment's
prompt, sampling budget and position in the seeded stream; each step reports each environment's reward and
share, each evaluation round each environment's mean; a restarted trainer continues the stream where its
saved data position says (the same prompt at every position as an uninterrupted stream).

Rollout and judge are played by this test: it answers every ticket with scored trajectories whose rewards
depend on the environment, so the per-environment figures can be checked exactly.
"""

from __future__ import annotations

import asyncio
import itertools
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
from services.tasks.mixture import Mixture
from services.trainer.state import TrainerState, load_from_kv
from tests.conftest import run_file, trainer_records, wait_for_async

RUN = "mixrun"
#: each environment's reward for sample i of a group: addition i % 2 (mean 0.5), the dataset 0.25 always
REWARD = {"addition": lambda i: float(i % 2), "dataset": lambda i: 0.25}


def _config(tmp_path, nats_url, model_dir, data, total_steps: int):
    mix = (f'[[task.mix]]\nname = "addition"\nweight = 3\n\n[[task.mix]]\nname = "dataset"\nweight = 1\n'
           f'options = {{ path = "{data}", max_new_tokens = 3, eval_fraction = 0.2 }}\n')
    cfg = run_file(tmp_path, model_dir, run_id=RUN, nats_url=nats_url, extra=mix, trainer={
        "groups_per_step": 4, "group_size": 2, "sampling": {"max_new_tokens": 0}, "total_steps": total_steps,
        "max_staleness": 0, "eval": {"every": 2, "prompts": 2, "samples": 2}, "checkpoint_every": 0})
    cfg_cls, _ = registry.load("trainer")
    return load_service_config("trainer", cfg_cls, cfg)


async def _stand_in(nc, tickets: list[PromptTicket]) -> None:
    js = nc.jetstream()

    async def answer(msg) -> None:
        ticket = codec.decode(msg.data, PromptTicket)
        tickets.append(ticket)
        for i in range(ticket.group_size):
            turn = Turn(role="assistant", token_ids=[5, 6], logprobs=[-1.0, -1.5],
                        versions=[ticket.policy_version] * 2, text="x")
            rollout = Rollout(run_id=RUN, task=ticket.task, group_id=ticket.group_id, prompt_id=ticket.prompt_id,
                              sample_index=i, group_size=ticket.group_size, prompt_ids=ticket.prompt_ids,
                              prompt_text=ticket.prompt_text, turns=[turn], finish_reason="eos",
                              policy_version=ticket.policy_version, is_eval=ticket.is_eval)
            traj = ScoredTrajectory(run_id=RUN, rollout=rollout, reward=REWARD[ticket.task](i))
            traj.msg_id = f"{ticket.group_id}-v{ticket.policy_version}-{i}"
            await js.publish(f"rlbus.{RUN}.trajectories", codec.encode(traj), headers={"Nats-Msg-Id": traj.msg_id})

    await nc.subscribe(f"rlbus.{RUN}.prompts", cb=answer)


async def _saved_state(js) -> TrainerState | None:
    return await load_from_kv(await bus.ensure_kv(js, catalog.RUNS), RUN)


@pytest.mark.slow
async def test_a_mixture_trains_reports_and_resumes_per_environment(nats_url, tmp_path, loop_model_dir):
    data = tmp_path / "doubles.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "answer": str(2 * a)}) + "\n" for a in range(10, 60)))
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    tickets: list[PromptTicket] = []
    await _stand_in(nc, tickets)
    factory = registry.load("trainer")[1]

    # 1. train, stop after step 3 (its state saved), then restart to finish 6 steps
    loaded = _config(tmp_path, nats_url, loop_model_dir, data, 20)
    stop = asyncio.Event()
    first = asyncio.create_task(service.serve("trainer", factory, loaded, "trainer-0", stop=stop))

    async def at_step_3() -> bool:
        assert not first.done(), "the trainer stopped before step 3"
        st = await _saved_state(js)
        return st is not None and st.step >= 3

    await wait_for_async(at_step_3, 240, "the trainer's saved state to reach step 3")
    stop.set()
    assert await asyncio.wait_for(first, 60) == 0
    stopped = await _saved_state(js)
    assert stopped is not None and 3 <= stopped.step < 6
    before = len(tickets)
    code = await asyncio.wait_for(service.serve("trainer", factory, _config(tmp_path, nats_url, loop_model_dir,
                                                                            data, 6), "trainer-1"), 240)
    assert code == 0
    done = await _saved_state(js)
    assert done is not None and done.state == "finished" and done.step == 6
    assert any(not t.is_eval for t in tickets[before:]), "the restarted trainer issued no training ticket"

    # 2. every training ticket is the prompt of its position in the uninterrupted seeded stream, in its
    # environment, with that environment's budget
    stream = list(itertools.islice(Mixture.build(loaded.task).train_prompts(loaded.run.seed), done.data_position))
    train = {t.group_id: t for t in tickets if not t.is_eval}  # a redelivered copy is the same ticket
    assert len(train) == done.data_position
    for group_id, t in train.items():
        expected = stream[int(group_id[1:])]
        assert (t.task, t.prompt_id, t.prompt_text) == (expected.env, expected.id, expected.text), group_id
        assert t.sampling.max_new_tokens == {"addition": 6, "dataset": 3}[t.task]
    envs = [t.task for t in train.values()]
    assert set(envs) == {"addition", "dataset"} and envs.count("addition") > envs.count("dataset")

    # 3. per-environment figures: each step's rewards and shares, each round's means
    steps = trainer_records(tmp_path / "run" / "metrics.jsonl")
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len({r["step"] for r in steps}) == 6
    for r in steps:
        shares = {env: r.get(f"train/{env}/share", 0.0) for env in ("addition", "dataset")}
        assert sum(shares.values()) == pytest.approx(1.0)
        for env, share in shares.items():
            if share:
                assert r[f"train/{env}/reward_mean"] == pytest.approx({"addition": 0.5, "dataset": 0.25}[env])
                assert r[f"train/{env}/samples"] == pytest.approx(share * sum(
                    r.get(f"train/{e}/samples", 0.0) for e in shares))
    assert any("train/dataset/share" in r for r in steps) and any("train/addition/share" in r for r in steps)
    rounds = [r for r in records if "eval/reward" in r]
    assert rounds
    for r in rounds:  # 2 prompts of each environment, 2 samples each
        assert (r["eval/addition/reward"], r["eval/dataset/reward"]) == (0.5, 0.25)
        assert r["eval/reward"] == pytest.approx((0.5 * 4 + 0.25 * 4) / 8)
    evals = [t for t in tickets if t.is_eval]
    assert {t.task for t in evals} == {"addition", "dataset"}
    await nc.close()
