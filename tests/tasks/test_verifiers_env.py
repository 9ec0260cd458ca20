"""The verifiers task: environments written with verifiers 0.4.0's own classes (tests/tasks/verifiers_envs.py)
loaded by name, their tasks as prompts, their episodes run against a session of the real endpoint over the
real tiny torch engine (the real ``openai`` client, verifiers' own interception server), their reward
functions as the reward; broken environments refused naming the option, broken reward functions scored 0
with the reason."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "rollout"))
from endpoint_harness import serving, tokenizer, torch_engine  # noqa: E402

from services.rollout.black_box import BlackBoxLoop  # noqa: E402
from services.rollout.config import AgentSection  # noqa: E402
from services.tasks.base import Prompt, get_task  # noqa: E402
from services.tasks.verifiers_env import VerifiersEnvError, reward_of  # noqa: E402

ENVS = "tests.tasks.verifiers_envs"
TOK = tokenizer()


def test_tasks_become_a_held_out_eval_split_and_a_deterministic_training_stream():
    task = get_task("verifiers", env=ENVS, eval_size=2)
    evals = task.eval_prompts()
    assert [p.text for p in evals] == ["What is 1 + 2?", "What is 3 + 4?"]
    assert [p.metadata["task_idx"] for p in evals] == ["0", "1"]
    train = [p for p, _ in zip(task.train_prompts(seed=3), range(12), strict=False)]
    # each epoch is the six other tasks, in an order drawn from (seed, epoch)
    assert sorted(int(p.metadata["task_idx"]) for p in train[:6]) == [2, 3, 4, 5, 6, 7]
    assert sorted(int(p.metadata["task_idx"]) for p in train[6:]) == [2, 3, 4, 5, 6, 7]
    again = get_task("verifiers", env=ENVS, eval_size=2)
    assert [p for p, _ in zip(again.train_prompts(seed=3, start=4), range(8), strict=False)] == train[4:12]
    assert [p.id for p in train[:2]] == ["verifiers/train/3/0", "verifiers/train/3/1"]
    # load_environment's arguments come from env_args
    small = get_task("verifiers", env=ENVS, env_args={"size": 4}, eval_size=1)
    assert {p.metadata["task_idx"] for p, _ in zip(small.train_prompts(0), range(6), strict=False)} == {"1", "2", "3"}


def test_a_verifiers_taskset_package_is_an_environment_with_its_config_from_env_args():
    """examples/verifiers_env.py exports a vf.Taskset (no load_environment): verifiers' own load_environment
    builds the environment, env_args its taskset's config; every seat runs rlbus's harness."""
    from services.tasks.verifiers_harness import RlbusChatHarness

    task = get_task("verifiers", env="examples.verifiers_env", env_args={"size": 12, "terms": 3}, eval_size=2)
    assert [p.text.count("+") for p in task.eval_prompts()] == [2, 2]
    assert len({p.metadata["task_idx"] for p, _ in zip(task.train_prompts(0), range(10), strict=False)}) == 10
    assert all(isinstance(h, RlbusChatHarness) for h in task.env._harnesses.values())


@pytest.mark.parametrize(("options", "message"), [
    ({"env": "no_such_module_here"}, "task.options.env: module 'no_such_module_here' does not import"),
    ({"env": "json"}, "task.options.env: module 'json' has no load_environment and exports no verifiers Taskset"),
    ({"env": f"{ENVS}:load_not_env"}, "returned a dict, not a verifiers environment"),
    ({"env": f"{ENVS}:nothing"}, "has no function 'nothing'"),
    ({"env": ENVS, "env_args": {"bogus": 1}}, "raised TypeError"),
    ({"env": ENVS, "eval_size": 8}, "task.options.eval_size: the taskset has 8 tasks"),
    ({"env": ENVS, "evalsize": 2}, "task.options.evalsize: unknown option"),
    ({"env": "examples.verifiers_env", "env_args": {"sizes": 3}},
     "task.options.env_args: not the config of taskset 'examples.verifiers_env'"),
])
def test_a_broken_environment_is_refused_naming_the_option(options, message):
    with pytest.raises(VerifiersEnvError, match="task.options") as info:
        get_task("verifiers", **options).eval_prompts()  # the environment loads when first needed
    assert message in str(info.value)


def test_the_judge_side_never_loads_the_environment():
    """The judge's reward reads only the verdict: building the task there loads nothing (a broken module
    included), so its workers' first call costs no environment loading."""
    task = get_task("verifiers", env="no_such_module_here")
    prompt = Prompt(id="p", metadata={"agent_answer": '{"rewards": {"a": [1.0, 1.0]}, "errors": []}'})
    assert task.reward(prompt, "").value == 1.0 and "env" not in task.__dict__


def test_the_rubric_verdict_is_the_weighted_mean_of_its_functions():
    r = reward_of({"rewards": {"contains_answer": [1.0, 1.0], "brief": [0.0, 0.5], "chars": [0.3, 0.0]},
                   "errors": []})
    assert r.value == pytest.approx(1.0 / 1.5)
    assert r.explanation.startswith("brief=0 (weight 0.5), chars=0.3 (weight 0), contains_answer=1 (weight 1)")
    assert reward_of({"rewards": {"a": [None, 1.0]}, "errors": []}).explanation == "reward function a did not run"
    assert reward_of({"rewards": {"a": [1.5, 1.0]}, "errors": []}).value == 0.0
    failed = reward_of({"rewards": {"a": [1.0, 1.0]}, "errors": ["TaskError: boom"]})
    assert failed.value == 0.0 and "boom" in failed.explanation


async def _episodes(options: dict, n: int = 1):
    task = get_task("verifiers", eval_size=2, max_new_tokens=12, **options)
    async with torch_engine(TOK) as engine, serving(engine, TOK) as endpoint:
        loop = BlackBoxLoop(endpoint, AgentSection(max_turns=4, wall_time_s=60.0))
        try:
            outs = [await loop.run(task, p) for p in task.eval_prompts()[:n]]
        finally:
            await task.aclose()
    return task, outs


async def test_a_single_turn_episode_is_one_model_call_scored_by_each_reward_function():
    task, (out,) = await _episodes({"env": ENVS})
    assert out.error is None, out.error
    assert [t.role for t in out.turns] == ["assistant"] and out.metadata["agent_calls"] == "1"
    rendered = TOK.apply_chat_template([{"role": "system", "content": "Answer with the number."},
                                        {"role": "user", "content": "What is 1 + 2?"}],
                                       tokenize=False, add_generation_prompt=True)
    assert out.prompt_ids == TOK.encode(rendered, add_special_tokens=False)
    verdict = json.loads(out.metadata["agent_answer"])
    text = out.turns[0].text
    assert verdict["errors"] == []
    assert verdict["rewards"] == {"contains_answer": [float("3" in text), 1.0],
                                  "brief": [float(len(text) <= 40), 0.5]}
    prompt = task.eval_prompts()[0]
    reward = task.reward(prompt.__class__(id=prompt.id, metadata={**prompt.metadata, **out.metadata}), text)
    assert reward.value == pytest.approx((float("3" in text) + 0.5 * float(len(text) <= 40)) / 1.5)
    assert "contains_answer=" in reward.explanation and "brief=" in reward.explanation


async def test_a_multi_turn_episode_answers_each_turn_and_stays_one_sequence():
    _, (out,) = await _episodes({"env": f"{ENVS}:load_dialogue", "env_args": {"turns": 2}})
    assert out.error is None, out.error
    assert out.metadata["agent_calls"] == "2"
    assert [t.role for t in out.turns] == ["assistant", "tool", "assistant"]
    assert "1 more, please." in out.turns[1].text
    # the environment's own reward beside the task's reward functions (scored on the last reply)
    rewards = json.loads(out.metadata["agent_answer"])["rewards"]
    assert rewards["replied_every_turn"] == [1.0, 1.0] and set(rewards) == {"replied_every_turn", "contains_answer",
                                                                           "brief"}


@pytest.mark.parametrize(("env", "reason"), [("load_broken", "the rubric broke"), ("load_garbage", "nan")])
async def test_a_reward_function_that_raises_or_returns_garbage_scores_zero_with_the_reason(env, reason):
    task, (out,) = await _episodes({"env": f"{ENVS}:{env}"})
    prompt = task.eval_prompts()[0]
    reward = task.reward(prompt.__class__(id=prompt.id, metadata={**prompt.metadata, **out.metadata}), "")
    assert reward.value == 0.0 and reason in reward.explanation.lower()


async def test_an_environment_whose_run_fails_ends_its_episode_with_the_reason():
    _, (out,) = await _episodes({"env": f"{ENVS}:load_dialogue", "env_args": {"fail": True}})
    assert out.finish_reason == "error" and "the environment broke" in out.error, out.error
    assert "VerifiersEpisodeError" in out.error


# --- a ToolEnv: MCP tools served by verifiers per episode, called by rlbus's harness ----------------------
# The tiny random model does not write tool calls: the policy is the agentic tests' ScriptedEngine (fixed
# replies, hermes-style calls) behind the same real endpoint, session and parser.

TOOLS_ENV = f"{ENVS}:load_tools"
REPO = Path(__file__).resolve().parents[2]


def call(name: str, arguments: object) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


async def _scripted_episode(script: list[str], monkeypatch, max_turns: int = 8) -> tuple:
    from tests.agentic.agentic_harness import ScriptedEngine

    # verifiers starts the tool server as `python -m tests.tasks.verifiers_tools`: the repository must import
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    task = get_task("verifiers", env=TOOLS_ENV, eval_size=2, max_new_tokens=64)
    engine = ScriptedEngine(TOK, script)
    async with serving(engine, TOK) as endpoint:
        loop = BlackBoxLoop(endpoint, AgentSection(max_turns=max_turns, wall_time_s=120.0))
        try:
            out = await loop.run(task, task.eval_prompts()[0])
        finally:
            await task.aclose()
    return out, engine


async def test_a_tool_episode_calls_the_tools_and_trains_on_the_generated_tokens_only(monkeypatch):
    script = [call("calc_add", {"a": 1, "b": 2}), call("calc_multiply", {"a": 3, "b": 4}), "The answer is 3."]
    out, engine = await _scripted_episode(script, monkeypatch)
    assert out.error is None, out.error
    assert out.metadata["agent_calls"] == "3" and engine.calls == [0, 1, 2]
    assert [t.role for t in out.turns] == ["assistant", "tool", "assistant", "tool", "assistant"]
    # the tools ran in verifiers' MCP server; their results are the masked turns (the template's rendering)
    assert "\n3\n" in out.turns[1].text and "\n12\n" in out.turns[3].text
    assert '"name": "calc_add"' in out.turns[0].text and out.turns[4].text.startswith("The answer is 3.")
    # the model saw the tools as OpenAI tools, named <server>_<tool>, in its first prompt
    first = TOK.decode(out.prompt_ids, skip_special_tokens=False)
    assert all(f'"name": "calc_{t}"' in first for t in ("add", "multiply", "divide"))
    verdict = json.loads(out.metadata["agent_answer"])
    assert verdict["errors"] == [] and verdict["rewards"]["contains_answer"] == [1.0, 1.0]


async def test_a_tool_that_raises_or_rejects_its_arguments_answers_the_model_with_the_error(monkeypatch):
    script = [call("calc_divide", {"a": 1, "b": 0}), call("calc_add", {"a": "one", "b": 2}), "The answer is 3."]
    out, _ = await _scripted_episode(script, monkeypatch)
    assert out.error is None, out.error
    assert [t.role for t in out.turns] == ["assistant", "tool"] * 2 + ["assistant"]
    raised, rejected = out.turns[1].text, out.turns[3].text
    assert "cannot divide by zero" in raised, raised
    assert "validation error" in rejected.lower() and "calc_add" not in rejected, rejected
    assert json.loads(out.metadata["agent_answer"])["rewards"]["contains_answer"] == [1.0, 1.0]


async def test_a_model_that_keeps_calling_tools_ends_at_the_turn_budget(monkeypatch):
    """The harness loops while the model calls tools; the rollout's agent.max_turns refuses the third call:
    the episode ends with turn_limit (no error), its two calls and the tool result between them kept."""
    out, engine = await _scripted_episode([call("calc_add", {"a": 1, "b": 1})] * 5, monkeypatch, max_turns=2)
    assert out.error is None and out.finish_reason == "turn_limit", (out.error, out.finish_reason)
    assert engine.calls == [0, 1] and [t.role for t in out.turns] == ["assistant", "tool", "assistant"]


async def test_an_unknown_tool_or_arguments_that_are_not_a_json_object_are_a_tool_error_without_a_call():
    """rlbus's endpoint never hands these over (its parser returns a call to an undeclared tool, or with
    arguments that are not an object, as text), but the harness reads any OpenAI endpoint's tool calls."""
    from services.tasks.verifiers_harness import Tools

    tools = Tools({"calc_add": ("calc", "add")}, {})  # no connection: a call that reached it would fail
    assert await tools.call("calc_sub", "{}") == "error: unknown tool 'calc_sub'; the tools are: calc_add"
    assert (await tools.call("calc_add", "{a: 1")).startswith("error: the arguments of calc_add are not valid JSON")
    assert await tools.call("calc_add", "[1, 2]") == "error: the arguments of calc_add must be a JSON object, got list"
