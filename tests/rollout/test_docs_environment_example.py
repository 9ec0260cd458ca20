"""The environment of docs/environments.md, as printed there, through the real episode loop.

The block is taken from the page and executed, so the page cannot drift from what works. The assistant turns
are replayed by ``env_harness.ReplayEngine``, an engine stand-in used only because the tiny model writes no
tool calls; the tools, the parser, the chat template (a Qwen-style one that renders tools), the episode loop
and the environment's own code are the real ones.
"""

from __future__ import annotations

import re
import types
from itertools import islice
from pathlib import Path

from env_harness import PROMPT, ReplayEngine, call, tools_tokenizer

from services.lib.engine.base import SamplingParams
from services.rollout.config import AgentSection
from services.rollout.episode import EpisodeLoop
from services.tasks import get_task

PAGE = Path(__file__).resolve().parents[2] / "docs" / "environments.md"


def _load_example() -> types.ModuleType:
    block = re.search(r"```python\n(.*?)```", PAGE.read_text(), re.S)
    assert block is not None, f"{PAGE} has no python block"
    assert len(block.group(1).strip().splitlines()) < 40, "the page promises an environment in under 40 lines"
    module = types.ModuleType("docs_environment_example")
    exec(compile(block.group(1), str(PAGE), "exec"), module.__dict__)
    return module


EXAMPLE = _load_example()


async def test_the_documented_environment_runs_a_tool_call_episode():
    tok = tools_tokenizer()
    env = get_task("sum_with_a_tool")
    assert isinstance(env, EXAMPLE.SumWithATool)
    [prompt, *_] = env.eval_prompts()
    assert prompt.answer is not None and prompt.id != PROMPT.id
    a, b = (int(x) for x in re.findall(r"\d+", prompt.text))
    prompt_ids = env.format_prompt(tok, prompt)
    assert '"name": "add"' in tok.decode(prompt_ids)  # the tool rendered by the template

    engine = ReplayEngine.of_texts(tok, [call("add", a=a, b=b), f"So the sum is\n{a + b}"])
    out = await EpisodeLoop(engine, tok, AgentSection(tool_parser="hermes")).run(
        env, prompt, prompt_ids, SamplingParams(max_new_tokens=200))

    assert [t.role for t in out.turns] == ["assistant", "tool", "assistant"] and out.error is None
    assistant, observation, answer = out.turns
    assert f"\n{a + b}\n" in observation.text  # the tool ran and the model reads its result
    assert assistant.reward == 0.1 and answer.reward is None  # step's turn reward; the answer turn made no call
    assert env.reward(prompt, answer.text).value == 1.0
    assert env.reward(prompt, "So the sum is\n0").value == 0.0


def test_the_documented_training_stream_resumes_where_it_stopped():
    env = get_task("sum_with_a_tool")
    first = [p.id for p in islice(env.train_prompts(seed=0), 5)]
    assert [p.id for p in islice(env.train_prompts(seed=0, start=3), 2)] == first[3:5]
