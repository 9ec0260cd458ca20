"""Simple arithmetic word problems for small chat models (SmolLM2-135M-Instruct).

Prompts are chat conversations (one user turn); the reward parses the last
number in the completion and compares it with the answer.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Iterator
from typing import Any

from services.tasks.base import Prompt, Reward, encode_chat, register_task

_NAMES = ["Tom", "Anna", "Sam", "Lily", "Ben", "Maya", "Leo", "Emma", "Jack", "Zoe"]
_ITEMS = ["apples", "books", "marbles", "stickers", "pencils", "cookies", "cards", "balloons"]
_INSTRUCTION = "Answer with the final number only."
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")

Problem = tuple[str, int]


def _add(rng: random.Random, name: str, item: str) -> Problem:
    a, b = rng.randint(1, 20), rng.randint(1, 20)
    return f"{name} has {a} {item}. {name} gets {b} more {item}. How many {item} does {name} have now?", a + b


def _sub(rng: random.Random, name: str, item: str) -> Problem:
    a = rng.randint(5, 30)
    b = rng.randint(1, a - 1)
    return f"{name} has {a} {item} and gives {b} of them away. How many {item} does {name} have left?", a - b


def _mul(rng: random.Random, name: str, item: str) -> Problem:
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    return (
        f"{name} has {a} boxes with {b} {item} in each box. How many {item} does {name} have in total?",
        a * b,
    )


def _two_step(rng: random.Random, name: str, item: str) -> Problem:
    a = rng.randint(5, 20)
    b = rng.randint(1, a - 1)
    c = rng.randint(1, 10)
    question = (
        f"{name} had {a} {item}, lost {b} of them, and then found {c} more. "
        f"How many {item} does {name} have now?"
    )
    return question, a - b + c


_KINDS: list[Callable[[random.Random, str, str], Problem]] = [_add, _sub, _mul, _two_step]


def parse_final_number(text: str) -> float | None:
    """The last number written in ``text`` (commas in thousands allowed), or None."""
    found = _NUMBER.findall(text.replace(",", ""))
    return float(found[-1]) if found else None


@register_task("word_problems")
class WordProblemsTask:
    """One- and two-step word problems (add, subtract, multiply) with small whole numbers.

    Args:
        num_eval: size of the fixed held-out eval split.
        eval_seed: seed of the eval split.
        system_prompt: optional system message put before the question.
        instruction: the text after the question in the user turn (default: the final number only; a
            step-by-step instruction makes long, varied completions: ``examples/longtail.toml``).
    """

    name = "word_problems"
    max_new_tokens = 48
    stop: list[str] = []
    #: the reward is the last number, found by one linear regex scan: bounded, so the judge calls it itself
    #: (services/judge/user_code.py, ``builtin_in_process``)
    reward_in_process = True

    def __init__(
        self, num_eval: int = 200, eval_seed: int = 20261202, system_prompt: str | None = None,
        instruction: str = _INSTRUCTION,
    ) -> None:
        if not instruction.strip():
            raise ValueError("task option instruction is empty; give the text that follows the question "
                             f"(default {_INSTRUCTION!r})")
        self.system_prompt = system_prompt
        self.instruction = instruction.strip()
        rng = random.Random(f"word-problems-eval:{eval_seed}")
        self._eval: list[Problem] = []
        seen: set[str] = set()
        while len(self._eval) < num_eval:
            problem = self._draw(rng)
            if problem[0] not in seen:
                seen.add(problem[0])
                self._eval.append(problem)
        self._eval_questions = seen

    @staticmethod
    def _draw(rng: random.Random) -> Problem:
        kind = rng.choice(_KINDS)
        return kind(rng, rng.choice(_NAMES), rng.choice(_ITEMS))

    def _prompt(self, prompt_id: str, problem: Problem) -> Prompt:
        question, answer = problem
        messages = [] if self.system_prompt is None else [{"role": "system", "content": self.system_prompt}]
        messages.append({"role": "user", "content": f"{question} {self.instruction}"})
        return Prompt(id=prompt_id, text=question, messages=messages, metadata={"answer": str(answer)})

    def train_prompts(self, seed: int, start: int = 0) -> Iterator[Prompt]:
        """Endless stream; prompt id ``word_problems/train/<seed>/<position>``."""
        position = start
        while True:
            rng = random.Random(f"word-problems-train:{seed}:{position}")
            problem = self._draw(rng)
            while problem[0] in self._eval_questions:
                problem = self._draw(rng)
            yield self._prompt(f"word_problems/train/{seed}/{position}", problem)
            position += 1

    def eval_prompts(self) -> list[Prompt]:
        """The held-out split; prompt id ``word_problems/eval/<k>``."""
        return [self._prompt(f"word_problems/eval/{k}", p) for k, p in enumerate(self._eval)]

    def reward(self, prompt: Prompt, completion: str) -> Reward:
        """1.0 when the last number in the completion equals the answer, else 0.0."""
        expected = prompt.metadata.get("answer")
        if expected is None:
            return Reward(0.0, "prompt has no answer in its metadata")
        got = parse_final_number(completion)
        if got is None:
            return Reward(0.0, f"no number in the completion (expected {expected})")
        if got == float(expected):
            return Reward(1.0, f"correct: {expected}")
        return Reward(0.0, f"expected {expected}, got {got:g}")

    def format_prompt(self, tokenizer: Any, prompt: Prompt) -> list[int]:
        """The chat template applied to the prompt's messages, ready for the assistant turn."""
        if not prompt.messages:
            raise ValueError(f"prompt {prompt.id} has no messages; word problems are chat prompts")
        return encode_chat(tokenizer, prompt.messages)
