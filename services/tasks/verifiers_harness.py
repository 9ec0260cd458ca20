"""rlbus's harness for verifiers environments: a chat loop run in-process, every model call through verifiers'
interception server (and so through the episode's session on the rollout's endpoint).

verifiers 0.4.0 runs an agent as a *harness program* (its ``null``/``bash`` chat programs are PEP 723 scripts
that ``uv`` installs on first use, which needs the network) talking to an interception server that relays each
call to the model client and records it on the trace. Its ``Harness.launch`` contract allows a harness to
run its loop in-process instead, as long as every model call goes through the interception ``endpoint`` with
its ``secret``: this one does, with the ``openai`` client, so nothing is installed and no process is started.

One ``launch`` is one assistant turn, as in verifiers' ``null`` chat program: the task's prompt (or, when an
environment continues the exchange with ``interaction.turn(...)``, the conversation so far, which verifiers
hands back as a Messages prompt) goes to the model, and the reply without a tool call is the program's output.

**Tools.** A task that serves tools (``Task.toolsets`` / ``Taskset.toolsets``: MCP servers that verifiers starts
per episode, in its ``subprocess`` runtime as ``python -m <the toolset's module>``, and hands to the harness as
``mcp_urls``) gets them listed once per launch with verifiers' own MCP client helpers and sent to the model as
OpenAI ``tools`` (named ``<server>_<tool>``, as verifiers' harnesses name them). Each ``tool_calls`` entry of
a reply is run through its server and its result appended as a ``tool`` message; the model is called again
until it answers without a call, or a turn budget refuses the call (verifiers' ``max_turns`` or the rollout's
``agent.max_turns``: the refusal ends the launch as it does for verifiers' own harnesses). A call the tool
cannot serve (an unknown tool, arguments that are not a JSON object, a tool that raises or rejects its
arguments, a server that fails or does not answer within the harness's ``tool_timeout``) comes back to the
model as a ``tool`` message saying ``error: ...``; the episode goes on. The endpoint's session records the calls: generated tokens are trained, tool results (the
template's rendering of the ``tool`` messages) are masked.

verifiers finds a harness by id, importing ``verifiers.v1.harnesses.<id>`` or the bare module ``<id>``; a
dotted id cannot be imported that way, so :func:`harness_id` registers this module under :data:`HARNESS_ID`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from typing import Any

import verifiers.v1 as vf
from verifiers.v1.errors import HarnessError
from verifiers.v1.runtimes import ProgramResult

#: the id rlbus gives its harness in verifiers' configs (an importable, undotted module name)
HARNESS_ID = "rlbus_verifiers_chat"


class RlbusChatConfig(vf.HarnessConfig):
    """No options beyond verifiers' own harness options."""


class RlbusChatHarness(vf.Harness[RlbusChatConfig]):
    """One assistant turn per launch (model calls until a reply without a tool call), in-process, through the
    interception endpoint (see the module docstring)."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_MCP = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx: Any, trace: Any, runtime: Any, endpoint: str, secret: str,
                     mcp_urls: dict[str, str], data: Any, tool_interception_url: str | None = None) -> ProgramResult:
        import openai
        from verifiers.v1.harnesses.utils.mcp import connect_mcp

        system, prompt = self.resolve_prompt(data)
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        else:
            messages += [m.model_dump(mode="json", exclude_none=True) for m in prompt or []]
        async with contextlib.AsyncExitStack() as stack:
            client = openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
            stack.push_async_callback(client.close)
            tools: Any = openai.omit
            tool_servers = Tools({}, {})
            if mcp_urls:
                servers = {"mcpServers": {name: {"url": url} for name, url in mcp_urls.items()}}
                try:
                    schemas, dispatch, connections = await connect_mcp(servers, stack)
                except Exception as e:  # a server that does not list its tools: the launch fails, naming it
                    raise HarnessError(f"listing the tools of {', '.join(sorted(mcp_urls))} failed: "
                                       f"{type(e).__name__}: {e}") from e
                tools, tool_servers = schemas, Tools(dispatch, connections, self.config.tool_timeout)
            while True:
                reply = await client.chat.completions.create(model=ctx.model, messages=messages,  # type: ignore[arg-type]
                                                             tools=tools)
                message = reply.choices[0].message
                if not message.tool_calls:
                    return ProgramResult(exit_code=0, stdout=message.content or "", stderr="")
                messages.append(message.model_dump(mode="json", exclude_none=True))
                for call in message.tool_calls:
                    if call.type != "function":  # a custom (free-form) tool call: rlbus serves function tools
                        name, content = "", f"error: {call.type} tool calls are not served; call a function tool"
                    else:
                        name = call.function.name
                        content = await tool_servers.call(name, call.function.arguments)
                    messages.append({"role": "tool", "tool_call_id": call.id, "name": name, "content": content})
        raise AssertionError("unreachable")  # the loop returns or raises


class Tools:
    """The episode's MCP tools by the name the model calls them (``<server>_<tool>``), and their connections."""

    def __init__(self, dispatch: dict[str, tuple[str, str]], connections: dict[str, Any],
                 timeout_s: float = 600.0) -> None:
        self.dispatch, self.connections, self.timeout_s = dispatch, connections, timeout_s

    async def call(self, name: str, arguments: str) -> Any:
        """The tool's result as a ``tool`` message's content; ``error: ...`` when it cannot be served."""
        from verifiers.v1.harnesses.utils.mcp import call_mcp

        if name not in self.dispatch:
            known = ", ".join(sorted(self.dispatch)) or "none"
            return f"error: unknown tool {name!r}; the tools are: {known}"
        try:
            args = json.loads(arguments or "{}")
        except ValueError as e:
            return f"error: the arguments of {name} are not valid JSON ({e}); resend the call with a JSON object"
        if not isinstance(args, dict):
            return f"error: the arguments of {name} must be a JSON object, got {type(args).__name__}"
        try:
            async with asyncio.timeout(self.timeout_s):
                return await call_mcp(self.connections, self.dispatch, name, args)
        except TimeoutError:
            return f"error: {name} did not answer within {self.timeout_s:g} s"
        except Exception as e:  # the tool server failed: the model reads why, the episode goes on
            return f"error: calling {name} failed: {type(e).__name__}: {e}"


__all__ = ["RlbusChatHarness"]


def harness_id() -> str:
    """The id under which verifiers imports this harness (registered on first use)."""
    sys.modules.setdefault(HARNESS_ID, sys.modules[__name__])
    return HARNESS_ID
