"""A user environment whose tools work in the episode's sandbox: the sandbox handle, and the wrapper that owns it.

:class:`SandboxedEnvironment` wraps an environment that uses a sandbox (:func:`services.tasks.sandbox_tools.
uses_sandbox`) for :class:`services.rollout.agent.AgentLoop`, which gives it what sandbox agents have: a
sandbox created before ``reset`` (with the environment's ``sandbox_files(prompt)`` if it has them), retries
on a lost instance, the hand-off to the judge (whose graders may fork it) or the destruction at the end. The
wrapper is *trusted* (sandbox errors reach the AgentLoop, which knows them); the user's ``reset`` and ``step``
inside it stay bounded by the episode loop's hook, so a hanging or raising environment still ends only its
episode.

:class:`EpisodeSandbox` is the handle the tools get: the sandbox stays paused while the model generates and
is resumed only while at least one tool call of the turn works in it (parallel calls share one resume).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from proto import sandbox as api
from services.lib.sandbox_client import SandboxClient, SandboxClientError
from services.rollout.config import AgentSection
from services.tasks.base import Prompt
from services.tasks.env import Action, Start, Step
from services.tasks.sandbox_tools import ExecResult

log = logging.getLogger("rlbus.rollout.sandbox_env")


def _text(data: bytes, limit: int) -> str:
    text = data.decode("utf-8", errors="replace")
    return text if len(text) <= limit else f"{text[:limit]}\n... [{len(text) - limit} more characters cut]"


def exec_result(reply: api.ExecReply, limit: int) -> ExecResult:
    """An exec's reply as tools and models read it, each output stream cut to ``limit`` characters."""
    return ExecResult(exit_code=reply.exit_code, stdout=_text(reply.stdout, limit), stderr=_text(reply.stderr, limit),
                      timed_out=reply.timed_out, oom_killed=reply.oom_killed, duration_s=reply.duration_s)


class EpisodeSandbox:
    """The episode's sandbox for its tools (:class:`services.tasks.sandbox_tools.Sandbox`)."""

    def __init__(self, sandboxes: SandboxClient, sandbox_id: str, cfg: AgentSection) -> None:
        self.sandboxes = sandboxes
        self.sandbox_id = sandbox_id
        self.cfg = cfg
        self._active = 0
        self._lock = asyncio.Lock()

    async def _enter(self) -> None:
        async with self._lock:
            if self._active == 0:
                await self.sandboxes.resume(self.sandbox_id)
            self._active += 1

    async def _leave(self) -> None:
        async with self._lock:
            self._active -= 1
            if self._active == 0:
                try:
                    await self.sandboxes.pause(self.sandbox_id)
                except SandboxClientError as e:  # best effort: the next resume or the lease settles it
                    log.debug("sandbox %s not paused after a tool: %s", self.sandbox_id, e)

    async def exec(self, command: str | Sequence[str], *, stdin: bytes = b"", env: dict[str, str] | None = None,
                   timeout_s: float | None = None) -> ExecResult:
        limit = self.cfg.max_observation_chars
        await self._enter()
        try:
            reply = await self.sandboxes.exec(self.sandbox_id, command if isinstance(command, str) else list(command),
                                              stdin=stdin, env=env, timeout_s=timeout_s or self.cfg.exec_timeout_s,
                                              max_output_bytes=4 * limit)
        finally:
            await self._leave()
        return exec_result(reply, limit)

    async def write(self, path: str, data: bytes | str) -> int:
        await self._enter()
        try:
            reply = await self.sandboxes.write_files(self.sandbox_id, {path: data.encode() if isinstance(data, str)
                                                                       else data})
        except SandboxClientError as e:
            if e.code == "invalid":  # a bad path: the caller's mistake, raised as such
                raise ValueError(f"cannot write {path}: {e.error.message}") from None
            raise
        finally:
            await self._leave()
        return reply.bytes

    async def read(self, path: str) -> bytes:
        await self._enter()
        try:
            return await self.sandboxes.read_file(self.sandbox_id, path)
        finally:
            await self._leave()


class SandboxedEnvironment:
    """One episode of a user environment that uses a sandbox (see the module docstring)."""

    trusted = True

    def __init__(self, inner: Any, bounded: Any, sandboxes: SandboxClient, cfg: AgentSection,
                 labels: dict[str, str]) -> None:
        self.inner = inner
        self.bounded = bounded  # the episode loop's bounded call of environment code (EpisodeLoop.bounded)
        self.sandboxes = sandboxes
        self.cfg = cfg
        self.labels = labels
        self.sandbox_id: str | None = None
        self.written: set[str] = set()
        self.tool_calls = 0  # counted by the episode loop itself
        self.continues = getattr(inner, "continues", None)

    async def reset(self, prompt: Prompt) -> Start:
        cfg = self.cfg
        files_of = getattr(self.inner, "sandbox_files", None)
        files = await self.bounded(files_of, dict, prompt) if files_of is not None else {}
        limits = api.Limits(memory_mb=cfg.sandbox.memory_mb, pids=cfg.sandbox.pids, cpus=cfg.sandbox.cpus,
                            disk_mb=cfg.sandbox.disk_mb, inodes=cfg.sandbox.inodes)
        created = await self.sandboxes.create(
            base=cfg.sandbox.base, limits=limits, files=files, egress=cfg.sandbox.egress,
            lease_ttl_s=cfg.wall_time_s + 2 * cfg.sandbox_timeout_s + 60.0, labels=self.labels)
        self.sandbox_id = created.sandbox_id
        await self.sandboxes.pause(self.sandbox_id)  # it waits for the first generation
        start = await self.bounded(self.inner.reset, Start, prompt)
        start.sandbox = EpisodeSandbox(self.sandboxes, self.sandbox_id, cfg)
        return start

    async def step(self, state: Any, action: Action) -> Step:
        return await self.bounded(self.inner.step, Step, state, action)

    async def submission_files(self, prompt: Prompt, assistant_texts: list[str], written: set[str]
                               ) -> dict[str, bytes]:
        """The inner environment's files to write at the end (``submission_files``, optional), else none."""
        fn = getattr(self.inner, "submission_files", None)
        return await self.bounded(fn, dict, prompt, assistant_texts, written) if fn is not None else {}
