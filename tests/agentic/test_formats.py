"""Pure pieces: the tool-call parser, the observation frame, the coding task, the example's config."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from agentic_harness import chat_tokenizer, coding_prompt

from services.judge.config import JudgeConfig
from services.launcher import registry
from services.rollout.agent import ChatFrame
from services.runtime.config import load_service_config
from services.tasks import get_task
from services.tasks.coding import RUNNER, CodingTask
from services.tasks.grader_specs import LlmJudgeSpec, RewardGraderSpec, SandboxTestsSpec
from services.tasks.graders import score_test_run
from services.tasks.tools import NotATool, ToolCall, is_agent_task, parse_tool_call

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


@pytest.mark.parametrize("text,call", [
    ("Here:\n```python file=solution.py\ndef f(x):\n    return x\n```\n",
     ToolCall(tool="write", path="solution.py", body="def f(x):\n    return x\n")),
    ("```py\nprint(1)\n```", ToolCall(tool="python", body="print(1)")),
    ("Run:\n```bash\nls -l\n```\nmore text after", ToolCall(tool="bash", body="ls -l")),
    ("```sh\n```\n", ToolCall(tool="bash", body="")),
    ("```text path=notes.md\nhello\n```\n", ToolCall(tool="write", path="notes.md", body="hello\n")),
    ("```output\n42\n```\n", NotATool(language="output")),
    ("```\nbare fence\n```\n", NotATool(language="(none)")),
    ("The answer is 4.", None),
    ("```python\ndef f(x):\n    return", None),  # cut by the token limit: no complete call
])
def test_tool_call_parser(text, call):
    assert parse_tool_call(text) == call


def test_disabled_tools_are_not_calls():
    assert parse_tool_call("```bash\nls\n```\n", tools=("python",)) == NotATool(language="bash")
    assert parse_tool_call("```python file=a.py\nx = 1\n```\n", tools=("python",)) == ToolCall(tool="python",
                                                                                                body="x = 1")


def test_observation_frame_follows_the_chat_template(tokenizer):
    frame = ChatFrame(tokenizer, "user")
    eos = tokenizer.eos_token_id
    after_eos, text = frame.observation([5, eos], "exit code 0")
    assert tokenizer.decode(after_eos, skip_special_tokens=False) == \
        "\n<|im_start|>user\nexit code 0<|im_end|>\n<|im_start|>assistant\n"
    assert text == "\nuser\nexit code 0\nassistant\n"
    after_stop, _ = frame.observation([5, 6], "x")  # stopped by a stop string: the message is closed first
    assert tokenizer.decode(after_stop, skip_special_tokens=False).startswith("<|im_end|>\n<|im_start|>user\nx")
    # tokenizers without a chat template get a plain-text frame
    plain = chat_tokenizer()
    plain.chat_template = None
    ids, _ = ChatFrame(plain).observation([5], "out")
    assert plain.decode(ids) == "\n\n[output]\nout\n[/output]\n\n"


def test_coding_task_is_agentic_with_disjoint_splits_and_a_submission_rule(tokenizer):
    task = get_task("coding", num_eval=8)
    assert is_agent_task(task) and isinstance(task, CodingTask)
    evals = task.eval_prompts()
    assert len(evals) == 8 and evals == task.eval_prompts()
    eval_functions = {p.metadata["function"] for p in evals}
    stream = task.train_prompts(seed=1)
    train = [next(stream) for _ in range(200)]
    assert not eval_functions & {p.metadata["function"] for p in train}
    assert next(task.train_prompts(seed=1, start=5)) == train[5]
    ids = task.format_prompt(tokenizer, evals[0])
    assert tokenizer.decode(ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    assert "```python file=solution.py" in evals[0].messages[0]["content"]

    p = coding_prompt()
    texts = ["```python\ndef add_2(x):\n    return 0\n```", "Better:\n```python\ndef add_2(x):\n    return x + 2\n```"]
    assert task.submission_files(p, texts, set()) == {"solution.py": b"def add_2(x):\n    return x + 2\n"}
    assert task.submission_files(p, texts, {"solution.py"}) == {}  # the agent wrote its own
    assert task.submission_files(p, ["no code"], set()) == {}
    assert task.reward(p, texts[1]).value == 1.0 and task.reward(p, "def add_2(x): pass").value == 0.0


def test_hidden_test_runner_scores_outside_a_sandbox_too(tmp_path):
    task = get_task("coding")
    tests = task.hidden_tests(coding_prompt())
    assert b"[[1], 3]" not in tests.files[RUNNER]
    assert json.loads(tests.stdin)["cases"] == [[[1], 3], [[5], 7], [[-2], 0]]  # answers travel on stdin only
    (tmp_path / RUNNER).parent.mkdir(parents=True)
    (tmp_path / RUNNER).write_bytes(tests.files[RUNNER])
    (tmp_path / "solution.py").write_text("def add_2(x):\n    return x + 2 if x > 0 else 7\n")
    run = subprocess.run([sys.executable, RUNNER], cwd=tmp_path, input=tests.stdin, capture_output=True)
    from proto.sandbox import ExecReply

    reply = ExecReply(run_id="r", sandbox_id="s", exec_id="e", exit_code=run.returncode, stdout=run.stdout,
                      stderr=run.stderr)
    score, why = score_test_run(reply)
    assert score == pytest.approx(2 / 3) and "add_2(-2) returned 7, expected 0" in why


def test_the_example_config_parses_for_every_service():
    path = os.path.join(REPO, "examples", "coding.toml")
    for name in ("trainer", "rollout", "judge", "sandbox"):
        cls, _ = registry.load(name)
        load_service_config(name, cls, path)
    judge: JudgeConfig = load_service_config("judge", JudgeConfig, path).service
    assert [type(g) for g in judge.graders["coding"]] == [SandboxTestsSpec, RewardGraderSpec]
    rollout = load_service_config("rollout", registry.load("rollout")[0], path)
    assert rollout.service.agent.max_turns >= 2 and rollout.model.name == "smollm2"
    spec = load_service_config("judge", JudgeConfig, None, overrides=[
        'services.judge.graders={coding=[{type="llm_judge",rubric="r",judge={type="openai",base_url="http://x/v1",'
        'model="m"}}]}']).service.graders["coding"][0]
    assert isinstance(spec, LlmJudgeSpec) and spec.judge.model == "m"
