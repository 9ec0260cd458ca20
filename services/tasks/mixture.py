"""Environment mixtures: several tasks in one run, each with a sampling weight (``[[task.mix]]``).

The trainer trains on the run's :class:`Mixture`; a run with one task (``[task] name``) is a mixture of one,
whose training stream is exactly that task's. Each training prompt is drawn from one environment::

    position k of the stream  ──▶  environment i = draw_k(seed)     (P(i) = weight_i / sum of weights)
                              ──▶  prompt n_i(k) of environment i's own stream

where ``n_i(k)`` counts the draws of ``i`` before ``k``. The draws come from one RNG seeded by the run's seed,
so position ``k`` is the same prompt whether the stream is read from 0 or resumed at ``k`` (the trainer saves
one number, its data position; resuming replays the ``k`` draws, a few microseconds each, to find where each
environment's stream stands). Each prompt carries its environment (``Prompt.env``), which the trainer's
tickets name (``PromptTicket.task``), so rollout and judge build the right task with its options
(``TaskSection.options_for``). Groups are per prompt, so GRPO's group-normalised advantages are always
computed within one environment's groups.
"""

from __future__ import annotations

import bisect
import itertools
import random
from collections.abc import Iterator
from dataclasses import dataclass

import msgspec

from services.runtime.config import ConfigError, TaskSection
from services.tasks.base import Prompt, Task, TaskMetrics, UnknownTaskError, get_task


@dataclass(frozen=True)
class Environment:
    """One environment of a mixture: its name (the task's registry name), the built task and its weight."""

    name: str
    task: Task
    weight: float


class Mixture:
    """The run's environments and the training stream drawn from them by weight."""

    def __init__(self, envs: list[Environment]) -> None:
        if not envs:
            raise ValueError("a mixture needs at least one environment")
        if any(not e.weight > 0 for e in envs):
            raise ValueError(f"every weight must be > 0, got {[e.weight for e in envs]}")
        self.envs = envs
        self.by_name = {e.name: e for e in envs}
        total = sum(e.weight for e in envs)
        #: cumulative shares: environment i is drawn when the uniform draw falls below cumulative[i]
        self.cumulative = list(itertools.accumulate(e.weight / total for e in envs))

    @classmethod
    def build(cls, section: TaskSection) -> Mixture:
        """Build every environment of ``section`` (``[task]``). A task that is not registered stops start-up
        with a :class:`ConfigError` naming its key (``task.name`` / ``task.mix[i].name``); in a mixture, a task
        that refuses its options too, naming the entry's key (``task.mix[i].options...``)."""
        envs = []
        for i, entry in enumerate(section.entries()):
            key = section.key_of(i)
            try:
                task = get_task(entry.name, **entry.options)
            except UnknownTaskError as e:
                raise ConfigError(f"config key {key}.name: {e}") from None
            except (ConfigError, ValueError, TypeError) as e:
                if section.mix is None:  # the one task: its own error, as it always was
                    raise
                text = str(e).replace("task.options.", f"{key}.options.")
                raise ConfigError(text if text.startswith(f"{key}.options.") or text.startswith("config key")
                                  else f"config key {key}.options: task {entry.name!r} refused them: {text}") from e
            envs.append(Environment(entry.name, task, entry.weight))
        return cls(envs)

    @property
    def is_mixture(self) -> bool:
        """Several environments (their figures are reported per environment too)."""
        return len(self.envs) > 1

    @property
    def first(self) -> Environment:
        return self.envs[0]

    def env(self, name: str) -> Environment:
        """The environment ``name`` (``""``: the first, for a prompt that names none)."""
        if not name:
            return self.envs[0]
        try:
            return self.by_name[name]
        except KeyError:
            raise KeyError(f"environment {name!r} is not one of this run's ({', '.join(self.by_name)})") from None

    def _draws(self, seed: int) -> Iterator[int]:
        """The environment index of each position of the stream, from position 0."""
        if len(self.envs) == 1:
            return itertools.repeat(0)
        rng = random.Random(f"rlbus-mixture:{seed}")
        last = len(self.envs) - 1
        return (min(bisect.bisect_right(self.cumulative, rng.random()), last) for _ in itertools.count())

    def train_prompts(self, seed: int, start: int = 0) -> Iterator[Prompt]:
        """An endless, deterministic stream of training prompts, each carrying its environment; prompt ``k`` is
        the same whether reached from 0 or from ``start = k`` (the module docstring)."""
        draws = self._draws(seed)
        counts = [0] * len(self.envs)
        if len(self.envs) == 1:
            counts[0] = start
        else:
            for i in itertools.islice(draws, start):
                counts[i] += 1
        streams = [e.task.train_prompts(seed, start=n) for e, n in zip(self.envs, counts, strict=True)]
        for i in draws:
            yield msgspec.structs.replace(next(streams[i]), env=self.envs[i].name)

    def eval_prompts(self, limit: int = 0) -> list[Prompt]:
        """Every environment's held-out prompts (its first ``limit`` when > 0), each carrying its environment."""
        out = []
        for e in self.envs:
            prompts = e.task.eval_prompts()
            out.extend(msgspec.structs.replace(p, env=e.name) for p in (prompts[:limit] if limit else prompts))
        return out

    def metrics(self) -> dict[str, float]:
        """The environments' figures about their data (:class:`~services.tasks.base.TaskMetrics`); in a
        mixture named per environment (``task/skipped_rows`` → ``task/<env>/skipped_rows``)."""
        out: dict[str, float] = {}
        for e in self.envs:
            if not isinstance(e.task, TaskMetrics):
                continue
            for key, value in e.task.metrics().items():
                if self.is_mixture:
                    head, _, tail = key.partition("/")
                    key = f"{head}/{e.name}/{tail}" if tail else f"{e.name}/{head}"
                out[key] = value
        return out


def env_figures(rewards: list[tuple[str, float]], prefix: str = "train") -> dict[str, float]:
    """Per environment, of ``(environment, reward)`` pairs (one per sample): ``<prefix>/<env>/reward_mean``,
    ``<prefix>/<env>/samples`` and ``<prefix>/<env>/share`` (its fraction of the samples)."""
    by_env: dict[str, list[float]] = {}
    for env, reward in rewards:
        by_env.setdefault(env, []).append(reward)
    out: dict[str, float] = {}
    for env, values in sorted(by_env.items()):
        out[f"{prefix}/{env}/reward_mean"] = sum(values) / len(values)
        out[f"{prefix}/{env}/samples"] = float(len(values))
        out[f"{prefix}/{env}/share"] = len(values) / len(rewards)
    return out
