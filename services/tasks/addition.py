"""Two-digit addition, character level: prompt ``"12+34="``, answer ``"46"``.

The default example's task: a tiny model can learn it on two CPU cores in
minutes, and the reward (exact match) leaves no room for judgement.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

from services.tasks.base import Prompt, Reward, encode_text, register_task


class TaskOptionError(ValueError):
    """A task option is out of range."""


@register_task("addition")
class AdditionTask:
    """``a+b=`` with ``a, b`` drawn uniformly from ``[low, high]``; reward 1 for the exact sum.

    Args:
        num_eval: size of the fixed held-out eval split.
        low: smallest operand.
        high: largest operand.
        eval_seed: seed of the eval split (fixed so every run evaluates the same prompts).
    """

    name = "addition"
    max_new_tokens = 6
    stop: list[str] = []
    #: the reward is an exact match of the stripped completion: bounded, so the judge calls it itself
    #: (services/judge/user_code.py, ``builtin_in_process``)
    reward_in_process = True

    def __init__(self, num_eval: int = 200, low: int = 10, high: int = 99, eval_seed: int = 20261202) -> None:
        if not 0 <= low <= high:
            raise TaskOptionError(f"need 0 <= low <= high, got low={low}, high={high}")
        pairs = (high - low + 1) ** 2
        if not 0 < num_eval <= pairs // 2:
            raise TaskOptionError(
                f"num_eval must be in 1..{pairs // 2} for operands {low}..{high}, got {num_eval}"
            )
        self.low, self.high = low, high
        rng = random.Random(f"addition-eval:{eval_seed}")
        eval_pairs: list[tuple[int, int]] = []
        seen: set[tuple[int, int]] = set()
        while len(eval_pairs) < num_eval:
            pair = (rng.randint(low, high), rng.randint(low, high))
            if pair not in seen:
                seen.add(pair)
                eval_pairs.append(pair)
        self._eval_pairs = eval_pairs
        self._eval_set = seen

    @staticmethod
    def _prompt(prompt_id: str, a: int, b: int) -> Prompt:
        return Prompt(id=prompt_id, text=f"{a}+{b}=", metadata={"answer": str(a + b)})

    def _train_pair(self, seed: int, position: int) -> tuple[int, int]:
        # One RNG per position: prompt k is the same however the stream got there.
        rng = random.Random(f"addition-train:{seed}:{position}")
        while True:
            pair = (rng.randint(self.low, self.high), rng.randint(self.low, self.high))
            if pair not in self._eval_set:
                return pair

    def train_prompts(self, seed: int, start: int = 0) -> Iterator[Prompt]:
        """Endless stream; prompt id ``addition/train/<seed>/<position>``."""
        position = start
        while True:
            a, b = self._train_pair(seed, position)
            yield self._prompt(f"addition/train/{seed}/{position}", a, b)
            position += 1

    def eval_prompts(self) -> list[Prompt]:
        """The held-out split; prompt id ``addition/eval/<k>``."""
        return [self._prompt(f"addition/eval/{k}", a, b) for k, (a, b) in enumerate(self._eval_pairs)]

    def reward(self, prompt: Prompt, completion: str) -> Reward:
        """1.0 when the completion (whitespace stripped) is exactly the sum, else 0.0."""
        expected = prompt.metadata.get("answer")
        if expected is None:
            return Reward(0.0, "prompt has no answer in its metadata")
        got = completion.strip()
        if got == expected:
            return Reward(1.0, f"correct: {got}")
        return Reward(0.0, f"expected {expected}, got {got!r}")

    def format_prompt(self, tokenizer: Any, prompt: Prompt) -> list[int]:
        """BOS + the characters of ``"a+b="``."""
        return encode_text(tokenizer, prompt.text)
