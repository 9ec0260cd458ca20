"""rlbus's harness for verifiers environments: a chat loop run in-process, every model call through verifiers'
interception server (and so through the episode's session on the rollout's endpoint).

verifiers 0.4.0 runs an agent as a *harness program* (its ``null``/``bash`` chat programs are PEP 723 scripts
that ``uv`` installs on first use, which needs the network) talking to an interception server that relays each
call to the model client and records it on the trace. Its ``Harness.launch`` contract allows a harness to
run its loop in-process instead, as long as every model call goes through the interception ``endpoint`` with
its ``secret``: this one does, with the ``openai`` client, so nothing is installed and no process is started.

One ``launch`` is one assistant turn (the ``null`` harness's tool-less chat): the task's prompt (or, when an
environment continues the exchange with ``interaction.turn(...)``, the conversation so far, which verifiers
hands back as a Messages prompt) goes to the model once and the reply is the program's output. Environments
whose tasks serve tools (``Task.toolsets``, MCP servers) are refused: this harness does not call tools yet.

verifiers finds a harness by id, importing ``verifiers.v1.harnesses.<id>`` or the bare module ``<id>``; a
dotted id cannot be imported that way, so :func:`harness_id` registers this module under :data:`HARNESS_ID`.
"""

from __future__ import annotations

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
    """One model call per launch, in-process, through the interception endpoint (see the module docstring)."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx: Any, trace: Any, runtime: Any, endpoint: str, secret: str,
                     mcp_urls: dict[str, str], data: Any, tool_interception_url: str | None = None) -> ProgramResult:
        if mcp_urls:
            raise HarnessError(f"rlbus's verifiers harness does not call tools yet; this task serves "
                               f"{', '.join(sorted(mcp_urls))}")
        import openai

        system, prompt = self.resolve_prompt(data)
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        else:
            messages += [m.model_dump(mode="json", exclude_none=True) for m in prompt or []]
        client = openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
        try:
            reply = await client.chat.completions.create(model=ctx.model, messages=messages)  # type: ignore[arg-type]
        finally:
            await client.close()
        return ProgramResult(exit_code=0, stdout=reply.choices[0].message.content or "", stderr="")


__all__ = ["RlbusChatHarness"]


def harness_id() -> str:
    """The id under which verifiers imports this harness (registered on first use)."""
    sys.modules.setdefault(HARNESS_ID, sys.modules[__name__])
    return HARNESS_ID
