"""Black-box agent tasks for the tests (the judge's worker processes, and ``rollout_worker.py``, import them by
name): each ``solve`` talks to the endpoint with the real ``openai`` client. :class:`AskTwice` behaves as its
prompt's ``mode`` says; :class:`TruncatesItsHistory` makes two segments; :class:`TwoCalls` runs test hooks
between its calls; :class:`HeldOnce` holds its first attempt open until its worker is killed."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

from services.tasks.base import Prompt, Reward, register_task
from services.tasks.black_box import AgentEndpoint, BlackBoxAgentTask

MODES = ("ok", "raises", "floods", "hangs")


@register_task("black-box-agent")
class AskTwice(BlackBoxAgentTask):
    """Asks the question, then "Sure?" after the model's answer, and returns the last answer (mode "ok");
    or raises after one call, calls until refused, never returns (the other modes)."""

    name = "black-box-agent"

    def train_prompts(self, seed: int, start: int = 0) -> Iterator[Prompt]:
        while True:
            yield from self.eval_prompts()

    def eval_prompts(self) -> list[Prompt]:
        return [Prompt(id=f"q/{m}", text="What is 2 + 3?", metadata={"answer": "5", "mode": m}) for m in MODES]

    async def solve(self, endpoint: AgentEndpoint, prompt: Prompt) -> Any:
        client = endpoint.openai(max_retries=0)
        mode = prompt.metadata["mode"]
        messages: list[dict[str, Any]] = [{"role": "user", "content": prompt.text}]
        for _turn in range(1000 if mode == "floods" else 2):
            r = await client.chat.completions.create(model=endpoint.model, messages=messages, max_tokens=6,
                                                     temperature=0)
            if mode == "raises":
                raise RuntimeError("the agent broke")
            messages += [{"role": "assistant", "content": r.choices[0].message.content},
                         {"role": "user", "content": "Sure?"}]
        if mode == "hangs":
            await asyncio.Event().wait()
        return r.choices[0].message.content

    def reward(self, prompt: Prompt, completion: str) -> Reward:
        return Reward(1.0 if completion.strip() else 0.5, "1 for a non-empty answer")


@register_task("black-box-truncating")
class TruncatesItsHistory(BlackBoxAgentTask):
    """Asks, asks "Sure?" after the answer (one sequence so far), then starts over from a rewritten history (a
    new user message alone: a second segment), and returns the last answer."""

    name = "black-box-truncating"

    def train_prompts(self, seed: int, start: int = 0) -> Iterator[Prompt]:
        i = start
        while True:
            yield Prompt(id=f"t/{i}", text=f"What is {i % 7} + 3?", metadata={"answer": str(i % 7 + 3)})
            i += 1

    def eval_prompts(self) -> list[Prompt]:
        return [p for p, _ in zip(self.train_prompts(0, start=1000), range(2), strict=False)]

    async def solve(self, endpoint: AgentEndpoint, prompt: Prompt) -> Any:
        client = endpoint.openai(max_retries=0)
        messages: list[dict[str, Any]] = [{"role": "user", "content": prompt.text}]
        for _turn in range(2):
            r = await client.chat.completions.create(model=endpoint.model, messages=messages, max_tokens=6,
                                                     temperature=0)
            messages += [{"role": "assistant", "content": r.choices[0].message.content},
                         {"role": "user", "content": "Sure?"}]
        r = await client.chat.completions.create(  # the history rewritten: a new segment
            model=endpoint.model, messages=[{"role": "user", "content": f"Once more: {prompt.text}"}], max_tokens=6)
        return r.choices[0].message.content

    def reward(self, prompt: Prompt, completion: str) -> Reward:
        return Reward(1.0 if prompt.metadata["answer"] in completion else 0.0, "the answer anywhere")


#: what :class:`TwoCalls` awaits between its two model calls (a test sets it: e.g. publish a weight version)
BETWEEN_CALLS: list[Callable[[], Awaitable[None]]] = []


@register_task("black-box-two-calls")
class TwoCalls(BlackBoxAgentTask):
    """Asks, awaits the hooks of :data:`BETWEEN_CALLS`, asks "Sure?" (one sequence of two calls)."""

    name = "black-box-two-calls"

    def train_prompts(self, seed: int, start: int = 0) -> Iterator[Prompt]:
        while True:
            yield from self.eval_prompts()

    def eval_prompts(self) -> list[Prompt]:
        return [Prompt(id="two/0", text="What is 2 + 3?", metadata={"answer": "5"})]

    async def solve(self, endpoint: AgentEndpoint, prompt: Prompt) -> Any:
        client = endpoint.openai(max_retries=0)
        messages: list[dict[str, Any]] = [{"role": "user", "content": prompt.text}]
        r = await client.chat.completions.create(model=endpoint.model, messages=messages, max_tokens=6,
                                                     temperature=0)
        for hook in BETWEEN_CALLS:
            await hook()
        messages += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "Sure?"}]
        r = await client.chat.completions.create(model=endpoint.model, messages=messages, max_tokens=6,
                                                     temperature=0)
        return r.choices[0].message.content

    def reward(self, prompt: Prompt, completion: str) -> Reward:
        return Reward(1.0 if "5" in completion else 0.0, "5 anywhere")


#: environment variable naming the directory where :class:`HeldOnce` leaves a marker per attempt
MARKERS_ENV = "RLBUS_TEST_AGENT_MARKERS"


@register_task("black-box-held-once")
class HeldOnce(BlackBoxAgentTask):
    """Two calls, as :class:`TwoCalls`. On a training prompt, the first attempt (no marker yet in
    ``$MARKERS_ENV``) leaves a marker named by its process id after its first call and then holds its episode
    open (session open, ticket in progress) until its worker is killed; a later attempt leaves its marker and
    goes on. Evaluation prompts leave no marker and never hold."""

    name = "black-box-held-once"

    def train_prompts(self, seed: int, start: int = 0) -> Iterator[Prompt]:
        while True:
            yield Prompt(id="held/train", text="What is 2 + 3?", metadata={"answer": "5"})

    def eval_prompts(self) -> list[Prompt]:
        return [Prompt(id="held/eval", text="What is 2 + 3?", metadata={"answer": "5"})]

    async def solve(self, endpoint: AgentEndpoint, prompt: Prompt) -> Any:
        client = endpoint.openai(max_retries=0)
        messages: list[dict[str, Any]] = [{"role": "user", "content": prompt.text}]
        r = await client.chat.completions.create(model=endpoint.model, messages=messages, max_tokens=6)
        markers = Path(os.environ[MARKERS_ENV])
        first_attempt = prompt.id == "held/train" and not any(markers.iterdir())
        if prompt.id == "held/train":
            (markers / str(os.getpid())).write_text(prompt.id)
        if first_attempt:
            await asyncio.Event().wait()  # mid-episode until this worker dies
        messages += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "Sure?"}]
        r = await client.chat.completions.create(model=endpoint.model, messages=messages, max_tokens=6)
        return r.choices[0].message.content

    def reward(self, prompt: Prompt, completion: str) -> Reward:
        return Reward(1.0 if "5" in completion else 0.0, "5 anywhere")
