"""Command agents: a black-box agent that is a command run in the episode's own sandbox.

Per episode (:class:`CommandAgents`, called by :class:`services.rollout.black_box.BlackBoxLoop` in place of
``solve``):

1. **create** the sandbox with the task's ``sandbox_files(prompt)`` plus the prompt's text in
   ``PROMPT_FILE``, the rollout's sandbox limits, and an egress allowlist of exactly one entry: the endpoint's
   ``agent_host:port``. A sandbox has only a loopback interface; its egress proxy (``HTTP_PROXY`` in every
   exec, served by the sandbox service outside the sandbox) connects to allowed targets only and refuses
   loopback ones, so the endpoint must listen on an address the sandbox service reaches that is not loopback
   (``[services.rollout] endpoint.host = "0.0.0.0"``; ``agent_host`` is what agents are given).
2. **run** ``agent_command`` in the work directory with the session's ``OPENAI_BASE_URL``/``OPENAI_API_KEY``/
   ``ANTHROPIC_BASE_URL``/``ANTHROPIC_API_KEY``, ``RLBUS_MODEL`` (the served model's name),
   ``RLBUS_PROMPT_FILE`` and the task's ``agent_env(prompt)``,
   under the exec time limit ``wall_time_s``. The calls and tokens budgets are the session's: a call past
   them is refused (400 ``session_budget_exhausted``) and the harness is expected to stop; one that keeps
   running is cut at the wall time.
3. **read the exit**: past the wall time → ``wall_time`` (also when the exec's reply is lost after its limit,
   an overloaded sandbox service); a non-zero exit while the budgets still held →
   the episode ends with ``error`` and the exit code and the end of stderr (after a refused call, the exit is
   the budget's: ``turn_limit``/``token_budget``, and the episode is scored).
4. **settle** the sandbox once the trajectory is known: a scored episode's sandbox is paused and handed to
   the judge (its lease extended: hidden tests run in a fork), or destroyed (``agent.handoff = false``); an
   episode that failed destroys it.

Steps 1 and 4 (:meth:`CommandAgents.create`, :meth:`CommandAgents.settle`) also serve a Python agent whose
``solve`` takes the episode's sandbox (``services/rollout/black_box.py``).

Not done here: starting the episode again when the sandbox's instance is lost (sandbox agents do; a command
agent's episode ends with the sandbox error).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from proto import sandbox as api
from services.lib.sandbox_client import SandboxClient, SandboxClientError, SandboxTimeout
from services.rollout.config import AgentSection
from services.rollout.episode import EpisodeOutcome
from services.tasks.base import Prompt
from services.tasks.black_box import PROMPT_FILE, AgentEndpoint

log = logging.getLogger("rlbus.rollout.command_agent")

#: characters of the command's stderr kept in an episode's error, and of its stdout kept as ``agent_answer``
TAIL_CHARS = 600


class CommandAgentError(Exception):
    """The command agent's episode cannot run as configured (the reason says what to change)."""


def _tail(data: bytes, limit: int = TAIL_CHARS) -> str:
    text = data.decode("utf-8", errors="replace").strip()
    return text if len(text) <= limit else "..." + text[-limit:]


def egress_entry(host: str, port: int) -> str:
    """The allowlist entry of the endpoint (``[v6]:port`` for an IPv6 address)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class CommandAgents:
    """Runs command agents' episodes in sandboxes (see the module docstring); one per rollout."""

    def __init__(self, sandboxes: SandboxClient, cfg: AgentSection) -> None:
        self.sandboxes = sandboxes
        self.cfg = cfg

    async def create(self, task: Any, egress: str, prompt: Prompt, out: EpisodeOutcome,
                     labels: dict[str, str]) -> str:
        """Create the episode's sandbox (step 1 of the module docstring; a Python agent's that takes one too):
        the task's ``sandbox_files(prompt)`` plus the prompt file, the rollout's limits, egress to the endpoint
        only. Its id goes to ``out.sandbox_id`` (so :meth:`settle` finds it) and is returned. Sandbox failures
        raise SandboxClientError; an endpoint the sandbox cannot reach raises CommandAgentError."""
        cfg = self.cfg
        files_of = getattr(task, "sandbox_files", None)
        files = {**(files_of(prompt) if files_of is not None else {}), PROMPT_FILE: (prompt.text or "").encode()}
        limits = api.Limits(memory_mb=cfg.sandbox.memory_mb, pids=cfg.sandbox.pids, cpus=cfg.sandbox.cpus,
                            disk_mb=cfg.sandbox.disk_mb, inodes=cfg.sandbox.inodes)
        try:
            created = await self.sandboxes.create(
                base=cfg.sandbox.base, limits=limits, files=files, egress=[egress],
                lease_ttl_s=cfg.wall_time_s + 2 * cfg.sandbox_timeout_s + 60.0, labels=labels)
        except SandboxClientError as e:
            if e.code == "invalid" and egress in e.error.message:
                raise CommandAgentError(
                    f"{e}; the sandbox cannot reach the endpoint at {egress}: set [services.rollout.endpoint] "
                    'host = "0.0.0.0" (or agent_host to an address of this host that is not loopback)') from None
            raise
        out.sandbox_id = created.sandbox_id
        return created.sandbox_id

    async def run(self, task: Any, endpoint: AgentEndpoint, egress: str, prompt: Prompt, out: EpisodeOutcome,
                  labels: dict[str, str]) -> tuple[str | None, str | None]:
        """Create the sandbox (its id in ``out.sandbox_id``), run the command, note its exit in ``out``.
        Returns the end of its stdout (the episode's ``agent_answer``) and, for a non-zero exit, the reason
        (the caller ends the episode with it unless the session's budget was spent). Sandbox failures raise
        SandboxClientError (the caller ends the episode with them)."""
        cfg = self.cfg
        await self.create(task, egress, prompt, out, labels)
        env = {**task.agent_env(prompt), **endpoint.env(), "RLBUS_MODEL": endpoint.model,
               "RLBUS_PROMPT_FILE": PROMPT_FILE}
        started = time.monotonic()
        try:
            reply = await self.sandboxes.exec(out.sandbox_id, task.agent_command, env=env,
                                              timeout_s=cfg.wall_time_s, max_output_bytes=64 * 1024)
        except SandboxTimeout:
            if time.monotonic() - started < cfg.wall_time_s:
                raise
            # the exec's own limit passed and its reply did not come within the client's margin (an overloaded
            # sandbox service): the service cuts the command at that limit, so the episode ends at its wall time
            log.warning("agent command in sandbox %s: no reply after its %.0f s limit; ended at the wall time",
                        out.sandbox_id, cfg.wall_time_s)
            out.finish_reason = "wall_time"
            return None, None
        out.metadata["agent_exit_code"] = str(reply.exit_code)
        out.metadata["agent_exec_s"] = f"{reply.duration_s:.3f}"
        failure = None
        if reply.timed_out:
            out.finish_reason = "wall_time"
        elif reply.exit_code != 0:
            why = " (OOM-killed)" if reply.oom_killed else ""
            failure = f"agent command exited with {reply.exit_code}{why}: {_tail(reply.stderr) or '(no stderr)'}"
        return _tail(reply.stdout) or None, failure

    async def settle(self, out: EpisodeOutcome) -> None:
        """Hand a scored episode's sandbox to the judge (paused, lease extended) or destroy it; destroy a failed
        one (its id is then dropped from ``out``: there is nothing to grade)."""
        sid = out.sandbox_id
        if sid is None:
            return
        if out.error is None:
            try:
                await self.sandboxes.pause(sid)
                if self.cfg.handoff:
                    await self.sandboxes.renew_lease(sid, self.cfg.handoff_lease_s)
                    out.handed_off = True
                    return
            except SandboxClientError as e:
                out.finish_reason, out.error = "error", f"sandbox: {e}"
        out.sandbox_id = None
        await self.destroy_quietly(sid)

    async def destroy_quietly(self, sandbox_id: str) -> None:
        try:
            await self.sandboxes.destroy(sandbox_id)
        except SandboxClientError as e:
            log.debug("sandbox %s could not be destroyed (%s); its lease will expire", sandbox_id, e)
