"""A task the judge cannot build from its options poisons the rollout: published failed with the reason (the
trainer drops it) and dead-lettered at the first delivery, never redelivered; the judge keeps serving.

Real judge service against a real nats-server; the task is the built-in addition task given options it
refuses (``low > high``).
"""

from __future__ import annotations

import asyncio

from proto import catalog, codec
from proto.deadletter import DeadLetter
from proto.rollouts import Rollout, Turn
from proto.trajectories import ScoredTrajectory
from services.launcher import registry
from services.launcher.accounting import read_all, read_channel
from services.runtime import bus, service
from services.runtime.config import load_service_config
from tests.conftest import wait_for_async

RUN = "badtask"


def _rollout(msg_id: str, task: str) -> Rollout:
    r = Rollout(run_id=RUN, task=task, group_id="g", prompt_id="p", sample_index=0, group_size=1,
                prompt_ids=[1, 2], turns=[Turn(role="assistant", token_ids=[3], logprobs=[-0.1], versions=[0],
                                               text="47")],
                finish_reason="eos", policy_version=0, metadata={"answer": "47"}, prompt_text="12+35=")
    r.msg_id = msg_id
    return r


async def test_a_task_that_fails_to_build_poisons_its_rollouts_and_the_judge_keeps_serving(nats_url, tmp_path):
    import nats

    cfg = tmp_path / "run.toml"
    cfg.write_text(f'[run]\nid = "{RUN}"\ndir = "{tmp_path / "run"}"\n[nats]\nurl = "{nats_url}"\n'
                   '[task]\nname = "addition"\noptions = { low = 50, high = 10 }\n')
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    await bus.provision_all(js)
    for msg_id, task in (("bad-1", "addition"), ("bad-2", "addition"), ("good", "word_problems")):
        await js.publish(f"rlbus.{RUN}.rollouts", codec.encode(_rollout(msg_id, task)))

    cfg_cls, factory = registry.load("judge")
    stop = asyncio.Event()
    judge = asyncio.create_task(service.serve("judge", factory, load_service_config("judge", cfg_cls, cfg),
                                              "judge-0", stop=stop))
    try:
        async def published() -> list[ScoredTrajectory]:
            got = await read_channel(js, catalog.TRAJECTORIES, RUN)
            return got if len(got) == 3 else []

        trajectories = await wait_for_async(published, 120, "three scored trajectories")
        letters = await wait_for_async(
            lambda: _two(read_all(js, "DLQ", f"rlbus.{RUN}.dlq.>", DeadLetter)), 60, "two dead letters")
        info = await js.consumer_info("ROLLOUTS", catalog.ROLLOUTS.consumer.for_run(RUN).durable)
    finally:
        stop.set()
        code = await asyncio.wait_for(judge, 120)
        await nc.close()
    assert code == 0
    by_id = {t.rollout.msg_id: t for t in trajectories}
    for msg_id in ("bad-1", "bad-2"):
        error = by_id[msg_id].rollout.error or ""
        assert by_id[msg_id].reward == 0.0
        assert error.startswith("grading failed: task 'addition' cannot be built from "
                                "[task.options]: TaskOptionError:"), error
        assert "low=50, high=10" in error
    assert by_id["good"].rollout.error is None  # another task of the same judge is unaffected
    assert sorted(codec.decode(letter.payload, Rollout).msg_id for letter in letters) == ["bad-1", "bad-2"]
    assert all(letter.deliveries == 1 and letter.error_type == "Poison" and "published as failed" in letter.reason
               for letter in letters)
    assert info.num_pending == 0 and info.num_ack_pending == 0  # nothing left to redeliver


async def _two(letters):
    got = await letters
    return got if len(got) == 2 else []
