"""Environments: what an episode talks to. One protocol for single-turn tasks, typed-function tools and sandboxes.

An **environment**, per prompt, gives the first messages and its tools (:meth:`Environment.reset`), answers
each assistant turn (:meth:`Environment.step`: observation messages, an optional reward for the turn, done or
not, its own per-episode state) and has the finished episode scored. The rollout runs every episode through
one loop (``services/rollout/episode.py``) that calls these methods; the judge scores the finished episode
with the task's graders (by default its ``reward(prompt, completion)``), as for any task.

**Reward of an episode** (what the trainer gets as the trajectory's reward)::

    reward = sum(turn rewards) + final score

no discounting; a turn whose ``Step.reward`` is None adds nothing, so an environment without turn rewards
is scored exactly as before. The turn reward travels on the answered assistant turn (``Turn.reward`` in
``proto/rollouts.py``); the judge adds them to its graders' weighted mean and lists their sum as the grader
``turn_rewards`` (weight 0: it is not part of the mean). An episode that failed (``error`` set: an
environment that raised or hung, a sandbox lost) is scored 0 with the reason, its turn rewards dropped.

**First messages and the prompt's tokens.** The trainer tokenises the prompt with the task's
``format_prompt`` into the ticket's ``prompt_ids``; the rollout never re-renders it. An environment with
tools renders its first messages *and its tools' schemas* through the chat template there:
:class:`FunctionEnvironment` does it (:func:`encode_chat_with_tools`), so ``reset(prompt).messages`` must be
a function of the prompt alone (per-episode randomness belongs in ``state``).

**Tools** are typed Python functions (sync or ``async def``; schema from the signature and docstring,
:mod:`services.tasks.function_tools`). The loop parses each assistant turn with the configured parser
(:mod:`services.tasks.toolcalls`), runs the calls bounded (``services/rollout/tool_runner.py``: timeout,
exceptions, unserialisable or oversized results become error observations) and passes the results to
``step``, which adds its own observations, a turn reward and done. The default ``step`` of
:class:`FunctionEnvironment`: done when the turn makes no call.

**A single-turn task** (prompts + ``reward``) is the environment with no tools and one turn:
:func:`environment_of` wraps it in :class:`SingleTurn`, which the loop recognises and runs as one
generation (no template rendering, no parsing: the single-turn path costs what it did before).

**Budgets** (``[services.rollout] agent``: ``max_turns``, ``max_total_tokens``, ``wall_time_s``) bound every
multi-turn episode; hitting one ends it with ``finish_reason`` ``turn_limit``, ``token_budget`` or
``wall_time``. A single-turn episode is bounded by its ticket's ``max_new_tokens`` as before.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from services.tasks.base import Prompt, Task
from services.tasks.function_tools import function_schema

#: a chat message as chat templates take it (``role``, ``content``; ``tool_call_id``/``name`` on tool results)
Message = dict[str, Any]


@dataclass
class Start:
    """What :meth:`Environment.reset` gives: the first messages, the tools (typed functions), the episode state."""

    messages: list[Message]
    tools: Sequence[Callable[..., Any]] = ()
    state: Any = None
    #: stop strings the episode's generations add to the ticket's (e.g. the markdown tools' closing fence)
    stop: Sequence[str] = ()
    #: the episode's sandbox (a :class:`services.tasks.sandbox_tools.Sandbox`), set by the rollout for an
    #: environment that uses one; tools that take a ``Sandbox`` parameter get it
    sandbox: Any = None


@dataclass(frozen=True)
class ToolResult:
    """One call of the turn as it ran: its id and name, the observation text, and the error kind if it failed
    (``timeout``, ``exception``, ``not_json``, ``bad_call``, ``unknown_tool``, ``parse``; None when it ran)."""

    call_id: str
    name: str
    content: str
    error: str | None = None


@dataclass(frozen=True)
class Action:
    """An assistant turn as the environment sees it: its text, and (tool environments) what its calls gave."""

    text: str
    results: list[ToolResult] = field(default_factory=list)
    #: the turn index (0 = first assistant turn)
    index: int = 0
    #: calls the turn made (well-formed or not); on the last allowed turn they are not run (``results`` empty)
    calls: int = 0
    #: no turn is left after this one: whatever ``step`` says, the episode ends (``turn_limit`` unless done)
    final: bool = False
    #: the episode's sandbox handle (environments that use one, :mod:`services.tasks.sandbox_tools`), else None
    sandbox: Any = None


@dataclass
class Step:
    """The environment's answer to one assistant turn.

    ``observations``: messages the model reads next (after the tool results the loop already adds);
    ``reward``: this turn's reward (None: none); ``done``: the episode ends here; ``state``: the next state.
    """

    observations: list[Message] = field(default_factory=list)
    reward: float | None = None
    done: bool = False
    state: Any = None


@runtime_checkable
class Environment(Protocol):
    """Per prompt: first messages and tools; per assistant turn: observations, turn reward, done, state.

    Either method may be ``async def``; a sync one runs in a thread, bounded by a timeout like the tools.
    """

    def reset(self, prompt: Prompt) -> Start:
        """The episode's first messages, tools and state (the messages must depend on ``prompt`` alone)."""
        ...

    def step(self, state: Any, action: Action) -> Step:
        """Answer one assistant turn."""
        ...


def is_environment(task: object) -> bool:
    """True for a task that is an environment of its own (has ``reset`` and ``step``)."""
    return isinstance(task, Environment)


class SingleTurn:
    """A plain task as an environment: no tools, one turn, the prompt's tokens as the trainer made them."""

    single_turn = True

    def __init__(self, task: Task | None = None) -> None:
        self.task = task

    def reset(self, prompt: Prompt) -> Start:
        return Start(messages=list(prompt.messages or [{"role": "user", "content": prompt.text}]))

    def step(self, state: Any, action: Action) -> Step:
        return Step(done=True)


def environment_of(task: Any) -> Any:
    """The environment a task runs as: the task itself when it is one, else :class:`SingleTurn`."""
    return task if is_environment(task) else SingleTurn(task)


def tool_schemas(tools: Sequence[Callable[..., Any]]) -> list[dict[str, Any]]:
    """The OpenAI function-tool schemas of ``tools``, as chat templates take them."""
    return [function_schema(fn) for fn in tools]


def encode_chat_with_tools(tokenizer: Any, messages: list[Message], tools: Sequence[Callable[..., Any]]) -> list[int]:
    """The first messages and the tools' schemas through the chat template, ready for the assistant's turn."""
    rendered = tokenizer.apply_chat_template(messages, tools=tool_schemas(tools) or None,
                                             add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(rendered, add_special_tokens=False))


class FunctionEnvironment:
    """A base for environments whose tools are typed Python functions (composition helpers, not required).

    Subclasses set :attr:`tools` (functions) and implement ``train_prompts``/``eval_prompts``/``reward`` as any
    task; ``format_prompt`` renders the first messages with the tools; the default ``step`` ends the episode
    on the first turn without a call and gives no turn reward.
    """

    tools: Sequence[Callable[..., Any]] = ()

    def reset(self, prompt: Prompt) -> Start:
        return Start(messages=list(prompt.messages or [{"role": "user", "content": prompt.text}]), tools=self.tools)

    def step(self, state: Any, action: Action) -> Step:
        return Step(done=action.calls == 0, state=state)

    def format_prompt(self, tokenizer: Any, prompt: Prompt) -> list[int]:
        start = self.reset(prompt)
        if inspect.isawaitable(start):
            raise TypeError(f"{type(self).__name__}.reset is async: override format_prompt to render the first "
                            "messages without it")
        return encode_chat_with_tools(tokenizer, start.messages, start.tools)
