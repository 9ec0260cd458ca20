"""Dataset rewards are user code: the judge's real worker processes run them, bounded (no mocks)."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from services.judge.config import UserCodeConfig
from services.judge.user_code import ProcessUserCode
from services.tasks import Prompt, get_task
from services.tasks.graders import UserCodeError


@pytest.fixture
def rewards_module(tmp_path, monkeypatch):
    (tmp_path / "judge_rewards_18.py").write_text(textwrap.dedent("""
        def half(prompt, completion, **fields):
            return 0.5

        def hang(prompt, completion, **fields):
            while True:
                pass

        def echo_long(prompt, completion, **fields):  # a reply as large as what it was sent
            from services.tasks.base import Reward
            return Reward(float(completion == fields["answer"]), completion)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))  # the judge hands its sys.path to its workers
    yield "judge_rewards_18"
    sys.modules.pop("judge_rewards_18", None)


async def test_rewards_run_in_the_judges_worker_processes_bounded(tmp_path, rewards_module):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+1=", "answer": str(a + 1)}) + "\n" for a in range(20)))
    cases = {"ok": f"exact_match, {rewards_module}:half", "hangs": f"{rewards_module}:hang",
             "missing": f"{rewards_module}:nope"}
    results = {}
    for case, reward in cases.items():
        options = {"path": str(data), "reward": reward}
        judge_task = get_task("dataset", **options)  # the judge's own process: no data read, no user import
        assert "rewards" not in vars(judge_task) and "_split" not in vars(judge_task)
        # the prompt as the trainer sends it (built without the rewards: a trainer would refuse 'missing')
        prompt = get_task("dataset", path=str(data)).eval_prompts()[0]
        prompt = Prompt(id=prompt.id, text=prompt.text, metadata={**prompt.metadata, "reward": judge_task.reward_spec})
        runner = ProcessUserCode(UserCodeConfig(workers=1, timeout_s=5.0), {"dataset": options})
        try:
            results[case] = await runner.call("dataset", judge_task, "reward", prompt, prompt.answer)
        except UserCodeError as e:
            results[case] = e
        finally:
            await runner.close()
    assert results["ok"].value == pytest.approx(0.75) and "exact_match=1" in results["ok"].explanation
    assert isinstance(results["hangs"], UserCodeError) and results["hangs"].kind == "timeout"
    assert isinstance(results["missing"], UserCodeError) and results["missing"].kind == "exception"
    assert "task.options.reward" in str(results["missing"]) and "has no 'nope'" in str(results["missing"])


async def test_a_one_megabyte_answer_and_completion_reach_the_reward_and_its_reply_comes_back_whole(
        tmp_path, rewards_module):
    """Frames far past a pipe's 64 KiB go whole both ways: 1 MB answer + 1 MB completion to the worker, a
    1 MB explanation back (an unbuffered pipe's single read returned a short frame: 'pickle data was
    truncated', blamed on the reward)."""
    answer = "7" * 1_000_000
    data = tmp_path / "big.jsonl"
    data.write_text(json.dumps({"prompt": "say 7 a million times", "answer": answer}) + "\n")
    for reward, expected_value in [("exact_match", 1.0), (f"{rewards_module}:echo_long", 1.0)]:
        options = {"path": str(data), "reward": reward, "eval_fraction": 0.0}
        trainer_task = get_task("dataset", **options)
        prompt = next(trainer_task.train_prompts(seed=0))
        runner = ProcessUserCode(UserCodeConfig(workers=1, timeout_s=60.0), {"dataset": options})
        try:
            r = await runner.call("dataset", get_task("dataset", **options), "reward", prompt, answer)
            wrong = await runner.call("dataset", get_task("dataset", **options), "reward", prompt, answer[:-1] + "8")
        finally:
            await runner.close()
        assert r.value == expected_value, (reward, r.explanation[:200])
        assert wrong.value == 0.0
        assert runner.restarts == 0  # the worker took both calls: the protocol stayed in step
        if reward != "exact_match":
            assert r.explanation == f"{reward}=1 ({answer})"  # the 1 MB reply, whole
