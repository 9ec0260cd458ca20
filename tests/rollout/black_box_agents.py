"""A black-box agent task for the tests (the judge's worker processes import it by name): its ``solve`` talks
to the endpoint with the real ``openai`` client; the prompt's ``mode`` says how the agent behaves."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
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
