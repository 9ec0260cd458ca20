"""Tools that act in the episode's own sandbox: typed functions given the sandbox handle, and shell commands.

A function tool that needs files or processes declares one parameter annotated :class:`Sandbox`; the episode
loop passes the episode's sandbox there, and the schema the model sees leaves that parameter out::

    async def run_tests(sandbox: Sandbox, path: str = "tests") -> str:
        \"\"\"Run the test suite.

        Args:
            path: the tests' directory.
        \"\"\"
        return str(await sandbox.exec(["python3", "-m", "pytest", "-q", path]))

Such a tool must be ``async def`` (the handle is the rollout's asynchronous sandbox client; a sync tool taking
it is refused when the tools are offered). A **command tool** is a shell script declared with its typed
arguments, run in the sandbox with each argument in an environment variable of its name (never spliced
into the script, so no quoting problem and no injection)::

    grep_repo = sandbox_command("grep_repo", 'grep -rn -- "$pattern" .', "Search the repository.",
                                pattern=(str, "a regular expression"))

An environment whose tools take the sandbox, or that sets ``sandbox = True``, runs its episodes with a
sandbox of their own (``services/rollout/agent.py``): created before ``reset`` with the environment's
optional ``sandbox_files(prompt)``, paused while the model generates and resumed only while a tool runs,
handed to the judge at the end (its graders may fork it) or destroyed. The sandbox's limits, base and egress
are the rollout's ``[services.rollout] agent.sandbox`` settings. ``Action.sandbox`` gives an ``async`` ``step``
the same handle.

This module is the tasks layer's side (the protocol and the declarations); the rollout implements the handle.
"""

from __future__ import annotations

import inspect
import keyword
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class ExecResult:
    """A command's result in the sandbox; ``str()`` is what a model reads (status line, then the output)."""

    exit_code: int | None
    stdout: str
    stderr: str
    timed_out: bool = False
    oom_killed: bool = False
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and not self.oom_killed

    def __str__(self) -> str:
        if self.timed_out:
            status = f"timed out after {self.duration_s:.1f} s"
        elif self.oom_killed:
            status = "killed: out of memory"
        else:
            status = f"exit code {self.exit_code}"
        parts = [status]
        if self.stdout:
            parts.append(f"stdout:\n{self.stdout}")
        if self.stderr:
            parts.append(f"stderr:\n{self.stderr}")
        if not self.stdout and not self.stderr:
            parts.append("(no output)")
        return "\n".join(parts)


@runtime_checkable
class Sandbox(Protocol):
    """The episode's sandbox as a tool sees it (paths relative to its work directory)."""

    async def exec(self, command: str | Sequence[str], *, stdin: bytes = b"", env: dict[str, str] | None = None,
                   timeout_s: float | None = None) -> ExecResult:
        """Run a shell script (``str``) or an argv list; output cut to the rollout's observation limit."""
        ...

    async def write(self, path: str, data: bytes | str) -> int:
        """Write one file (parents created); returns the bytes written."""
        ...

    async def read(self, path: str) -> bytes:
        """One file's content (:class:`FileNotFoundError` with the reason when it cannot be read)."""
        ...


class SandboxToolError(TypeError):
    """A sandbox tool declared so that it cannot be offered (the message says what to change)."""


def sandbox_param(fn: Callable[..., Any]) -> str | None:
    """The name of ``fn``'s parameter annotated :class:`Sandbox`, or None when it takes no sandbox."""
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # unresolvable hints: function_schema reports them with the tool's name
        return None
    names = [n for n, h in hints.items() if n != "return" and h is Sandbox]
    if len(names) > 1:
        raise SandboxToolError(f"tool {getattr(fn, '__name__', fn)!r} takes the sandbox twice ({', '.join(names)});"
                               " declare one parameter annotated Sandbox")
    return names[0] if names else None


def uses_sandbox(env: Any) -> bool:
    """True for an environment whose episodes need a sandbox: it says so (``sandbox = True``) or one of its
    tools (``tools``) takes the sandbox."""
    if getattr(env, "sandbox", False) is True:
        return True
    tools = getattr(env, "tools", ())
    if not isinstance(tools, (list, tuple)):
        return False
    return any(callable(t) and sandbox_param(t) is not None for t in tools)


#: an argument of a command tool: its type, or (type, description)
ArgSpec = type | tuple[type, str]


def sandbox_command(name: str, script: str, description: str, *, timeout_s: float | None = None,
                    **arguments: ArgSpec) -> Callable[..., Any]:
    """A tool named ``name`` that runs the shell ``script`` in the episode's sandbox with each argument in the
    environment variable of its name (``"$pattern"``; lists and dicts as JSON, booleans as ``true``/``false``).
    The model reads the exit code and the output. ``arguments``: ``name=type`` or ``name=(type, description)``,
    all required; types as for function tools (``str``, ``int``, ``float``, ``bool``, ``list[str]``...)."""
    import json  # local: only command tools need it

    params: list[inspect.Parameter] = [inspect.Parameter("sandbox", inspect.Parameter.KEYWORD_ONLY,
                                                         annotation=Sandbox)]
    annotations: dict[str, Any] = {"sandbox": Sandbox, "return": str}
    docs: list[str] = []
    for arg, spec in arguments.items():
        kind, doc = spec if isinstance(spec, tuple) else (spec, "")
        if not arg.isidentifier() or keyword.iskeyword(arg) or arg == "sandbox":
            raise SandboxToolError(f"command tool {name!r}: argument {arg!r} must be a Python identifier other "
                                   "than 'sandbox' (it becomes an environment variable of the same name)")
        params.append(inspect.Parameter(arg, inspect.Parameter.KEYWORD_ONLY, annotation=kind))
        annotations[arg] = kind
        if doc:
            docs.append(f"    {arg}: {doc}")

    async def command(*, sandbox: Sandbox, **kwargs: Any) -> str:
        env = {k: (v if isinstance(v, str) else json.dumps(v)) for k, v in kwargs.items()}
        return str(await sandbox.exec(script, env=env, timeout_s=timeout_s))

    command.__name__ = command.__qualname__ = name
    command.__doc__ = description + ("\n\nArgs:\n" + "\n".join(docs) if docs else "")
    command.__annotations__ = annotations
    command.__signature__ = inspect.Signature(params, return_annotation=str)  # type: ignore[attr-defined]
    return command
