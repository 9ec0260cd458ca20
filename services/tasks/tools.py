"""The tool-call format of agent tasks: what the model writes, and what an agent task provides.

**Tool-call format** (what the model writes; tasks put :data:`TOOL_FORMAT_DOC` in their system prompt).
A tool call is a Markdown code block, the thing chat models already write, so it fits any chat template:

* ```` ```<language> file=<path> ```` ... ```` ``` ```` — **write**: the block's body becomes the file ``<path>``
  (relative to the sandbox's work directory);
* ```` ```python ```` ... ```` ``` ```` — **python**: the body runs as a fresh ``python3`` script in the work
  directory (so ``from solution import f`` finds a written ``solution.py``);
* ```` ```bash ```` (or ``sh``) ... ```` ``` ```` — **bash**: the body runs as a shell script.

Generation stops at the first closing fence (stop string :data:`FENCE_STOP`), so an assistant message holds
at most one call, at its end. The tool's result comes back as the next message (role
``AgentSection.observation_role``, framed by the tokenizer's chat template) and generation continues. A message
without a complete code block is the model's final answer. A block in a language that is no tool gets an
error observation that names the tools.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

from services.tasks.base import Prompt

ToolName = Literal["write", "python", "bash"]
TOOLS: tuple[ToolName, ...] = ("write", "python", "bash")
#: stop string that ends an assistant message right after a code block closes
FENCE_STOP = "\n```\n"
_PYTHON = {"python", "python3", "py"}
_SHELL = {"bash", "sh", "shell", "console"}
_OPEN = re.compile(r"(?:^|\n)```([^\n`]*)\n")
_CLOSE = re.compile(r"\n```[ \t]*(?:\n|$)")
_FENCE_LINE = re.compile(r"(?:^|\n)```")
_FILE_ARG = re.compile(r"(?:file|path)\s*=\s*[\"']?([^\s\"']+)")

TOOL_FORMAT_DOC = """\
You can use tools by writing a Markdown code block; its result comes back in the next message.
- Write a file: a code block whose first line names the file, e.g. ```python file=solution.py
- Run Python: a ```python code block runs as a script in your working directory.
- Run a shell command: a ```bash code block.
Use one code block per message. Reply without a code block when you are done."""


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: ``tool`` with the block's ``body`` (and ``path`` for writes)."""

    tool: ToolName
    body: str
    path: str | None = None


@dataclass(frozen=True)
class NotATool:
    """A complete code block that names no enabled tool (the model is told which exist)."""

    language: str


def parse_tool_call(text: str, tools: Sequence[str] = TOOLS) -> ToolCall | NotATool | None:
    """The first complete fenced code block of an assistant message as a tool call.

    ``None`` when the message has no complete block (an open block cut by a token limit counts as none):
    the message is a final answer.
    """
    opening = _OPEN.search(text)
    if opening is None:
        return None
    body_start = opening.end()
    closing = _CLOSE.search(text, body_start - 1)
    if closing is None:
        return None
    body = text[body_start:closing.start()] if closing.start() >= body_start else ""
    info = opening.group(1).strip()
    language = info.split()[0].lower() if info else ""
    path = _FILE_ARG.search(info)
    if path is not None and "write" in tools:
        return ToolCall(tool="write", body=body if body.endswith("\n") or not body else body + "\n",
                        path=path.group(1))
    if language in _PYTHON and "python" in tools:
        return ToolCall(tool="python", body=body)
    if language in _SHELL and "bash" in tools:
        return ToolCall(tool="bash", body=body)
    return NotATool(language=info or "(none)")


def opens_block(text: str) -> bool:
    """True when ``text`` ends inside a code block (an odd number of fence lines)."""
    return len(_FENCE_LINE.findall(text)) % 2 == 1


@runtime_checkable
class AgentTask(Protocol):
    """What a task adds to :class:`services.tasks.base.Task` for multi-turn agent rollouts.

    ``tools``: the enabled subset of :data:`TOOLS`.
    """

    tools: tuple[str, ...]

    def sandbox_files(self, prompt: Prompt) -> dict[str, bytes]:
        """Files the rollout's sandbox starts with (work-directory relative paths)."""
        ...

    def submission_files(self, prompt: Prompt, assistant_texts: list[str], written: set[str]) -> dict[str, bytes]:
        """Files written into the sandbox when the episode ends (e.g. the final answer's code), given the
        assistant messages and the paths the model wrote itself; ``{}`` for none."""
        ...


def is_agent_task(task: object) -> bool:
    """True for tasks that run as multi-turn agent loops in sandboxes with the markdown tools (an environment of
    its own, with ``reset``/``step``, is not one even when it has these attributes)."""
    return isinstance(task, AgentTask) and not (callable(getattr(task, "reset", None))
                                                and callable(getattr(task, "step", None)))
