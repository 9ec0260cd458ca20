"""The black-box agent task of docs/agents.md, as printed there, against the real endpoint over the real tiny
torch engine: the block is taken from the page and executed, so the page cannot drift from what works."""

from __future__ import annotations

import re
import types
from pathlib import Path

from endpoint_harness import serving, tokenizer, torch_engine

from services.rollout.black_box import BlackBoxLoop
from services.rollout.config import AgentSection
from services.tasks import get_task
from services.tasks.black_box import is_black_box_agent

PAGE = Path(__file__).resolve().parents[2] / "docs" / "agents.md"


def _load_example() -> types.ModuleType:
    block = re.search(r"```python\n(.*?)```", PAGE.read_text(), re.S)
    assert block is not None, f"{PAGE} has no python block"
    module = types.ModuleType("docs_agent_example")
    exec(compile(block.group(1), str(PAGE), "exec"), module.__dict__)
    return module


EXAMPLE = _load_example()


async def test_the_documented_agent_runs_an_episode_from_its_session():
    task = get_task("my-agent")
    assert is_black_box_agent(task)
    prompt = task.eval_prompts()[0]
    tok = tokenizer()
    async with torch_engine(tok) as engine, serving(engine, tok) as ep:
        out = await BlackBoxLoop(ep, AgentSection()).run(task, prompt)
    assert out.error is None and out.metadata["agent_calls"] == "2"
    assert [t.role for t in out.turns] == ["assistant", "tool", "assistant"]
    assert out.prompt_ids == tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt.text}],
                                                                tokenize=False, add_generation_prompt=True),
                                        add_special_tokens=False)
    assert out.metadata["agent_answer"] == out.turns[2].text
    completion = "\n".join(t.text for t in out.turns if t.role == "assistant")
    assert task.reward(prompt, completion).value in (0.0, 1.0)
