"""Multi-turn agent loops: the model writes, tools run in the rollout's own sandbox, observations come back.

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

import asyncio
import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

from proto import sandbox as api
from proto.rollouts import FinishReason, Turn
from services.lib.engine.base import (
    Engine,
    EngineOverloadedError,
    GenerationResult,
    InvalidRequestError,
    SamplingParams,
)
from services.lib.sandbox_client import SandboxClient, SandboxClientError
from services.rollout.config import AgentSection
from services.runtime import tracing
from services.tasks.base import Prompt
from services.tasks.tools import (
    FENCE_STOP,
    AgentTask,
    NotATool,
    ToolCall,
    opens_block,
    parse_tool_call,
)

log = logging.getLogger("rlbus.rollout.agent")


class ChatFrame:
    """Turns an observation into the tokens that follow an assistant message, using the chat template.

    The template is rendered once around two markers; what follows the assistant's content (its
    end-of-message, the observation message's header) and what follows the observation (its end, the next
    assistant header) frame every observation. Tokenizers without a chat template get a plain-text frame.
    """

    _A = "\x00ASSISTANT\x00"
    _O = "\x00OBSERVATION\x00"

    def __init__(self, tokenizer: Any, role: str = "user") -> None:
        self.tokenizer = tokenizer
        self.role = role
        self.eos_ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        self.eos_text = tokenizer.eos_token or ""
        self.head, self.tail = self._frame()

    def _frame(self) -> tuple[str, str]:
        if getattr(self.tokenizer, "chat_template", None):  # tokenizers may lack the attribute entirely
            messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                        {"role": "assistant", "content": self._A}, {"role": self.role, "content": self._O}]
            try:
                rendered = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            except Exception as e:  # templates may refuse roles or orders: fall back to plain text
                log.warning("chat template cannot render a %r observation (%s); using a plain-text frame",
                            self.role, e)
            else:
                after = rendered.split(self._A, 1)[-1]
                if self._O in after:
                    head, tail = after.split(self._O, 1)
                    return head, tail
        return "\n\n[output]\n", "\n[/output]\n\n"

    def observation(self, assistant_ids: list[int], text: str) -> tuple[list[int], str]:
        """Token ids (and their text without special tokens) of one observation after ``assistant_ids``."""
        head = self.head
        if assistant_ids and assistant_ids[-1] in self.eos_ids and self.eos_text and head.startswith(self.eos_text):
            head = head[len(self.eos_text):]  # the model already closed its message
        ids = list(self.tokenizer.encode(head + text + self.tail, add_special_tokens=False))
        return ids, self.tokenizer.decode(ids, skip_special_tokens=True)


def _cut(data: bytes, limit: int) -> str:
    text = data.decode("utf-8", errors="replace")
    if len(text) <= limit:
        return text
    return f"{text[:limit]}\n... [{len(text) - limit} more characters cut]"


def describe_exec(reply: api.ExecReply, limit: int) -> str:
    """An exec's result as the model reads it."""
    if reply.timed_out:
        status = f"timed out after {reply.duration_s:.1f} s"
    elif reply.oom_killed:
        status = "killed: out of memory"
    else:
        status = f"exit code {reply.exit_code}"
    parts = [status]
    if reply.stdout:
        parts.append("stdout:\n" + _cut(reply.stdout, limit))
    if reply.stderr:
        parts.append("stderr:\n" + _cut(reply.stderr, limit))
    if not reply.stdout and not reply.stderr:
        parts.append("(no output)")
    return "\n".join(parts)


class AgentSandboxError(Exception):
    """The rollout's sandbox failed (not the model's doing): the rollout ends with finish_reason "error"."""


@dataclass
class AgentOutcome:
    """What one agent loop produced."""

    turns: list[Turn]
    finish_reason: FinishReason
    sandbox_id: str | None = None
    error: str | None = None
    tool_calls: int = 0
    #: True when the sandbox was handed to the judge (alive, paused, lease extended)
    handed_off: bool = False
    assistant_texts: list[str] = field(default_factory=list)
    #: times the episode started again on a new sandbox because its sandbox's instance was gone
    sandbox_retries: int = 0


class AgentLoop:
    """Runs agent loops on a shared engine and sandbox client; one instance serves every loop of a process."""

    def __init__(self, engine: Engine, tokenizer: Any, sandboxes: SandboxClient, cfg: AgentSection) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.sandboxes = sandboxes
        self.cfg = cfg
        self.frame = ChatFrame(tokenizer, cfg.observation_role)
        self.active = 0
        self.counters = {"rollouts": 0, "tool_calls": 0, "errors": 0, "wall_time": 0, "sandbox_retries": 0}

    async def run(self, task: AgentTask, prompt: Prompt, prompt_ids: list[int], params: SamplingParams,
                  labels: dict[str, str] | None = None) -> AgentOutcome:
        """One episode. Sandbox failures and requests the engine refuses end the rollout with an error
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

    async def _attempt(self, task: AgentTask, prompt: Prompt, prompt_ids: list[int], params: SamplingParams,
                       labels: dict[str, str]) -> tuple[AgentOutcome, bool]:
        """The episode from its start on a new sandbox; also says whether it failed because the sandbox's
        instance is gone (then the sandbox went with it: nothing to destroy)."""
        out = AgentOutcome(turns=[], finish_reason="error")
        written: set[str] = set()
        settled = False
        gone = False
        try:
            try:
                async with asyncio.timeout(self.cfg.wall_time_s):
                    with tracing.span("agent loop", **labels):
                        await self._episode(task, prompt, prompt_ids, params, labels, out, written)
            except TimeoutError:
                out.finish_reason = "wall_time"
                self.counters["wall_time"] += 1
            except InvalidRequestError as e:
                out.finish_reason, out.error = "error", f"engine: {e}"
            if out.error is None and out.sandbox_id is not None:
                await self._finish_sandbox(task, prompt, out, written)
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

    async def _episode(self, task: AgentTask, prompt: Prompt, prompt_ids: list[int], params: SamplingParams,
                       labels: dict[str, str], out: AgentOutcome, written: set[str]) -> None:
        cfg = self.cfg
        limits = api.Limits(memory_mb=cfg.sandbox.memory_mb, pids=cfg.sandbox.pids, cpus=cfg.sandbox.cpus,
                            disk_mb=cfg.sandbox.disk_mb, inodes=cfg.sandbox.inodes)
        created = await self.sandboxes.create(
            base=cfg.sandbox.base, limits=limits, files=task.sandbox_files(prompt), egress=cfg.sandbox.egress,
            lease_ttl_s=cfg.wall_time_s + 2 * cfg.sandbox_timeout_s + 60.0, labels=labels)
        out.sandbox_id = created.sandbox_id
        await self.sandboxes.pause(out.sandbox_id)  # it waits for the first generation
        context = list(prompt_ids)
        used = 0
        stops = list(dict.fromkeys([*params.stop, FENCE_STOP]))
        for turn_index in range(cfg.max_turns):
            budget = cfg.max_total_tokens - used
            if budget <= 0:
                out.finish_reason = "token_budget"
                return
            turn_params = dataclasses.replace(params, max_new_tokens=min(params.max_new_tokens, budget), stop=stops)
            turn, finish = await self._assistant_turn(context, turn_params)
            out.turns.append(turn)
            out.assistant_texts.append(turn.text)
            context += turn.token_ids
            used += len(turn.token_ids)
            call = parse_tool_call(turn.text, task.tools)
            if call is None:
                out.finish_reason = finish
                return
            if turn_index == cfg.max_turns - 1:
                break  # no turn left to read the result
            observation = await self._tool(out.sandbox_id, call, written)
            out.tool_calls += 1
            self.counters["tool_calls"] += 1
            ids, obs_text = self.frame.observation(turn.token_ids, observation)
            if used + len(ids) >= cfg.max_total_tokens:
                out.finish_reason = "token_budget"
                return
            out.turns.append(Turn(role="tool", token_ids=ids, text=obs_text))
            context += ids
            used += len(ids)
        out.finish_reason = "turn_limit"

    async def _assistant_turn(self, context: list[int], params: SamplingParams) -> tuple[Turn, FinishReason]:
        """One assistant message. A bare opening fence (```` ``` ```` + newline) matches the same stop string as
        a closing one: then the message goes on in a further request (same turn, same context), until the
        block closes, the model stops otherwise, or the turn's token limit is reached."""
        ids: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        while True:
            with tracing.span("assistant turn", context_tokens=len(context) + len(ids)) as span:
                res = await self._generate(context + ids, dataclasses.replace(
                    params, max_new_tokens=params.max_new_tokens - len(ids)))
                span.set_attribute("tokens", len(res.token_ids))
            ids += res.token_ids
            logprobs += res.logprobs
            versions += res.versions
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            if res.finish_reason != "stop" or not opens_block(text) or len(ids) >= params.max_new_tokens:
                return Turn(role="assistant", token_ids=ids, logprobs=logprobs, versions=versions, text=text), \
                    res.finish_reason

    async def _generate(self, context: list[int], params: SamplingParams) -> GenerationResult:
        """Generate, waiting out an overloaded engine (the rollout's wall time bounds the wait)."""
        delay = 0.5
        while True:
            try:
                return await self.engine.generate(context, params)
            except EngineOverloadedError:
                await asyncio.sleep(delay)  # back-pressure from the engine queue
                delay = min(2 * delay, 5.0)

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

    async def _finish_sandbox(self, task: AgentTask, prompt: Prompt, out: AgentOutcome, written: set[str]) -> None:
        """Write the submission, then hand the sandbox to the judge (paused, longer lease) or destroy it."""
        sid = out.sandbox_id
        if sid is None:
            return
        files = task.submission_files(prompt, out.assistant_texts, written)
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
