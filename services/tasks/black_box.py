"""Black-box agents: a task whose episode is the user's own agent code, talking to the policy over the
rollout's OpenAI/Anthropic-compatible endpoint.

A :class:`BlackBoxAgentTask` has prompts and a ``reward`` like any task, and an ``async def solve(endpoint,
prompt)``: the agent. Per episode the rollout opens a session on its endpoint and awaits ``solve`` with an
:class:`AgentEndpoint` (the base URL and the session's API key: hand them to any OpenAI or Anthropic client,
or :meth:`AgentEndpoint.openai` builds one). Whatever the agent does between its model calls (tools, retries,
its own prompts) is its business; what the model generated is recorded token for token by the session, and
the episode's trajectory is assembled from it (``services/rollout/black_box.py``). The judge scores the
assistant turns with the task's ``reward`` as for any task; ``solve``'s return value is kept in the sample's
metadata (``agent_answer``).

Budgets (``[services.rollout] agent``): ``max_turns`` model calls, ``max_total_tokens`` tokens (generated and
new prompt tokens after the first call), ``wall_time_s`` for the whole ``solve``. A call past a budget is
answered with an error (the agent sees it); an agent that raises ends its episode with the error, one that
does not return within the wall time is cancelled (its pending calls with it).

A ``solve`` that declares a ``sandbox`` parameter (``async def solve(self, endpoint, prompt, sandbox)``) gets the
episode's own sandbox, created as a command agent's is (below: the task's ``sandbox_files(prompt)``, the
prompt in ``PROMPT_FILE``, egress to the endpoint only): a handle with ``exec``/``write``/``read``
(:class:`services.tasks.sandbox_tools.Sandbox`; the sandbox is paused between them). The agent code itself
runs on the rollout's host; what it execs runs in the sandbox, which the judge may then grade with hidden
tests in a fork (the sandbox is handed over when the episode is scored, destroyed when it fails).

A :class:`CommandAgentTask` is a black-box agent that is a *command* run in the episode's own sandbox (any
harness, any language): ``agent_command`` runs there with :meth:`AgentEndpoint.env` (``OPENAI_BASE_URL``,
``OPENAI_API_KEY``, ``ANTHROPIC_BASE_URL``, ``ANTHROPIC_API_KEY``), the prompt in the file ``PROMPT_FILE`` (its
path in ``RLBUS_PROMPT_FILE``) and the task's ``agent_env(prompt)``; the sandbox's egress allows the endpoint
and nothing else. The rollout runs it (``services/rollout/command_agent.py``); the judge may grade the
sandbox it leaves behind with hidden tests in a fork, as for the ``coding`` task.

verifiers environments run as black-box agent tasks too (:mod:`services.tasks.verifiers_env`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from services.tasks.base import Prompt


@dataclass(frozen=True)
class AgentEndpoint:
    """Where an agent's model calls go: its own session on the rollout's endpoint."""

    #: the OpenAI base URL (``http://host:port/v1``)
    base_url: str
    #: the session's id, to use as the API key
    api_key: str
    #: the model id the endpoint serves (any name is accepted)
    model: str

    @property
    def anthropic_base_url(self) -> str:
        """The base URL for Anthropic clients (they add ``/v1/messages`` themselves)."""
        return self.base_url.removesuffix("/v1")

    def env(self) -> dict[str, str]:
        """Environment variables that point OpenAI and Anthropic clients (and most harnesses) at the session."""
        return {"OPENAI_BASE_URL": self.base_url, "OPENAI_API_KEY": self.api_key,
                "ANTHROPIC_BASE_URL": self.anthropic_base_url, "ANTHROPIC_API_KEY": self.api_key}

    def openai(self, **kwargs: Any) -> Any:
        """An ``openai.AsyncOpenAI`` client for the session (needs the ``agents`` extra)."""
        import openai

        return openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, **kwargs)


class BlackBoxAgentTask:
    """Base of black-box agent tasks: subclasses give prompts, ``reward`` and ``async def solve``."""

    #: the rollout runs this task's episodes through its endpoint (see the module docstring)
    black_box = True
    max_new_tokens = 256
    stop: list[str] = []

    async def solve(self, endpoint: AgentEndpoint, prompt: Prompt) -> Any:
        """The agent: talk to the model through ``endpoint``; the return value is kept as ``agent_answer``.
        Declare a third parameter ``sandbox`` to get the episode's sandbox (see the module docstring)."""
        raise NotImplementedError

    def sandbox_files(self, prompt: Prompt) -> dict[str, bytes]:
        """Files the episode's sandbox starts with (paths relative to its work directory), for an agent that
        has one (a command agent, or a ``solve`` taking ``sandbox``); the prompt file is added."""
        return {}

    def format_prompt(self, tokenizer: Any, prompt: Prompt) -> list[int]:
        """The ticket's prompt ids (the trainer's): the prompt's text. The trajectory's own prompt is what the
        agent's first model call rendered (the sample carries it)."""
        return list(tokenizer.encode(prompt.text or " ", add_special_tokens=False))


def is_black_box_agent(task: object) -> bool:
    """True for tasks whose episodes run user agent code against the endpoint."""
    return getattr(task, "black_box", False) is True and callable(getattr(task, "solve", None))


#: where a command agent finds its prompt's text, relative to the sandbox's work directory
PROMPT_FILE = ".rlbus/prompt.txt"


class CommandAgentTask(BlackBoxAgentTask):
    """Base of tasks whose agent is a command in the episode's sandbox (see the module docstring).

    Subclasses set ``agent_command`` (a shell script, run in the work directory) and give prompts, the
    sandbox's starting files (``sandbox_files``) and a ``reward`` and/or ``hidden_tests`` for the judge."""

    #: the shell script the episode runs in its sandbox
    agent_command: str = ""

    def agent_env(self, prompt: Prompt) -> dict[str, str]:
        """Environment variables of the command beside the endpoint's (its budgets, its model name...)."""
        return {}

    async def solve(self, endpoint: AgentEndpoint, prompt: Prompt) -> Any:
        raise TypeError(f"{type(self).__name__} is a command agent: the rollout runs its agent_command in the "
                        "episode's sandbox (services/rollout/command_agent.py), not solve()")


def is_command_agent(task: object) -> bool:
    """True for black-box agent tasks whose agent is a command in the episode's sandbox."""
    return is_black_box_agent(task) and bool(getattr(task, "agent_command", ""))


def solve_takes_sandbox(task: object) -> bool:
    """True for black-box agent tasks whose Python ``solve`` declares a ``sandbox`` parameter."""
    if not is_black_box_agent(task) or is_command_agent(task):
        return False
    try:
        return "sandbox" in inspect.signature(task.solve).parameters  # type: ignore[attr-defined]
    except (TypeError, ValueError):  # a callable without a readable signature: the plain form
        return False


def needs_sandbox(task: object) -> bool:
    """True for black-box agent tasks whose episodes run with their own sandbox (command or Python agent)."""
    return is_command_agent(task) or solve_takes_sandbox(task)
