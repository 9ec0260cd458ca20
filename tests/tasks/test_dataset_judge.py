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
