"""Distillation with no teacher running: the judge waits ``distill.wait_s`` (asking again), then publishes the
group's training samples failed with the reason (the trainer drops them with it, never training on missing
teacher logprobs), keeps their graders' scores, and goes on serving; evaluation samples need no teacher.

Real judge service against a real nats-server; no teacher service.
"""

from __future__ import annotations

import asyncio

from proto import catalog, codec
from proto.rollouts import Rollout, Turn
from proto.trajectories import ScoredTrajectory
from services.launcher import registry
from services.launcher.accounting import read_channel
from services.runtime import bus, service
from services.runtime.config import load_service_config
from tests.conftest import wait_for_async

RUN = "noteacher"


def _rollout(msg_id: str, group: str, is_eval: bool) -> Rollout:
    r = Rollout(run_id=RUN, task="addition", group_id=group, prompt_id="p", sample_index=0, group_size=1,
                prompt_ids=[1, 2], turns=[Turn(role="assistant", token_ids=[3], logprobs=[-0.1], versions=[0],
                                               text="47")],
                finish_reason="eos", policy_version=0, metadata={"answer": "47"}, prompt_text="12+35=",
                is_eval=is_eval)
    r.msg_id = msg_id
    return r


async def test_without_a_teacher_training_samples_are_published_failed_after_wait_s(nats_url, tmp_path):
    import nats

    cfg = tmp_path / "run.toml"
    cfg.write_text(f'[run]\nid = "{RUN}"\ndir = "{tmp_path / "run"}"\n[nats]\nurl = "{nats_url}"\n'
                   '[distill]\nenabled = true\nwait_s = 1.0\nrequest_timeout_s = 0.5\n')
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    await bus.provision_all(js)
    for msg_id, group, is_eval in (("train-1", "g1", False), ("eval-1", "eval-g", True), ("train-2", "g2", False)):
        await js.publish(f"rlbus.{RUN}.rollouts", codec.encode(_rollout(msg_id, group, is_eval)))

    cfg_cls, factory = registry.load("judge")
    stop = asyncio.Event()
    judge = asyncio.create_task(service.serve("judge", factory, load_service_config("judge", cfg_cls, cfg),
                                              "judge-0", stop=stop))
    try:
        async def published() -> list[ScoredTrajectory]:
            got = await read_channel(js, catalog.TRAJECTORIES, RUN)
            return got if len(got) == 3 else []

        trajectories = await wait_for_async(published, 120, "three scored trajectories")
    finally:
        stop.set()
        code = await asyncio.wait_for(judge, 120)
        await nc.close()
    assert code == 0
    by_id = {t.rollout.msg_id: t for t in trajectories}
    for msg_id in ("train-1", "train-2"):
        t = by_id[msg_id]
        assert (t.rollout.error or "").startswith("teacher logprobs unavailable: no teacher logprobs after 1s ("), \
            t.rollout.error
        assert "distill.wait_s): no teacher service is running" in t.rollout.error
        assert t.teacher_logprobs is None and t.reward == 1.0  # the graders' verdict stands, for the record
    assert by_id["eval-1"].rollout.error is None and by_id["eval-1"].teacher_logprobs is None
