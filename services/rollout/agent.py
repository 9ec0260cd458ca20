"""Sandbox agents: the environment whose tools run in the episode's own sandbox, and its lifecycle.

The episode itself runs in the one loop of ``services/rollout/episode.py`` (:class:`EpisodeLoop`);
:class:`SandboxEnvironment` is the environment it calls (create the sandbox in ``reset``, run the model's
code-block call in ``step``), and :class:`AgentLoop` is what is specific to sandboxes around the episode:
retries on a lost instance, the submission, the hand-off to the judge, destroying what is not handed off.

**Tool-call format**: see :mod:`services.tasks.tools` (tasks put its ``TOOL_FORMAT_DOC`` in their
system prompt).

**Token accounting.** Assistant turns keep the engine's tokens, per-token behaviour logprobs and weight
versions; an observation is a ``Turn(role="tool")`` whose token ids are exactly what the model is conditioned
on next (the chat template's end-of-message, the observation message, the next assistant header), so the
trainer's forward pass over ``prompt + all turns`` sees what the engine saw, and masks tool tokens out of the
loss. ``Turn.text`` of agent turns is the decoded tokens without special tokens.

**Sandbox ownership.** Each loop creates its own sandbox (lease = wall time + margins) and *pauses it
whenever it waits on inference*: create → pause → [generate → resume → tool → pause]* → the task's
submission files are written → the sandbox is **handed to the judge** paused, its lease extended to
``handoff_lease_s``; the judge forks it for hidden tests and destroys it once the trajectory is published.
With ``handoff = false``, or when the rollout failed, the loop destroys it itself. An expired lease is the
safety net for a sandbox nobody destroys (a crashed judge, a duplicate rollout).

**Failures stay local.** A sandbox that fails or stops answering ends only its own rollout, with
``finish_reason = "error"`` and the reason in ``error``; the rollout is still published (it reaches the judge,
which scores it 0 and says why, and the trainer's accounting).

**A lost instance costs no rollout.** When the sandbox instance that owns the episode's sandbox stops or
crashes (the client says ``instance_gone``), the sandbox and everything in it are gone: the episode starts
again from its beginning on a new sandbox (the create reaches a live instance), up to
``AgentSection.sandbox_retries`` times, each attempt with its own wall time. The backends keep no snapshot
outside the instance, so there is nothing nearer to resume from; the engine's work for the lost attempt is
the price. The rollout records how often it was retried (``AgentOutcome.sandbox_retries``, counter
``sandbox_retries``).
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

from proto import sandbox as api
from services.lib.engine.base import Engine, SamplingParams
from services.lib.sandbox_client import SandboxClient, SandboxClientError
from services.rollout.config import AgentSection
from services.rollout.episode import EnvironmentFailed, EpisodeLoop, EpisodeOutcome
from services.rollout.frame import ChatFrame
from services.rollout.sandbox_env import SandboxedEnvironment, exec_result
from services.tasks.base import Prompt
from services.tasks.env import Action, Start, Step
from services.tasks.tools import (
    FENCE_STOP,
    AgentTask,
    NotATool,
    ToolCall,
    is_agent_task,
    opens_block,
    parse_tool_call,
)

log = logging.getLogger("rlbus.rollout.agent")

#: what one agent episode produced (the episode loop's outcome)
AgentOutcome = EpisodeOutcome
__all__ = ["AgentLoop", "AgentOutcome", "AgentSandboxError", "ChatFrame", "SandboxEnvironment", "describe_exec"]


def describe_exec(reply: api.ExecReply, limit: int) -> str:
    """An exec's result as the model reads it (status line, then the output, each stream cut to ``limit``)."""
    return str(exec_result(reply, limit))


class AgentSandboxError(Exception):
    """The rollout's sandbox failed (not the model's doing): the rollout ends with finish_reason "error"."""


class SandboxEnvironment:
    """One episode's sandbox environment: ``reset`` creates the sandbox (paused while the model generates),
    ``step`` runs the turn's code-block call in it (:mod:`services.tasks.tools`); the turn without a call ends
    the episode. Trusted (code of this repository with its own timeouts): sandbox errors reach
    :class:`AgentLoop`, which knows them."""

    trusted = True

    def __init__(self, task: AgentTask, sandboxes: SandboxClient, cfg: AgentSection, labels: dict[str, str],
                 counters: dict[str, int]) -> None:
        self.task = task
        self.sandboxes = sandboxes
        self.cfg = cfg
        self.labels = labels
        self.counters = counters
        self.sandbox_id: str | None = None
        self.written: set[str] = set()
        self.tool_calls = 0

    async def reset(self, prompt: Prompt) -> Start:
        cfg = self.cfg
        limits = api.Limits(memory_mb=cfg.sandbox.memory_mb, pids=cfg.sandbox.pids, cpus=cfg.sandbox.cpus,
                            disk_mb=cfg.sandbox.disk_mb, inodes=cfg.sandbox.inodes)
        created = await self.sandboxes.create(
            base=cfg.sandbox.base, limits=limits, files=self.task.sandbox_files(prompt), egress=cfg.sandbox.egress,
            lease_ttl_s=cfg.wall_time_s + 2 * cfg.sandbox_timeout_s + 60.0, labels=self.labels)
        self.sandbox_id = created.sandbox_id
        await self.sandboxes.pause(self.sandbox_id)  # it waits for the first generation
        return Start(messages=list(prompt.messages or []), stop=(FENCE_STOP,))

    def continues(self, text: str) -> bool:
        """A bare opening fence matches the closing fence's stop string: the message goes on."""
        return opens_block(text)

    async def step(self, state: Any, action: Action) -> Step:
        call = parse_tool_call(action.text, self.task.tools)
        if call is None:
            return Step(done=True)  # the final answer
        if action.final:
            return Step()  # no turn left to read the result: not run
        observation = await self._tool(self.sandbox_id, call, self.written)
        self.tool_calls += 1
        self.counters["tool_calls"] += 1
        return Step(observations=[{"role": self.cfg.observation_role, "content": observation}])

    async def _tool(self, sandbox_id: str | None, call: ToolCall | NotATool, written: set[str]) -> str:
        """Run one call in the (paused) sandbox: resume, act, pause. Returns the observation text."""
        if isinstance(call, NotATool):
            return (f"error: a ```{call.language} block is not a tool. Use ```python to run Python, ```bash to run "
                    "a shell command, or ```<language> file=PATH to write a file.")
        if sandbox_id is None:
            raise AgentSandboxError("no sandbox to run the tool in")
        await self.sandboxes.resume(sandbox_id)
        failed = True
        try:
            observation = await self._act(sandbox_id, call, written)
            failed = False
        finally:
            if failed:  # keep the original error; the pause is best effort
                try:
                    await self.sandboxes.pause(sandbox_id)
                except SandboxClientError as e:
                    log.debug("sandbox %s not paused after a failed tool call: %s", sandbox_id, e)
            else:
                await self.sandboxes.pause(sandbox_id)
        return observation

    async def _act(self, sandbox_id: str, call: ToolCall, written: set[str]) -> str:
        limit = self.cfg.max_observation_chars
        if call.tool == "write":
            path = call.path or ""
            try:
                reply = await self.sandboxes.write_files(sandbox_id, {path: call.body.encode()})
            except SandboxClientError as e:
                if e.code == "invalid":  # the model asked for a bad path: its mistake, told as an observation
                    return f"error: cannot write {path}: {e.error.message}"
                raise
            written.add(path)
            return f"wrote {path} ({reply.bytes} bytes)"
        if call.tool == "python":
            command: api.Command = api.Argv(args=["python3", "-"])
            stdin = call.body.encode()
        else:
            command, stdin = api.Shell(script=call.body), b""
        reply = await self.sandboxes.exec(sandbox_id, command, stdin=stdin, timeout_s=self.cfg.exec_timeout_s,
                                          max_output_bytes=4 * limit)
        return describe_exec(reply, limit)



class AgentLoop:
    """Sandbox agent episodes on a shared engine and sandbox client (through the one episode loop); one
    instance serves every agent episode of a process."""

    def __init__(self, engine: Engine, tokenizer: Any, sandboxes: SandboxClient, cfg: AgentSection,
                 episodes: EpisodeLoop | None = None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.sandboxes = sandboxes
        self.cfg = cfg
        self.episodes = episodes or EpisodeLoop(engine, tokenizer, cfg)
        self.active = 0
        self.counters = {"rollouts": 0, "tool_calls": 0, "errors": 0, "wall_time": 0, "sandbox_retries": 0}

    async def run(self, task: Any, prompt: Prompt, prompt_ids: list[int], params: SamplingParams,
                  labels: dict[str, str] | None = None) -> AgentOutcome:
        """One episode of a sandbox agent task, or of an environment whose tools use the sandbox. Sandbox failures and requests the engine refuses end the rollout with an error
        instead of raising (a sandbox lost with its instance first starts the episode again, up to
        ``sandbox_retries`` times); anything else (the engine stopping, cancellation) propagates after the
        sandbox is destroyed."""
        self.active += 1
        try:
            retries = 0
            while True:
                out, gone = await self._attempt(task, prompt, prompt_ids, params, labels or {})
                if not gone or retries >= self.cfg.sandbox_retries:
                    break
                retries += 1
                self.counters["sandbox_retries"] += 1
                log.warning("agent rollout %s lost its sandbox with the sandbox instance (%s); starting the episode "
                            "again on a new sandbox (retry %d of %d)", prompt.id, out.error, retries,
                            self.cfg.sandbox_retries)
            out.sandbox_retries = retries
        finally:
            self.active -= 1
        if out.error is not None:
            self.counters["errors"] += 1
            log.warning("agent rollout %s ended with an error: %s", prompt.id, out.error)
        self.counters["rollouts"] += 1
        return out

    async def _attempt(self, task: Any, prompt: Prompt, prompt_ids: list[int], params: SamplingParams,
                       labels: dict[str, str]) -> tuple[AgentOutcome, bool]:
        """The episode from its start on a new sandbox; also says whether it failed because the sandbox's
        instance is gone (then the sandbox went with it: nothing to destroy). ``task``: a sandbox agent task
        (markdown tools), or an environment whose tools use the sandbox (``services/rollout/sandbox_env.py``)."""
        out = AgentOutcome(turns=[], finish_reason="error")
        env: SandboxEnvironment | SandboxedEnvironment
        if is_agent_task(task):
            env = SandboxEnvironment(task, self.sandboxes, self.cfg, labels, self.counters)
        else:
            env = SandboxedEnvironment(task, self.episodes.bounded, self.sandboxes, self.cfg, labels)
        settled = False
        gone = False
        try:
            try:
                await self.episodes.run(env, prompt, prompt_ids, params, labels, out=out)
            finally:
                out.sandbox_id = env.sandbox_id
                out.tool_calls += env.tool_calls  # the markdown tools count in the environment, others in the loop
            if out.finish_reason == "wall_time":
                self.counters["wall_time"] += 1
            if out.error is None and out.sandbox_id is not None:
                await self._finish_sandbox(env, prompt, out, env.written)
            settled = True
        except EnvironmentFailed as e:  # the environment's submission_files failed
            out.finish_reason, out.error = "error", f"environment: {e}"
            settled = True
        except (SandboxClientError, AgentSandboxError) as e:
            out.finish_reason, out.error = "error", f"sandbox: {e}"
            gone = isinstance(e, SandboxClientError) and e.instance_gone
            settled = True
        finally:
            if not settled and out.sandbox_id is not None:
                await self.destroy_quietly(out.sandbox_id)
        if out.error is not None and out.sandbox_id is not None and not gone:
            await self.destroy_quietly(out.sandbox_id)
        return out, gone

    async def _finish_sandbox(self, env: Any, prompt: Prompt, out: AgentOutcome, written: set[str]) -> None:
        """Write the submission, then hand the sandbox to the judge (paused, longer lease) or destroy it."""
        sid = out.sandbox_id
        if sid is None:
            return
        files = (env.task if isinstance(env, SandboxEnvironment) else env).submission_files(
            prompt, out.assistant_texts, written)
        if inspect.isawaitable(files):
            files = await files
        if files:
            await self.sandboxes.resume(sid)
            await self.sandboxes.write_files(sid, files)
        await self.sandboxes.pause(sid)  # also after a wall-time cut mid-tool
        if self.cfg.handoff:
            await self.sandboxes.renew_lease(sid, self.cfg.handoff_lease_s)
            out.handed_off = True
        else:
            await self.sandboxes.destroy(sid)

    async def destroy_quietly(self, sandbox_id: str) -> None:
        try:
            await self.sandboxes.destroy(sandbox_id)
        except SandboxClientError as e:
            log.debug("sandbox %s could not be destroyed (%s); its lease will expire", sandbox_id, e)
