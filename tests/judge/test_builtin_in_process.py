"""rlbus's own bounded rewards run in the judge itself (``[services.judge.user_code] builtin_in_process``);
everything else runs in real worker processes. Graded through the judge's grader factory as the service does."""

from __future__ import annotations

import pytest

from services.judge.config import UserCodeConfig
from services.judge.user_code import ProcessUserCode, bounded_builtin
from services.tasks import get_task
from services.tasks.addition import AdditionTask
from services.tasks.grader_specs import RewardGraderSpec
from services.tasks.graders import GraderFactory, UserCodeError, grade_all
from services.tasks.judge_backends import JudgeCache
from tests.judge.flaky_task import FlakyAddition
from tests.judge.test_user_code import PROMPTS, rollout


class InheritsTheReward(AdditionTask):  # another module's task that keeps the builtin reward unchanged
    name = "inherits"


class OverridesTheReward(AdditionTask):  # ... and one that replaces it (and so must not inherit the flag)
    name = "overrides"

    def reward(self, prompt, completion):  # noqa: ANN001, ANN201 - the Task protocol's
        return super().reward(prompt, completion)


def test_only_a_builtin_class_that_defines_and_declares_its_reward_is_bounded():
    assert bounded_builtin(get_task("addition"), "reward")
    assert bounded_builtin(get_task("word_problems"), "reward")
    assert bounded_builtin(InheritsTheReward(), "reward")
    assert not bounded_builtin(OverridesTheReward(), "reward")
    assert not bounded_builtin(FlakyAddition(), "reward")  # a plugin's subclass, its own reward
    assert not bounded_builtin(get_task("addition"), "hidden_tests")  # only the reward
    assert not bounded_builtin(get_task("coding"), "reward")  # builtin, not declared


@pytest.mark.parametrize("in_process", [True, False])
async def test_the_addition_reward_grades_the_same_in_the_judge_and_in_a_worker(in_process):
    pool = ProcessUserCode(UserCodeConfig(workers=1, builtin_in_process=in_process), {})
    task = get_task("addition")
    graders = GraderFactory(None, JudgeCache(), user_code=pool).build("addition", [RewardGraderSpec()])
    try:
        right = await grade_all(graders, rollout(PROMPTS["ok"], " 47 ", task="addition"), task)
        wrong = await grade_all(graders, rollout(PROMPTS["ok"], "46", task="addition"), task)
        assert (right.failure, right.reward, wrong.failure, wrong.reward) == (None, 1.0, None, 0.0)
        if in_process:  # no worker was started for them
            assert (pool.in_process, pool.calls) == (2, 0) and all(w.proc is None for w in pool.workers)
        else:
            assert (pool.in_process, pool.calls) == (0, 2)
    finally:
        await pool.close()


async def test_a_plugin_overriding_the_builtin_reward_still_runs_in_a_worker_and_is_bounded_there():
    pool = ProcessUserCode(UserCodeConfig(workers=1, timeout_s=2.0), {})
    task = get_task("flaky-addition")
    graders = GraderFactory(None, JudgeCache(), user_code=pool).build("flaky-addition", [RewardGraderSpec()])
    try:
        hung = await grade_all(graders, rollout(PROMPTS["hang"], "47"), task)
        assert hung.failure is not None and "did not return within 2" in hung.failure, hung.failure
        assert pool.in_process == 0 and pool.calls == 1
    finally:
        await pool.close()


async def test_an_exception_in_an_in_process_reward_is_the_samples_failure():
    pool = ProcessUserCode(UserCodeConfig(workers=1), {})
    task = get_task("addition")
    prompt = next(task.train_prompts(seed=0))
    try:
        with pytest.raises(UserCodeError) as e:
            await pool.call("addition", task, "reward", prompt, None, scope="g")  # not a str: .strip() fails
        assert e.value.kind == "exception" and "AttributeError" in str(e.value)
        assert pool.calls == 0
    finally:
        await pool.close()
