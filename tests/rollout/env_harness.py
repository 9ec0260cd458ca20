"""Helpers for the environment tests: a ChatML tokenizer whose template renders tools, a replaying engine
stand-in, test environments (a calculator and misbehaving ones) registered as tasks.

:class:`ReplayEngine` is an **engine stand-in used only to exercise the tool-call parser**: the tiny model
does not write tool calls, so the assistant turns of function-tool episodes are fixed token ids, replayed
(turn ``k`` of the script for a context with ``k`` assistant turns before it). Its logprobs and versions are
fake but distinct per turn, so the tests can check they travel unchanged. Budget and single-turn tests use
the real tiny torch engine.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator, Sequence
from typing import Any

from tools_for_workers import add, boom, hang, hang_async, huge, multiply, opaque
from transformers import PreTrainedTokenizerFast

from services.lib.engine.base import GenerationResult, SamplingParams
from services.tasks.base import Prompt, Reward, register_task
from services.tasks.env import Action, FunctionEnvironment, Start, Step
from tests.agentic.agentic_harness import CHATML_TOOLS, ScriptedEngine, chat_tokenizer


def tools_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer over printable ASCII with ChatML specials and a template that renders tools."""
    return chat_tokenizer(CHATML_TOOLS)


class ReplayEngine(ScriptedEngine):
    """Engine stand-in (see the module docstring): replays fixed token ids, turn ``k`` for a context with ``k``
    assistant turns; logprob ``-(k + 1) / 10`` and :attr:`version` on every token (the agent tests'
    :class:`ScriptedEngine`, which replies with texts, given token ids instead)."""

    def __init__(self, tokenizer: Any, script: Sequence[list[int]], version: int = 7) -> None:
        super().__init__(tokenizer, [], version=version)
        self.script = [list(s) for s in script]  # type: ignore[misc]  (token ids, not texts)
        self.requests = 0

    @classmethod
    def of_texts(cls, tokenizer: Any, texts: Sequence[str], **kw: Any) -> ReplayEngine:
        """The script as the token ids of ``texts``, each closed by EOS."""
        return cls(tokenizer, [[*tokenizer.encode(t, add_special_tokens=False), tokenizer.eos_token_id]
                               for t in texts], **kw)

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        self.requests += 1
        turn = self.tokenizer.decode(prompt_ids, skip_special_tokens=False).count("<|im_start|>assistant") - 1
        ids = self.script[min(turn, len(self.script) - 1)]
        finish = "eos"
        if len(ids) > params.max_new_tokens:
            ids, finish = ids[:params.max_new_tokens], "length"
        self.generated += len(ids)
        await asyncio.sleep(0)
        return GenerationResult(token_ids=list(ids), logprobs=[-(turn + 1) / 10] * len(ids),
                                versions=[self._version] * len(ids), finish_reason=finish,
                                text=self.tokenizer.decode(ids, skip_special_tokens=True))


# --- tools: in tools_for_workers.py, which tool worker processes import (this module is heavy) ------------


class _EnvTask:
    """The Task part shared by the test environments (prompts and the final reward)."""

    max_new_tokens = 200
    stop: list[str] = []

    def train_prompts(self, seed: int, start: int = 0) -> Iterator[Prompt]:
        while True:
            yield self.eval_prompts()[0]

    def eval_prompts(self) -> list[Prompt]:
        return [Prompt(id="calc/0", text="What is 2 + 3?", messages=[{"role": "user", "content": "What is 2 + 3?"}],
                       metadata={"answer": "5"})]

    def reward(self, prompt: Prompt, completion: str) -> Reward:
        return Reward(1.0 if (prompt.answer or "") in completion.split("\n")[-1] else 0.0, "last line")


@register_task("calculator-env")
class CalculatorEnv(_EnvTask, FunctionEnvironment):
    """Calculator tools; a turn whose calls all ran gives 0.25; a turn without calls ends the episode."""

    name = "calculator-env"
    tools = (add, multiply, boom, hang, hang_async, opaque, huge)

    def step(self, state: Any, action: Action) -> Step:
        if action.calls == 0:
            return Step(done=True, state=state)
        ok = bool(action.results) and all(r.error is None for r in action.results)
        return Step(reward=0.25 if ok else 0.0, state=(state or 0) + 1)


class NeverDone(_EnvTask):
    """No tools; every turn answered with one user message and a turn reward of 0.1, never done."""

    name = "never-done"

    def reset(self, prompt: Prompt) -> Start:
        return Start(messages=[{"role": "user", "content": prompt.text}])

    async def step(self, state: Any, action: Action) -> Step:
        return Step(observations=[{"role": "user", "content": "go on"}], reward=0.1)

    def format_prompt(self, tokenizer: Any, prompt: Prompt) -> list[int]:
        return list(tokenizer.encode(prompt.text, add_special_tokens=False))


class BadStep(NeverDone):
    """An environment whose ``step`` misbehaves as ``how`` says."""

    def __init__(self, how: str) -> None:
        self.how = how

    def step(self, state: Any, action: Action) -> Any:  # sync on purpose: runs in a thread
        if self.how == "raises":
            raise RuntimeError("the environment broke")
        if self.how == "hangs":
            time.sleep(30)
        if self.how == "garbage":
            return "not a Step"
        if self.how == "nan":
            return Step(reward=float("nan"), done=True)
        if self.how == "bad_observations":
            return Step(observations="text, not messages")
        return Step(done=True)


#: the prompt most episode tests run
PROMPT = CalculatorEnv().eval_prompts()[0]


def call(name: str, **arguments: object) -> str:
    """A hermes tool call as the model would write it."""
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"
