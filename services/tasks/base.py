"""What a task is, and the registry that finds tasks by name.

A task is a prompt source (a deterministic training stream and a fixed
held-out eval split) plus a reward function. Services never import a task
module directly: they call :func:`get_task` with the name from the run config.

Adding a task without touching the services::

    # mypkg/tasks.py
    from services.tasks import Prompt, Reward, register_task

    @register_task("my-task")          # for code imported anyway, or ...
    class MyTask: ...

    # ... in your package's pyproject.toml, so rlbus finds it when installed:
    [project.entry-points."rlbus.tasks"]
    my-task = "mypkg.tasks:MyTask"

The entry point names a class or factory; ``get_task("my-task", **options)``
calls it with the options from the run config.
"""

from __future__ import annotations

import difflib
import importlib.metadata
import inspect
import logging
from collections.abc import Callable, Iterator
from typing import Any, Protocol, runtime_checkable

import msgspec

log = logging.getLogger("rlbus.tasks")

ENTRY_POINT_GROUP = "rlbus.tasks"


class Prompt(msgspec.Struct, frozen=True, kw_only=True):
    """One prompt of a task.

    ``text`` is a raw prompt (completion-style models); ``messages`` a chat
    conversation (``[{"role": ..., "content": ...}]``) for chat models; a task
    sets the one its ``format_prompt`` uses. ``metadata`` is what the reward
    function needs (``"answer"`` by convention); strings only, so it travels in
    a prompt ticket unchanged.
    """

    id: str
    text: str = ""
    messages: list[dict[str, str]] | None = None
    metadata: dict[str, str] = {}
    #: the environment (task name) of a mixture this prompt was drawn from (set by the mixture,
    #: :mod:`services.tasks.mixture`; empty: the run's one task)
    env: str = ""

    @property
    def answer(self) -> str | None:
        """The expected answer, if the task records one under ``metadata["answer"]``."""
        return self.metadata.get("answer")


class Reward(msgspec.Struct, frozen=True):
    """A reward in [0, 1] and a short human-readable reason."""

    value: float
    explanation: str = ""


@runtime_checkable
class Task(Protocol):
    """A prompt source plus a reward function.

    Attributes:
        name: the registry name.
        max_new_tokens: a sensible completion budget for this task.
        stop: stop strings that end a completion (besides EOS).
    """

    name: str
    max_new_tokens: int
    stop: list[str]

    def train_prompts(self, seed: int, start: int = 0) -> Iterator[Prompt]:
        """An endless, deterministic stream of training prompts.

        The stream is a function of ``seed`` alone; ``start`` skips to a data
        position so a resumed trainer continues where its checkpoint left off
        (prompt ``k`` of the stream is the same whether reached from 0 or ``k``).
        Training prompts never coincide with eval prompts.
        """
        ...

    def eval_prompts(self) -> list[Prompt]:
        """The fixed held-out evaluation prompts (same on every call and machine)."""
        ...

    def reward(self, prompt: Prompt, completion: str) -> Reward:
        """Score ``completion`` (decoded text, special tokens removed) for ``prompt``."""
        ...

    def format_prompt(self, tokenizer: Any, prompt: Prompt) -> list[int]:
        """The token ids a model is conditioned on for ``prompt``."""
        ...


@runtime_checkable
class TaskMetrics(Protocol):
    """Optional part of a task: figures about its data (named by path, e.g. ``task/skipped_rows``), which the
    trainer reports once it has built the task's prompts."""

    def metrics(self) -> dict[str, float]:
        """The figures now."""
        ...


class UnknownTaskError(LookupError):
    """No task is registered (or installed as an entry point) under the name."""


class TaskOptionTypeError(TypeError):
    """A task option was given a list or a table where the task takes one value (the message names the key)."""


class TaskRegistrationError(ValueError):
    """A task name is taken by a different factory, or an entry point failed to load."""


TaskFactory = Callable[..., Task]
_REGISTRY: dict[str, TaskFactory] = {}


def register_task(name: str) -> Callable[[TaskFactory], TaskFactory]:
    """Decorator: register a task class or factory under ``name``.

    Raises:
        TaskRegistrationError: ``name`` is already registered to another factory.
    """

    def decorate(factory: TaskFactory) -> TaskFactory:
        existing = _REGISTRY.get(name)
        if existing is not None and existing is not factory:
            raise TaskRegistrationError(
                f"task {name!r} is already registered by {existing.__module__}.{existing.__qualname__}; "
                "choose another name"
            )
        _REGISTRY[name] = factory
        return factory

    return decorate


#: built-in tasks imported on first use: ``coding`` imports other service packages (the judge's graders, the
#: agent loop), so importing ``services.tasks`` never forms an import cycle; ``reasoning_gym``, ``textarena``,
#: ``openenv`` and ``verifiers`` import an optional package (``rlbus[envs]``, ``rlbus[agents]``) that takes time to import and need not be installed
_LAZY_BUILTINS = {"coding": "services.tasks.coding", "reasoning_gym": "services.tasks.reasoning_gym",
                  "textarena": "services.tasks.textarena_env", "openenv": "services.tasks.openenv_env",
                  "swe_fix": "services.tasks.swe_fix",
                  "verifiers": "services.tasks.verifiers_env"}


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def available_tasks() -> list[str]:
    """Names of registered tasks and of installed ``rlbus.tasks`` entry points (not loaded)."""
    return sorted(set(_REGISTRY) | set(_LAZY_BUILTINS) | set(_entry_points()))


def get_task(name: str, **options: Any) -> Task:
    """Build the task registered as ``name`` with ``options`` (from the run config).

    Built-in tasks are found first; otherwise the ``rlbus.tasks`` entry point of
    that name is loaded (only that one, so a broken plugin cannot break others).

    Raises:
        UnknownTaskError: no such task; the message lists the known ones.
        TaskRegistrationError: the entry point exists but could not be imported.
    """
    if name not in _REGISTRY and name in _LAZY_BUILTINS:
        importlib.import_module(_LAZY_BUILTINS[name])  # registers itself
    factory = _REGISTRY.get(name)
    if factory is None:
        entry_point = _entry_points().get(name)
        if entry_point is None:
            raise UnknownTaskError(
                f"unknown task {name!r}; known tasks: {', '.join(available_tasks()) or '(none)'}. "
                f"Register one with @register_task or a {ENTRY_POINT_GROUP!r} entry point."
            )
        try:
            factory = entry_point.load()
        except (ImportError, AttributeError) as exc:
            raise TaskRegistrationError(
                f"entry point {name!r} ({entry_point.value}) of group {ENTRY_POINT_GROUP!r} failed to load: {exc}"
            ) from exc
        _REGISTRY.setdefault(name, factory)
    _check_list_options(name, factory, options)
    task = factory(**options)
    if not isinstance(task, Task):
        raise TaskRegistrationError(
            f"task {name!r} built a {type(task).__name__} that lacks part of the Task protocol "
            "(name, max_new_tokens, stop, train_prompts, eval_prompts, reward, format_prompt)"
        )
    return task


#: words in a parameter's annotation that say it takes several values
_LIST_WORDS = ("list", "List", "Sequence", "Iterable", "tuple", "Any")
#: words in a parameter's annotation that say it takes a table
_TABLE_WORDS = ("dict", "Dict", "Mapping", "Any")


def _check_list_options(name: str, factory: TaskFactory, options: dict[str, Any]) -> None:
    """A list or a table given for an option the factory declares as one value is refused, naming the key (the
    factory's own code would otherwise fail somewhere inside, or take the list for a value)."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin or C factory: nothing to check against
        return
    for key, value in options.items():
        param = params.get(key)
        if not isinstance(value, (list, dict)) or param is None or param.annotation is inspect.Parameter.empty:
            continue
        declared = param.annotation if isinstance(param.annotation, str) else repr(param.annotation)
        kind, words = ("list", _LIST_WORDS) if isinstance(value, list) else ("table", _TABLE_WORDS)
        if not any(word in declared for word in words):
            raise TaskOptionTypeError(f"task.options.{key}: task {name!r} takes one value here ({declared}), "
                                      f"got the {kind} {value!r}")


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """``text`` as token ids with the tokenizer's BOS in front (if it has one), nothing after."""
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    bos = tokenizer.bos_token_id
    return [bos, *ids] if bos is not None else ids


def encode_chat(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """A chat conversation through the tokenizer's chat template, ready for the assistant's turn."""
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(rendered, add_special_tokens=False))


def did_you_mean(name: str, known: list[str]) -> str:
    """``"did you mean a, b? "`` for the entries of ``known`` close to ``name`` (an option's misspelt value or
    key), ``""`` when none is."""
    close = difflib.get_close_matches(name, known, n=5, cutoff=0.5)
    return f"did you mean {', '.join(close)}? " if close else ""
