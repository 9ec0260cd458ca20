"""A verifiers environment written with verifiers 0.4.0's own classes, as a verifiers taskset package: the
module exports its ``vf.Taskset`` in ``__all__`` (rlbus's ``[task] name = "verifiers"`` also takes a
module with ``load_environment(**env_args)``, or ``pkg.module:function``). Local data, nothing downloaded.

Each task asks for a sum of small numbers; two reward functions score the reply: ``correct`` (the sum is
the last number in it, weight 1) and ``concise`` (at most 30 characters, weight 0.2). examples/verifiers.toml
trains on it; ``[task.options] env_args`` sets this taskset's config (``size``, ``terms``).
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator

import verifiers.v1 as vf
from datasets import Dataset


class SumsConfig(vf.TasksetConfig):
    size: int = 500
    """Tasks in the taskset (rlbus holds out its eval_size first ones)."""
    terms: int = 2
    """Numbers to add in each question."""


class SumsData(vf.TaskData):
    answer: str


class SumsTask(vf.Task[SumsData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, task: SumsData, trace: vf.Trace) -> float:
        numbers = re.findall(r"-?\d+", trace.last_reply)
        return 1.0 if numbers and numbers[-1] == task.answer else 0.0

    @vf.reward(weight=0.2)
    async def concise(self, trace: vf.Trace) -> float:
        return 1.0 if len(trace.last_reply.strip()) <= 30 else 0.0


class SumsTaskset(vf.Taskset[SumsTask, SumsConfig]):
    def load(self) -> Iterator[SumsTask]:
        rng = random.Random(0)
        rows = []
        for _ in range(self.config.size):
            terms = [rng.randint(1, 20) for _ in range(self.config.terms)]
            rows.append({"question": f"What is {' + '.join(map(str, terms))}?", "answer": str(sum(terms))})
        for row in Dataset.from_list(rows):
            yield SumsTask(SumsData(prompt=row["question"], answer=row["answer"],
                                    system_prompt="Answer with the number alone."), self.config.task)


__all__ = ["SumsTaskset"]
