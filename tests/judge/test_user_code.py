"""User code (a task's reward function) runs bounded: in worker processes, with a per-call timeout.

Real worker processes run a real task plugin (``flaky_task.py``) whose reward hangs, raises, returns NaN or
2.0, or kills its process on some prompts; the judge service runs against a real nats-server.
"""

from __future__ import annotations

import asyncio
import os
import time

import msgspec
import nats

from proto import catalog, codec
from proto.deadletter import DeadLetter
from proto.rollouts import Rollout, Turn
from proto.trajectories import ScoredTrajectory
from services.judge.config import UserCodeConfig
from services.judge.user_code import STUCK_NICE, ProcessUserCode
from services.launcher import registry
from services.launcher.accounting import read_all, read_channel
from services.runtime import bus, service
from services.runtime.config import load_service_config
from services.tasks import get_task
from services.tasks.grader_specs import RewardGraderSpec
from services.tasks.graders import GraderFactory, grade_all
from services.tasks.judge_backends import JudgeCache
from tests.conftest import wait_for_async
from tests.judge.flaky_task import behaviour

RUN = "usercode"

# a prompt for each behaviour of the flaky reward (its position modulo 10 picks it); the text is "12+35="
PROMPTS = {"ok": "t/0", "hang": "t/1", "raise": "t/2", "nan": "t/3", "out_of_range": "t/4", "die": "t/5",
           "print": "t/16"}


def rollout(prompt_id: str, answer: str, task: str = "flaky-addition", msg_id: str = "r-1") -> Rollout:
    prompt_text = "12+35="
    a, b = prompt_text.rstrip("=").split("+")
    r = Rollout(run_id=RUN, task=task, group_id="g", prompt_id=prompt_id, sample_index=0, group_size=1,
                prompt_ids=[1, 2], turns=[Turn(role="assistant", token_ids=[3], logprobs=[-0.1], versions=[0],
                                               text=answer)],
                finish_reason="eos", policy_version=0, metadata={"answer": str(int(a) + int(b))},
                prompt_text=prompt_text)
    r.msg_id = msg_id
    return r


async def test_every_failure_of_the_reward_fails_the_sample_with_its_reason_and_the_loop_keeps_running():
    assert {behaviour(p) for p in PROMPTS.values()} == set(PROMPTS)
    pool = ProcessUserCode(UserCodeConfig(workers=1, timeout_s=3.0), {})
    task = get_task("flaky-addition")
    graders = GraderFactory(None, JudgeCache(), user_code=pool).build("flaky-addition", [RewardGraderSpec()])
    ticks = 0

    async def ticker() -> None:  # stands for the heartbeat: it must keep running while user code hangs
        nonlocal ticks
        while True:
            await asyncio.sleep(0.05)
            ticks += 1

    t = asyncio.create_task(ticker(), name="ticker")
    try:
        ok = await grade_all(graders, rollout(PROMPTS["ok"], "47"), task)  # also starts the worker
        assert ok.failure is None and ok.reward == 1.0
        results = {}
        for what in ("hang", "raise", "nan", "out_of_range", "die"):
            before_ticks, t0 = ticks, time.monotonic()
            results[what] = await grade_all(graders, rollout(PROMPTS[what], "0"), task)
            if what == "hang":
                hang_s, hang_ticks = time.monotonic() - t0, ticks - before_ticks
        # the worker was replaced after the hang and after the death: a good sample still scores
        after = await grade_all(graders, rollout(PROMPTS["ok"], "47"), task)
        assert after.failure is None and after.reward == 1.0
    finally:
        t.cancel()
        await pool.close()

    assert hang_s >= 3.0  # the call ran to its timeout ...
    assert hang_ticks >= 3, f"the event loop ticked only {hang_ticks} times in {hang_s:.1f} s of a hung reward"
    expected = {
        "hang": ("timeout", "reward() did not return within 3 s (its worker process was killed)"),
        "raise": ("exception", "reward() raised ValueError: cannot grade '0'"),
        "nan": ("bad_value", "reward() returned nan (not a finite number)"),
        "out_of_range": ("out_of_range", "reward() returned 2, outside the task's range [0, 1]"),
        # how it died is as the kernel reported it to asyncio (SIGKILL; asyncio says 255 when it lost the status)
        "die": ("crash", "reward() killed its worker process ("),
    }
    for what, (kind, reason) in expected.items():
        g = results[what]
        assert g.failure_kind == kind and g.failure.startswith(f"flaky-addition.reward: {reason}"), (what, g)
        assert g.reward == 0.0 and g.scores[0].error.startswith(reason)
        assert g.scores[0].grader == "flaky-addition.reward"
    assert pool.restarts == 2  # after the hang and after the death


async def test_a_skipping_grader_leaves_a_failed_reward_out_instead_of_failing_the_sample():
    pool = ProcessUserCode(UserCodeConfig(workers=1, timeout_s=30.0), {})
    task = get_task("flaky-addition")
    factory = GraderFactory(None, JudgeCache(), user_code=pool)
    graders = factory.build("flaky-addition", [RewardGraderSpec(name="strict"),
                                               RewardGraderSpec(name="lenient", on_error="skip")])
    try:
        g = await grade_all(graders[1:], rollout(PROMPTS["raise"], "0"), task)
        assert g.failure is None and g.reward == 0.0 and "ValueError" in g.scores[0].error
        g = await grade_all(graders, rollout(PROMPTS["raise"], "0"), task)
        assert g.failure == "strict: reward() raised ValueError: cannot grade '0'"
    finally:
        await pool.close()


async def test_a_reward_that_prints_does_not_break_the_worker_protocol():
    # the worker's fd 1 is its stderr: what user code prints lands in the judge's log, not in the pipe
    pool = ProcessUserCode(UserCodeConfig(workers=1), {})
    task = get_task("flaky-addition")
    graders = GraderFactory(None, JudgeCache(), user_code=pool).build("flaky-addition", [RewardGraderSpec()])
    try:
        for _ in range(2):
            g = await grade_all(graders, rollout(PROMPTS["print"], "47"), task)
            assert g.failure is None and g.reward == 1.0
    finally:
        await pool.close()


async def test_a_rollout_that_hung_or_killed_judges_is_published_failed_and_dead_lettered(nats_url, tmp_path):
    """Delivery ``poison_after_deliveries + 1`` is not graded: the sample is published as failed (the trainer
    drops it with the reason) and the message is dead-lettered. Earlier deliveries that were never settled
    (judges that died or hung) are played by this test: it takes the message from the judges' durable
    consumer and naks it, which is what JetStream's redelivery after ``ack_wait`` amounts to."""
    cfg = tmp_path / "run.toml"
    cfg.write_text(f'[run]\nid = "{RUN}"\ndir = "{tmp_path / "run"}"\n[nats]\nurl = "{nats_url}"\n'
                   '[services.judge]\npoison_after_deliveries = 2\n')
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    await bus.provision_all(js)
    await bus.ensure_consumer(js, catalog.ROLLOUTS.consumer.for_run(RUN))
    r = rollout(PROMPTS["ok"], "47", task="addition", msg_id="poisoned")
    await js.publish(f"rlbus.{RUN}.rollouts", codec.encode(r))
    psub = await js.pull_subscribe_bind(durable=f"judge-{RUN}", stream="ROLLOUTS")
    for _ in range(2):
        (m,) = await psub.fetch(1, timeout=30)
        await m.nak()
    await psub.unsubscribe()

    cfg_cls, factory = registry.load("judge")
    loaded = load_service_config("judge", cfg_cls, cfg)
    stop = asyncio.Event()
    judge = asyncio.create_task(service.serve("judge", factory, loaded, "judge-0", stop=stop))
    try:
        async def published() -> list[ScoredTrajectory]:
            return await read_channel(js, catalog.TRAJECTORIES, RUN)

        (traj,) = await wait_for_async(published, 120, "the failed trajectory")
        letters = await wait_for_async(lambda: read_all(js, "DLQ", f"rlbus.{RUN}.dlq.>", DeadLetter), 60,
                                       "the dead letter")
    finally:
        stop.set()
        code = await asyncio.wait_for(judge, 120)
        await nc.close()
    assert code == 0
    assert traj.reward == 0.0 and traj.rollout.msg_id == "poisoned"
    assert traj.rollout.error == ("grading failed: delivered 3 times without being settled (it killed or hung "
                                  "a judge each time; poison_after_deliveries = 2)")
    (letter,) = letters
    assert letter.deliveries == 3 and letter.error_type == "Poison" and "published as failed" in letter.reason
    assert msgspec.convert(codec.decode(letter.payload, Rollout), Rollout).msg_id == "poisoned"


async def test_a_hung_group_fails_its_other_samples_at_once_and_other_groups_are_served_meanwhile():
    """The samples of a group share their prompt: its first call probes, and once it times out the rest of the
    group fail at once with the reason instead of each holding a worker for ``timeout_s``; while the hung
    call waits out its timeout (deprioritised), the pool grows, so another group's reward is served."""
    pool = ProcessUserCode(UserCodeConfig(workers=1, timeout_s=15.0, grow_after_s=0.2), {})
    task = get_task("flaky-addition")
    graders = GraderFactory(None, JudgeCache(), user_code=pool).build("flaky-addition", [RewardGraderSpec()])

    def group(prompt_id: str, group_id: str, answer: str, n: int = 4) -> list[Rollout]:
        out = []
        for i in range(n):
            r = rollout(prompt_id, answer, msg_id=f"{group_id}-{i}")
            out.append(msgspec.structs.replace(r, group_id=group_id, sample_index=i, group_size=n))
        return out

    try:
        assert (await grade_all(graders, rollout(PROMPTS["ok"], "47"), task)).reward == 1.0  # starts worker 0
        hung = asyncio.ensure_future(asyncio.gather(*(grade_all(graders, r, task)
                                                      for r in group(PROMPTS["hang"], "g-hang", "0"))))
        stuck = pool.workers[0]
        await wait_for_async(lambda: stuck.niced, 10.0, "the probe's worker to be deprioritised")
        assert stuck.busy_since is not None  # the probe holds the only worker ...
        # ... at the lowest CPU priority, so its spinning takes only idle CPU from the host's services
        assert os.getpriority(os.PRIO_PROCESS, stuck.proc.pid) == STUCK_NICE
        served = await asyncio.gather(*(grade_all(graders, r, task) for r in group(PROMPTS["ok"], "g-ok", "47")))
        # the good group was scored by a worker the pool grew, while the hung probe still held worker 0
        assert not hung.done() and [g.reward for g in served] == [1.0] * 4 and pool.grown >= 1
        results = await hung
    finally:
        await pool.close()
    first, *rest = results
    assert first.failure_kind == "timeout"
    assert first.failure == "flaky-addition.reward: reward() did not return within 15 s (its worker process was killed)"
    for g in rest:  # failed at once: never called, no worker killed for them
        assert g.failure_kind == "timeout" and g.reward == 0.0
        assert g.failure == ("flaky-addition.reward: reward() was not called: it did not return within 15 s for "
                             "another sample of this group (same prompt)")
    assert pool.group_failed == 3
