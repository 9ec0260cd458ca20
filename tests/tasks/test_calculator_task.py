"""The word_problems_calculator environment (its tool, prompts, turns, reward) and [model] chat_template."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from test_word_problems import solve

from services.launcher.runfile import RunFile
from services.lib.chat_template import read_chat_template, render, use_chat_template
from services.runtime.config import ConfigError
from services.tasks import available_tasks, get_task
from services.tasks.calculator import DEMO, SYSTEM_PROMPT, CalculatorWordProblems, calculator
from services.tasks.env import Action, ToolResult, tool_schemas

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = REPO / "examples" / "chat_templates" / "chatml_tools.jinja"
#: SmolLM2-135M-Instruct's own chat template (as its tokenizer carries it)
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "18 - 11 + 9"}}</tool_call>'


@pytest.mark.parametrize(("expression", "value"), [("(12 - 5) * 3", 21), ("7/2", 3.5), ("-4 + 2", -2),
                                                    (" 6*7 ", 42), ("10 / 4 * 2", 5), ("1/3", 0.333333)])
def test_the_calculator_evaluates_arithmetic(expression, value):
    result = calculator(expression)
    assert result == value and type(result) is type(value)


@pytest.mark.parametrize(("expression", "message"), [
    ("1/0", "division by zero"), ("__import__('os')", "only numbers"), ("2 ** 10", "only numbers"),
    ("1 +", "not an arithmetic expression"), ("1" * 201, "longer than 200"), ("99999999 * 99999999", "too large"),
    ("True + 1", "only numbers"), ("x", "only numbers")])
def test_the_calculator_refuses_what_is_not_arithmetic(expression, message):
    with pytest.raises(ValueError, match=message):
        calculator(expression)


def test_the_environment_is_a_registered_task_with_word_problems_and_the_tool():
    assert "word_problems_calculator" in available_tasks()
    task = get_task("word_problems_calculator")
    assert isinstance(task, CalculatorWordProblems) and list(task.tools) == [calculator]
    assert tool_schemas(task.tools)[0]["function"]["name"] == "calculator"
    evals = task.eval_prompts()
    assert len(evals) == 200 and len({p.id for p in evals}) == 200
    assert evals[0].id == "word_problems_calculator/eval/0"
    for prompt in [*evals[:50], *itertools.islice(task.train_prompts(seed=3, start=10), 50)]:
        assert prompt.answer == str(solve(prompt.text))
        assert prompt.messages == [{"role": "system", "content": SYSTEM_PROMPT},
                                   {"role": "user", "content": prompt.text}]
    first = next(task.train_prompts(seed=3, start=10))
    assert first.id == "word_problems_calculator/train/3/10" and first.text not in {p.text for p in evals}


def test_the_demo_option_puts_a_worked_example_before_the_question():
    prompt = get_task("word_problems_calculator", demo=True, system_prompt="S").eval_prompts()[0]
    assert prompt.messages == [{"role": "system", "content": "S"}, *DEMO, {"role": "user", "content": prompt.text}]


@pytest.mark.parametrize("bad", [-0.1, 1.5])
def test_a_call_reward_out_of_bounds_names_its_key(bad):
    with pytest.raises(ConfigError, match="task.options.call_reward"):
        get_task("word_problems_calculator", call_reward=bad)


def test_a_turn_without_a_call_ends_the_episode_and_a_turn_whose_calls_ran_earns_the_call_reward():
    task = get_task("word_problems_calculator", call_reward=0.1)
    ran, failed = ToolResult("call_0", "calculator", "16"), ToolResult("call_1", "calculator", "error: x", "exception")
    answer = task.step("s", Action(text="16", index=1))
    assert answer.done and answer.reward is None and answer.state == "s"
    called = task.step(None, Action(text=CALL, results=[ran], calls=1))
    assert not called.done and called.reward == 0.1
    assert task.step(None, Action(text=CALL, results=[ran, failed], calls=2)).reward is None
    assert task.step(None, Action(text=CALL, results=[], calls=1, final=True)).reward is None  # not run
    assert get_task("word_problems_calculator").step(None, Action(text=CALL, results=[ran], calls=1)).reward is None


@pytest.mark.parametrize(("completion", "value"), [
    (f"{CALL}\n16", 1.0),                                   # called, then answered
    ("18 - 11 + 9 = 16", 1.0),                              # answered at once
    (f"It is 16.{CALL}", 1.0),                              # the numbers in a call are not the answer
    ('It is 16. <tool_call>{"name": "calculator", "arguments": {"expression": "9', 1.0),  # a call cut off
    (f"It is 15.{CALL}\n16\n9", 0.0),
    (CALL, 0.0),                                            # only a call: no answer
])
def test_the_reward_reads_the_last_number_outside_tool_calls(completion, value):
    task = get_task("word_problems_calculator")
    prompt = next(p for p in task.eval_prompts() if p.answer == "16")
    assert task.reward(prompt, completion).value == value


# --- [model] chat_template ---------------------------------------------------------------------------------


def test_the_shipped_template_renders_tools_and_without_tools_is_smollm2s_own():
    text = read_chat_template(str(TEMPLATE))
    tools = tool_schemas([calculator])
    with_tools = render(text, [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}], tools=tools,
                        add_generation_prompt=True)
    assert with_tools.startswith("<|im_start|>system\nS\n\nYou may call these tools:\n<tools>\n{")
    assert '"name": "calculator"' in with_tools and "<tool_call>" in with_tools
    assert with_tools.endswith("<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n")
    for messages in ([{"role": "user", "content": "Q"}],
                     [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
                      {"role": "assistant", "content": "A"}, {"role": "user", "content": "Q2"}]):
        assert render(text, messages, add_generation_prompt=True) == \
            render(SMOLLM2_TEMPLATE, messages, add_generation_prompt=True)


def test_tool_results_render_as_tool_responses_in_one_user_turn():
    text = read_chat_template(str(TEMPLATE))
    rendered = render(text, [{"role": "user", "content": "Q"}, {"role": "assistant", "content": CALL},
                             {"role": "tool", "name": "calculator", "content": "16"},
                             {"role": "tool", "name": "calculator", "content": "3"}], tools=tool_schemas([calculator]))
    assert rendered.endswith(f"<|im_start|>assistant\n{CALL}<|im_end|>\n<|im_start|>user\n<tool_response>\n16\n"
                             "</tool_response>\n<tool_response>\n3\n</tool_response><|im_end|>\n")


def test_a_bad_chat_template_file_is_refused_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"model.chat_template: .*missing.jinja' does not exist"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    (tmp_path / "plain.jinja").write_text(SMOLLM2_TEMPLATE)
    with pytest.raises(ConfigError, match="model.chat_template: .* renders no tools"):
        read_chat_template(str(tmp_path / "plain.jinja"))
    (tmp_path / "broken.jinja").write_text("{% for m in messages %}")
    with pytest.raises(ConfigError, match="model.chat_template: .* does not render a chat with tools"):
        read_chat_template(str(tmp_path / "broken.jinja"))
    (tmp_path / "refuses.jinja").write_text("{{ raise_exception('no tools here') }}")
    with pytest.raises(ConfigError, match="no tools here"):
        read_chat_template(str(tmp_path / "refuses.jinja"))
    (tmp_path / "binary.jinja").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError, match="model.chat_template: cannot read"):
        read_chat_template(str(tmp_path / "binary.jinja"))


def test_use_chat_template_replaces_the_tokenizers_template_only_when_set():
    class Tok:
        chat_template = "own"

    tok = Tok()
    use_chat_template(tok, "")
    assert tok.chat_template == "own"
    use_chat_template(tok, str(TEMPLATE))
    assert tok.chat_template == TEMPLATE.read_text()
    with pytest.raises(ConfigError, match="model.chat_template: this engine has no tokenizer"):
        use_chat_template(None, str(TEMPLATE))


def test_the_run_file_check_refuses_a_chat_template_that_cannot_be_used(tmp_path):
    example = REPO / "examples" / "tool_use.toml"
    runfile = RunFile.load(example, env={}, overrides=[f"model.chat_template={TEMPLATE}"])
    runfile.check()
    assert runfile.loaded("trainer").model.chat_template == str(TEMPLATE)
    runfile = RunFile.load(example, env={}, overrides=[f"model.chat_template={tmp_path / 'nope.jinja'}"])
    with pytest.raises(ConfigError, match="model.chat_template"):
        runfile.check()
