"""examples/tool_use.toml's environment (word_problems_calculator) through the real episode loop with the shipped
template (examples/chat_templates/chatml_tools.jinja), as [model] chat_template applies it.

SmolLM2 is not loaded here: the tokenizer is the tests' character-level ChatML tokenizer (ChatML specials, so
the template fits it as it fits SmolLM2's), and the assistant turns are replayed token ids
(``env_harness.ReplayEngine``: only to exercise the parser and the tool path). The loop, the parser, the tool
worker processes running the calculator, the template and the environment are real.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from env_harness import ReplayEngine

from services.lib.chat_template import use_chat_template
from services.lib.engine.base import SamplingParams
from services.rollout.config import AgentSection
from services.rollout.episode import EpisodeLoop
from services.tasks import get_task
from services.tasks.env import tool_schemas
from tests.agentic.agentic_harness import chat_tokenizer

TEMPLATE = Path(__file__).resolve().parents[2] / "examples" / "chat_templates" / "chatml_tools.jinja"


def calc(expression: str) -> str:
    return f"<tool_call>{json.dumps({'name': 'calculator', 'arguments': {'expression': expression}})}</tool_call>"


@pytest.fixture
def tok():
    tokenizer = chat_tokenizer("{{ raise_exception('the run file template was not applied') }}")
    use_chat_template(tokenizer, str(TEMPLATE))  # what trainer and rollout do with [model] chat_template
    return tokenizer


@pytest.fixture
async def loop_of(tok):
    loops: list[EpisodeLoop] = []

    def make(texts: list[str], **agent: object) -> tuple[EpisodeLoop, ReplayEngine]:
        engine = ReplayEngine.of_texts(tok, texts)
        loops.append(EpisodeLoop(engine, tok, AgentSection(tool_parser="hermes", **agent)))  # type: ignore[arg-type]
        return loops[-1], engine

    yield make
    for loop in loops:
        await loop.close()


def prompt_with_answer(task, answer: str):
    return next(p for p in task.eval_prompts() if p.answer == answer)


async def test_a_call_then_an_answer_is_token_exact_and_scored(tok, loop_of):
    task = get_task("word_problems_calculator", call_reward=0.1)
    prompt = prompt_with_answer(task, "16")
    texts = [calc("18 - 11 + 9"), "16"]
    loop, engine = loop_of(texts, max_turns=2)
    prompt_ids = task.format_prompt(tok, prompt)
    assert '"name": "calculator"' in tok.decode(prompt_ids)  # the tools rendered by the shipped template
    out = await loop.run(task, prompt, prompt_ids, SamplingParams(max_new_tokens=200))

    assert out.error is None and out.finish_reason == "eos" and out.tool_calls == 1
    assert [t.role for t in out.turns] == ["assistant", "tool", "assistant"]
    a0, obs, a1 = out.turns
    assert a0.token_ids == engine.script[0] and a1.token_ids == engine.script[1]  # the engine's ids, untouched
    assert obs.logprobs == [] and obs.versions == []
    assert a0.reward == 0.1 and a1.reward is None  # the call ran: the turn reward; the answer: none
    # the trainer's sequence (prompt + turns) is exactly the template's rendering of the conversation
    conversation = [*prompt.messages, {"role": "assistant", "content": texts[0]},
                    {"role": "tool", "tool_call_id": "call_0", "name": "calculator", "content": "16"},
                    {"role": "assistant", "content": texts[1]}]
    rendered = tok.apply_chat_template(conversation, tools=tool_schemas(task.tools), tokenize=False)
    context = tok.decode(prompt_ids + a0.token_ids + obs.token_ids + a1.token_ids, skip_special_tokens=False)
    assert context == rendered.rstrip("\n")
    assert "<tool_response>\n16\n</tool_response>" in obs.text
    # the judge scores the assistant turns joined (services/tasks/graders.py: assistant_text)
    assert task.reward(prompt, "\n".join(out.assistant_texts)).value == 1.0


async def test_tool_errors_become_observations_the_model_reads(tok, loop_of):
    task = get_task("word_problems_calculator", call_reward=0.1)
    prompt = prompt_with_answer(task, "16")
    bad = [calc("1/0"), calc("__import__('os')"),
           '<tool_call>{"name": "sqrt", "arguments": {"x": 4}}</tool_call>',
           '<tool_call>{"name": "calculator", "arguments": {"expr": "1"}}</tool_call>',
           "<tool_call>{broken</tool_call>"]
    loop, _ = loop_of(["".join(bad), "16"], max_turns=2, max_total_tokens=4000)  # a character per token
    out = await loop.run(task, prompt, task.format_prompt(tok, prompt), SamplingParams(max_new_tokens=400))

    assert out.error is None and out.finish_reason == "eos" and out.tool_calls == 5
    a0, obs, _ = out.turns
    assert a0.reward is None  # no call ran cleanly: no turn reward
    assert obs.text.count("<tool_response>") == 5
    for words in ("division by zero", "only numbers", "sqrt", "expr", "JSON"):
        assert words in obs.text, words
    assert task.reward(prompt, "\n".join(out.assistant_texts)).value == 1.0


async def test_a_call_on_the_last_turn_ends_the_episode_at_the_turn_limit_unrun(tok, loop_of):
    task = get_task("word_problems_calculator", call_reward=0.1)
    prompt = prompt_with_answer(task, "16")
    loop, _ = loop_of([calc("18 - 11"), calc("7 + 9")], max_turns=2)
    out = await loop.run(task, prompt, task.format_prompt(tok, prompt), SamplingParams(max_new_tokens=200))
    assert out.finish_reason == "turn_limit" and out.tool_calls == 1
    assert [t.role for t in out.turns] == ["assistant", "tool", "assistant"]
    assert out.turns[0].reward == 0.1 and out.turns[2].reward is None  # the last call was not run
    assert task.reward(prompt, "\n".join(out.assistant_texts)).value == 0.0  # no answer outside the calls
