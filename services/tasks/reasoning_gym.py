"""reasoning-gym's procedural datasets as a task: any of its ~100 generators, scored by the dataset's own scorer.

Run-file form::

    [task]
    name = "reasoning_gym"
    options = { dataset = "chain_sum", config = { min_terms = 2, max_terms = 3 }, size = 100000 }

Needs the ``reasoning-gym`` package (``pip install "rlbus[envs]"``); it is imported only when this task is
named (the registry loads this module lazily), never at ``import services.tasks``.

**Where items come from.** A reasoning-gym dataset is a virtual list: item ``i`` of the dataset built with
seed ``S`` is generated from ``random.Random(S + i)`` (for nearly every generator), so two "different seeds"
overlap by a shift. The two splits therefore take disjoint ranges of generator seeds:

* the eval split is items ``0 .. eval_size-1`` of the dataset built with ``eval_seed`` (seeds in
  ``[0, 2**31)``);
* the training stream cycles over ``size`` items of a dataset built with a seed derived from the run's seed
  (seeds in ``[2**31, 2**32)``: below 2**32 because a few generators seed numpy with it), each epoch in an
  order drawn from ``(seed, epoch)``. Prompt ``k`` is a function of ``(seed, k)``, so a resumed trainer
  continues exactly.

Generators with a small space of questions repeat themselves whatever the seed, so a training item whose
question text is also an eval question is replaced by the same slot of one of :data:`ALTERNATES` further
datasets (seeds ``size`` apart, still disjoint from the eval range); when all of them collide too the
dataset has no other question to give, the item is used anyway and counted (``task/eval_overlap``).

**Prompts.** A system message (default: reasoning-gym's own ``SYSTEM_PROMPTS["default"]``, which asks for
the final answer alone inside ``<answer>...</answer>``) and the item's question as the user turn, rendered
with the tokenizer's chat template.

**Reward.** The answer is the text inside the *last* ``<answer>...</answer>`` of the completion, whitespace
stripped (reasoning-gym's ``utils.extract_answer``); no tag scores 0.0. It is scored by the dataset's own
``score_answer(answer, entry)`` (1.0 for a right answer; some datasets give partial credit; a scorer that
raises on an unreadable answer scores 0.0 with the error as the reason). The judge needs the item itself:
it regenerates it from the generator seed and index the prompt carries (exact Python types, which some
scorers compare), and when the regenerated question is not the one the model saw (a generator that depends
on string hashing, e.g. ``polynomial_multiplication``) it uses the JSON copy of the item the prompt carries.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import logging
import random
from collections.abc import Iterator
from fractions import Fraction
from functools import cached_property, lru_cache
from math import gcd, isfinite
from typing import Any

from services.runtime.config import ConfigError
from services.tasks.base import Prompt, Reward, did_you_mean, encode_chat, encode_text, register_task

log = logging.getLogger("rlbus.tasks.reasoning_gym")

#: further training datasets tried, in turn, for an item whose question is an eval question
ALTERNATES = 4
#: generator seeds: the eval split below TRAIN_SEED_BASE, the training stream from it up to 2**32
TRAIN_SEED_BASE = 2**31
#: the training stream's largest size (its seeds, ALTERNATES + 1 datasets of ``size``, fit in 2**31)
MAX_SIZE = 100_000_000
#: config keys the task sets itself
_OWN_KEYS = {"seed": "the seed comes from [run] seed (train) and task.options.eval_seed (eval)",
             "size": "set task.options.size (train) and task.options.eval_size (eval)"}
INSTALL_HINT = 'pip install "rlbus[envs]" (or pip install reasoning-gym)'


class ReasoningGymError(ConfigError):
    """An option of the reasoning_gym task is unusable (the message names the key). A :class:`ConfigError`:
    retrying cannot help, the run file must change."""


def _reasoning_gym() -> Any:
    try:
        import reasoning_gym
        import reasoning_gym.factory
        import reasoning_gym.utils
    except ImportError as e:
        raise ReasoningGymError(f"task 'reasoning_gym' needs the reasoning-gym package ({e}): {INSTALL_HINT}") from e
    return reasoning_gym


def _json_default(value: Any) -> Any:
    """What JSON cannot hold, as near as it gets (sets sorted, fractions and the rest as text)."""
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=repr)
    if isinstance(value, Fraction):
        return str(value)
    return str(value)


@register_task("reasoning_gym")
class ReasoningGymTask:
    """Items of one reasoning-gym dataset (see the module docstring).

    Args:
        dataset: the reasoning-gym dataset's name (``basic_arithmetic``, ``chain_sum``, ``leg_counting``, ...).
        config: fields of the dataset's config (its dataclass; ``seed`` and ``size`` are the task's own).
        size: distinct items in the training stream, which it goes over epoch after epoch.
        eval_size: items in the fixed eval split.
        eval_seed: generator seed of the eval split (0 <= eval_seed, eval_seed + eval_size <= 2**31).
        system_prompt: the system message; omitted: reasoning-gym's default, asking for
            ``<answer>...</answer>``; ``""``: none (then the question alone must say how to answer).
        max_new_tokens: the completion budget.
    """

    name = "reasoning_gym"
    stop: list[str] = []

    def __init__(self, dataset: str = "", config: dict[str, Any] | None = None, size: int = 100_000,
                 eval_size: int = 200, eval_seed: int = 20261202, system_prompt: str | None = None,
                 max_new_tokens: int = 256, **unknown: Any) -> None:
        if unknown:
            known = [k for k in inspect.signature(ReasoningGymTask).parameters if k != "unknown"]
            key = sorted(unknown)[0]
            raise ReasoningGymError(f"task.options.{key}: unknown option of the reasoning_gym task; "
                                    f"{did_you_mean(key, known)}known: {', '.join(known)}")
        rg = _reasoning_gym()
        datasets = sorted(rg.factory.DATASETS)
        if not dataset:
            raise ReasoningGymError("task.options.dataset: name a reasoning-gym dataset (e.g. chain_sum); "
                                    f"{len(datasets)} are installed: {', '.join(datasets)}")
        if dataset not in rg.factory.DATASETS:
            close = did_you_mean(dataset, datasets)
            listed = f"{len(datasets)} are installed (reasoning_gym.factory.DATASETS)" if close else \
                f"installed: {', '.join(datasets)}"
            raise ReasoningGymError(f"task.options.dataset: {dataset!r} is not a reasoning-gym dataset; "
                                    f"{close}{listed}")
        if not 1 <= size <= MAX_SIZE:
            raise ReasoningGymError(f"task.options.size: must be in 1..{MAX_SIZE}, got {size}")
        if eval_size < 1:
            raise ReasoningGymError(f"task.options.eval_size: must be at least 1, got {eval_size}")
        if not 0 <= eval_seed <= TRAIN_SEED_BASE - eval_size:
            raise ReasoningGymError(f"task.options.eval_seed: must be in 0..{TRAIN_SEED_BASE - eval_size} (so the "
                                    f"eval items' generator seeds stay below the training stream's), got {eval_seed}")
        if max_new_tokens < 1:
            raise ReasoningGymError(f"task.options.max_new_tokens: must be at least 1, got {max_new_tokens}")
        self.dataset, self.size, self.eval_size, self.eval_seed = dataset, size, eval_size, eval_seed
        self.config = self._checked_config(rg, dataset, config)
        self.system_prompt = rg.utils.SYSTEM_PROMPTS["default"] if system_prompt is None else system_prompt
        self.max_new_tokens = max_new_tokens
        #: the dataset and config in every prompt: a judge built from other options refuses to score it
        self.digest = hashlib.sha256(json.dumps([dataset, self.config], sort_keys=True, default=str).encode()
                                     ).hexdigest()[:16]
        #: training items used although an eval question (the dataset had no other question to give)
        self.eval_overlap = 0
        self._instance = lru_cache(maxsize=2 + ALTERNATES)(self._build)
        self._item = lru_cache(maxsize=1024)(self._generate)
        # one item now: a config value of the wrong type fails at start-up, not in the middle of the run
        try:
            self._item(eval_seed, eval_size, 0)
        except Exception as e:  # the generator's own error, of any type: the config is what to change
            raise ReasoningGymError(f"task.options.config: dataset {dataset!r} cannot generate an item with "
                                    f"{self.config}: {type(e).__name__}: {e}") from e

    @staticmethod
    def _checked_config(rg: Any, dataset: str, config: Any) -> dict[str, Any]:
        """``config`` checked against the dataset's config dataclass (each bad key named) and its ``validate``."""
        if config is None:
            config = {}
        if not isinstance(config, dict):
            raise ReasoningGymError(f"task.options.config: must be a table of the dataset's config fields, "
                                    f"got {config!r}")
        config_cls = rg.factory.DATASETS[dataset][1]
        fields = [f.name for f in dataclasses.fields(config_cls) if f.name not in _OWN_KEYS]
        for key in config:
            if key in _OWN_KEYS:
                raise ReasoningGymError(f"task.options.config.{key}: not settable here: {_OWN_KEYS[key]}")
            if key not in fields:
                raise ReasoningGymError(f"task.options.config.{key}: not a field of {dataset}'s config "
                                        f"({config_cls.__name__}); {did_you_mean(key, fields)}fields: {', '.join(fields)}")
        own = {k: v for k, v in (("seed", 0), ("size", 1)) if k in {f.name for f in dataclasses.fields(config_cls)}}
        try:
            built = config_cls(**config, **own)
            if hasattr(built, "validate"):
                built.validate()
        except Exception as e:  # validate() asserts; a value of the wrong type raises anything
            raise ReasoningGymError(f"task.options.config: {dataset}'s config refuses {config}: "
                                    f"{type(e).__name__}: {e}") from e
        return dict(config)

    # --- items ---

    def _build(self, seed: int, size: int) -> Any:
        return _reasoning_gym().create_dataset(self.dataset, seed=seed, size=size, **self.config)

    def _generate(self, seed: int, size: int, index: int) -> dict[str, Any]:
        return self._instance(seed, size)[index]

    def _train_seed(self, seed: int) -> int:
        """The generator seed of the run's training dataset (alternate ``r`` adds ``r * size``)."""
        h = int.from_bytes(hashlib.sha256(f"reasoning-gym-train:{self.dataset}:{seed}".encode()).digest()[:8])
        return TRAIN_SEED_BASE + h % (2**32 - TRAIN_SEED_BASE - (ALTERNATES + 1) * self.size)

    def _epoch_index(self, seed: int, position: int) -> int:
        """The dataset index at ``position``: epoch ``e`` visits every index once, in the order of the
        affine map ``j -> (a*j + b) mod size`` drawn from ``(seed, e)`` (a permutation in O(1) memory)."""
        epoch, j = divmod(position, self.size)
        rng = random.Random(f"reasoning-gym-epoch:{seed}:{epoch}")
        a = rng.randrange(1, self.size) if self.size > 1 else 1
        while gcd(a, self.size) != 1:
            a = rng.randrange(1, self.size)
        return (a * j + rng.randrange(self.size)) % self.size

    def _prompt(self, prompt_id: str, source: tuple[int, int, int], entry: dict[str, Any]) -> Prompt:
        question = str(entry["question"])
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        messages.append({"role": "user", "content": question})
        metadata = {"dataset": self.dataset, "digest": self.digest, "source": ":".join(map(str, source)),
                    "entry": json.dumps(entry, default=_json_default)}
        if entry.get("answer") is not None:  # some datasets have no one right answer (their scorer checks)
            metadata["answer"] = str(entry["answer"])
        return Prompt(id=prompt_id, text=question, messages=messages, metadata=metadata)

    @cached_property
    def _eval(self) -> list[Prompt]:
        return [self._prompt(f"reasoning_gym/{self.dataset}/eval/{k}", (self.eval_seed, self.eval_size, k),
                             self._item(self.eval_seed, self.eval_size, k)) for k in range(self.eval_size)]

    @cached_property
    def _eval_questions(self) -> frozenset[str]:
        return frozenset(p.text for p in self._eval)

    def train_prompts(self, seed: int, start: int = 0) -> Iterator[Prompt]:
        """Endless; prompt id ``reasoning_gym/<dataset>/train/<seed>/<position>``."""
        base = self._train_seed(seed)
        position = start
        while True:
            index = self._epoch_index(seed, position)
            for r in range(ALTERNATES + 1):
                source = (base + r * self.size, self.size, index)
                entry = self._item(*source)
                if str(entry["question"]) not in self._eval_questions:
                    break
            else:
                source, entry = (base, self.size, index), self._item(base, self.size, index)
                self.eval_overlap += 1
            yield self._prompt(f"reasoning_gym/{self.dataset}/train/{seed}/{position}", source, entry)
            position += 1

    def eval_prompts(self) -> list[Prompt]:
        """The held-out split; prompt id ``reasoning_gym/<dataset>/eval/<k>``."""
        return list(self._eval)

    def metrics(self) -> dict[str, float]:
        """``task/eval_overlap``: training items that are also eval questions (:class:`~services.tasks.base.TaskMetrics`)."""
        return {"task/eval_overlap": float(self.eval_overlap)}

    def format_prompt(self, tokenizer: Any, prompt: Prompt) -> list[int]:
        """The chat template over the system message and the question (contents joined by blank lines when
        the tokenizer has no template)."""
        if not prompt.messages:
            raise ValueError(f"prompt {prompt.id} has no messages; reasoning_gym prompts are chat prompts")
        if getattr(tokenizer, "chat_template", None):
            return encode_chat(tokenizer, prompt.messages)
        return encode_text(tokenizer, "\n\n".join(m["content"] for m in prompt.messages) + "\n\n")

    # --- reward ---

    def _entry(self, prompt: Prompt) -> tuple[Any, dict[str, Any], str]:
        """(the dataset instance, the item, how it was found) for ``prompt``."""
        try:
            seed, size, index = (int(part) for part in prompt.metadata["source"].split(":"))
        except (KeyError, ValueError) as e:
            raise ValueError(f"prompt {prompt.id} carries no reasoning_gym source (metadata 'source' "
                             f"{prompt.metadata.get('source')!r}); was it made by this task?") from e
        entry = self._item(seed, size, index)
        if not prompt.text or str(entry["question"]) == prompt.text:
            return self._instance(seed, size), entry, "regenerated"
        return self._instance(seed, size), json.loads(prompt.metadata["entry"]), "as sent (JSON)"

    def reward(self, prompt: Prompt, completion: str) -> Reward:
        """The dataset's ``score_answer`` of the last ``<answer>...</answer>`` of the completion.

        Raises ValueError when the prompt was made from another dataset or config than this judge's
        ``[task.options]``, or the scorer returns something that is not a number in [0, 1] (the judge
        scores the sample failed, with the reason)."""
        sent = prompt.metadata.get("digest")
        if sent != self.digest:
            raise ValueError(f"prompt {prompt.id} was made from reasoning-gym dataset "
                             f"{prompt.metadata.get('dataset')!r} with another config (digest {sent}) than this "
                             f"judge's {self.dataset!r} {self.config} ({self.digest}): run the judge with the "
                             "trainer's run file (one [task] section)")
        rg = _reasoning_gym()
        answer = rg.utils.extract_answer(completion, tag_name="answer", strip=True)
        if answer is None:
            return Reward(0.0, "no <answer>...</answer> in the completion")
        dataset, entry, how = self._entry(prompt)
        try:
            value = dataset.score_answer(answer, entry)
        except Exception as e:  # a scorer that cannot read the answer: a wrong answer, not a failed sample
            return Reward(0.0, f"{self.dataset}'s scorer raised {type(e).__name__} on {answer[:80]!r}: {e}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (isfinite(value)
                                                                                 and 0.0 <= value <= 1.0):
            raise ValueError(f"{self.dataset}'s score_answer returned {value!r}, not a number in [0, 1]")
        expected = prompt.metadata.get("answer")
        return Reward(float(value), f"answer {answer[:80]!r} scored {float(value):g} by {self.dataset}'s "
                                    f"score_answer (item {how}" + (f", expected {expected[:80]!r})" if expected
                                                                   is not None else ")"))
