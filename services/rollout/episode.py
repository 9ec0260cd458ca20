"""The one episode loop: every rollout (single-turn task, function-tool environment, sandbox agent) runs here.

Read top to bottom, :meth:`EpisodeLoop.episode` is the whole protocol (``services/tasks/env.py``)::

    start = reset(prompt)                                  # first messages (as the ticket's prompt_ids), tools
    for each turn, within max_turns / max_total_tokens / wall_time_s:
        assistant turn  = the engine's tokens, logprobs, versions (never re-tokenised)
        calls           = the configured parser's reading of the turn (function tools only)
        results         = the calls run bounded (tool_runner.py), each an observation, failures included
        step            = step(state, Action(text, results))  -> observations, turn reward, done, state
        tool turn       = tool results + step's observations through the chat template (frame.py)

**Single-turn tasks** (:class:`services.tasks.env.SingleTurn`) take the first branch of :meth:`run`: one
generation on the ticket's prompt ids, its result as the one assistant turn, exactly what the rollout did
before environments existed (no template, no parser, no timeout wrapper).

**Failures end only their episode.** An environment whose ``reset``/``step`` raises, hangs past
``env_timeout_s`` or returns something else than a ``Start``/``Step`` ends the episode with
``finish_reason = "error"`` and the reason (the judge scores it 0 and says why); a tool's failure is an
observation (``tool_runner.py``). A *trusted* environment (``trusted = True``: the sandbox environment, code of
this repository with its own timeouts) is awaited directly and its exceptions reach the caller, which knows
them (a lost sandbox is retried). An engine's refusal of a request (``InvalidRequestError``) ends the episode
with an error; the engine stopping propagates (the ticket is retried elsewhere).

**Counted**: ``counters`` (episodes, errors, budgets hit) and the tool runner's ``counters`` (calls and
failures by kind), reported by the service as ``rollout/episode/*`` and ``rollout/tools/*``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from dataclasses import dataclass, field
from typing import Any

from proto.rollouts import EpisodeSegment, FinishReason, Turn
from services.lib.engine.base import (
    Engine,
    EngineOverloadedError,
    GenerationResult,
    InvalidRequestError,
    SamplingParams,
)
from services.rollout.config import AgentSection
from services.rollout.frame import ChatFrame
from services.rollout.tool_runner import CallFailed, ToolRunner
from services.runtime import tracing
from services.tasks.base import Prompt
from services.tasks.env import Action, Message, Start, Step, ToolResult
from services.tasks.function_tools import ToolSpec, tools_by_name
from services.tasks.toolcalls import get_parser

log = logging.getLogger("rlbus.rollout.episode")


@dataclass
class EpisodeOutcome:
    """What one episode produced."""

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
    #: the prompt the turns follow when it is not the ticket's (a black-box agent's first call rendered it)
    prompt_ids: list[int] | None = None
    #: what the episode adds to the sample's metadata (e.g. a black-box agent's ``agent_answer``)
    metadata: dict[str, str] = field(default_factory=dict)
    #: the episode's segments after the first (a black-box agent that rewrote its history)
    extra_segments: list[EpisodeSegment] = field(default_factory=list)


class EnvironmentFailed(Exception):
    """The environment's own code failed (raised, hung, returned garbage): the episode ends with an error."""


class EpisodeLoop:
    """Runs episodes on a shared engine; one instance serves every episode of a process."""

    def __init__(self, engine: Engine, tokenizer: Any, cfg: AgentSection) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.parser = get_parser(cfg.tool_parser)
        self.tools = ToolRunner(cfg.tool_timeout_s, cfg.max_observation_chars, cfg.max_tool_calls,
                                workers=cfg.tool_workers)
        self._frame: ChatFrame | None = None
        self._specs: dict[tuple[Any, ...], dict[str, ToolSpec]] = {}
        self.counters = {"episodes": 0, "errors": 0, "turn_limit": 0, "token_budget": 0, "wall_time": 0,
                         "env_errors": 0}

    @property
    def frame(self) -> ChatFrame:
        if self._frame is None:  # built on first use: single-turn processes never render a template
            self._frame = ChatFrame(self.tokenizer, self.cfg.observation_role)
        return self._frame

    async def close(self) -> None:
        """Stop what the loop started (the tool workers)."""
        await self.tools.close()

    async def run(self, env: Any, prompt: Prompt, prompt_ids: list[int], params: SamplingParams,
                  labels: dict[str, str] | None = None, out: EpisodeOutcome | None = None) -> EpisodeOutcome:
        """One episode of ``env`` from ``prompt_ids`` (the ticket's). ``out`` (optional) is filled as the
        episode goes, so a caller whose trusted environment raised still has the turns so far."""
        self.counters["episodes"] += 1
        if getattr(env, "single_turn", False):
            res = await self.engine.generate(prompt_ids, params)
            return EpisodeOutcome(turns=[Turn(role="assistant", token_ids=res.token_ids, logprobs=res.logprobs,
                                              versions=res.versions, text=res.text)],
                                  finish_reason=res.finish_reason)
        if self.tokenizer is None:
            raise EnvironmentFailed("multi-turn episodes need the engine's tokenizer; this engine has none")
        out = out if out is not None else EpisodeOutcome(turns=[], finish_reason="error")
        try:
            async with asyncio.timeout(self.cfg.wall_time_s):
                with tracing.span("episode", **(labels or {})):
                    await self.episode(env, prompt, prompt_ids, params, out)
        except TimeoutError:
            out.finish_reason = "wall_time"
        except InvalidRequestError as e:
            out.finish_reason, out.error = "error", f"engine: {e}"
        except EnvironmentFailed as e:
            self.counters["env_errors"] += 1
            out.finish_reason, out.error = "error", f"environment: {e}"
        if out.finish_reason in ("turn_limit", "token_budget", "wall_time"):
            self.counters[out.finish_reason] += 1
        if out.error is not None:
            self.counters["errors"] += 1
        return out

    async def episode(self, env: Any, prompt: Prompt, prompt_ids: list[int], params: SamplingParams,
                      out: EpisodeOutcome) -> None:
        """The loop itself (budgets of turns and tokens here, wall time around it in :meth:`run`)."""
        cfg = self.cfg
        start = await self._hook(env, "reset", Start, prompt)
        tools = self._tool_specs(start.tools)
        stops = list(dict.fromkeys([*params.stop, *start.stop, *(self.parser.stop if tools else ())]))
        state = start.state
        context = list(prompt_ids)
        used = 0
        for index in range(cfg.max_turns):
            budget = cfg.max_total_tokens - used
            if budget <= 0:
                out.finish_reason = "token_budget"
                return
            turn_params = dataclasses.replace(params, max_new_tokens=min(params.max_new_tokens, budget), stop=stops)
            turn, finish = await self._assistant_turn(env, tools, context, turn_params)
            out.turns.append(turn)
            out.assistant_texts.append(turn.text)
            context += turn.token_ids
            used += len(turn.token_ids)
            final = index == cfg.max_turns - 1

            calls, results = 0, []
            if tools:  # the parser reads what the model wrote, special tokens included (Llama's <|python_tag|>)
                parsed = self.parser.parse(self._raw_text(turn.token_ids), list(tools))
                calls = len(parsed.calls) + len(parsed.errors)
                if calls and not final:
                    results = await self.tools.run_calls(tools, parsed, sandbox=start.sandbox)
                    out.tool_calls += len(results)
            action = Action(text=turn.text, results=results, index=index, calls=calls, final=final,
                            sandbox=start.sandbox)
            step = await self._hook(env, "step", Step, state, action)
            state = step.state
            if step.reward is not None:
                turn.reward = float(step.reward)
            if step.done:
                out.finish_reason = finish
                return
            if final:
                break  # no turn left to read an observation

            ids, obs_text = self._observation(turn.token_ids, results, step.observations)
            if used + len(ids) >= cfg.max_total_tokens:
                out.finish_reason = "token_budget"
                return
            out.turns.append(Turn(role="tool", token_ids=ids, text=obs_text))
            context += ids
            used += len(ids)
        out.finish_reason = "turn_limit"

    async def _hook(self, env: Any, name: str, kind: type, *args: Any) -> Any:
        """``env.<name>(*args)``: awaited directly for a trusted environment, else bounded and checked."""
        fn = getattr(env, name)
        if getattr(env, "trusted", False):
            result = fn(*args)
            return await result if asyncio.iscoroutine(result) else result
        return await self.bounded(fn, kind, *args)

    async def bounded(self, fn: Any, kind: type, *args: Any) -> Any:
        """``fn(*args)``, environment code: bounded by ``env_timeout_s`` and its result checked to be a
        ``kind``; :class:`EnvironmentFailed` (naming the method) when it raises, hangs or returns garbage."""
        name = getattr(fn, "__name__", "call")
        try:
            result = await self.tools.call(fn, *args, timeout_s=self.cfg.env_timeout_s)
        except CallFailed as e:
            raise EnvironmentFailed(f"{name}: {e}") from e
        if not isinstance(result, kind):
            raise EnvironmentFailed(f"{name} returned a {type(result).__name__}, not a {kind.__name__}")
        if kind is Step and result.reward is not None and not _is_number(result.reward):
            raise EnvironmentFailed(f"step gave the reward {result.reward!r}, not a finite number")
        if kind is Step and not (isinstance(result.observations, list)
                                 and all(isinstance(m, dict) for m in result.observations)):
            raise EnvironmentFailed("step's observations are not a list of messages (dicts)")
        return result

    def _tool_specs(self, tools: Any) -> dict[str, ToolSpec]:
        if not tools:
            return {}
        key = tuple(tools)
        if key not in self._specs:  # schemas derived once per tool set, not per episode
            try:
                self._specs[key] = tools_by_name(key)
            except Exception as e:  # a tool the schema cannot describe: the environment's error
                raise EnvironmentFailed(f"its tools cannot be offered: {e}") from e
        return self._specs[key]

    def _raw_text(self, ids: list[int]) -> str:
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        eos = self.tokenizer.eos_token or ""
        return text[: -len(eos)] if eos and text.endswith(eos) else text

    def _observation(self, assistant_ids: list[int], results: list[ToolResult],
                     observations: list[Message]) -> tuple[list[int], str]:
        """The tool turn's tokens: the results as ``role="tool"`` messages, then the environment's messages."""
        frame = self.frame
        if not results and len(observations) == 1 and observations[0].get("role") == frame.role:
            return frame.observation(assistant_ids, str(observations[0].get("content", "")))  # one plain message
        messages: list[Message] = [{"role": "tool", "tool_call_id": r.call_id, "name": r.name, "content": r.content}
                                   for r in results]
        return frame.messages(assistant_ids, messages + list(observations))

    async def _assistant_turn(self, env: Any, tools: dict[str, ToolSpec], context: list[int],
                              params: SamplingParams) -> tuple[Turn, FinishReason]:
        """One assistant message. When it stops on a stop string inside an unfinished call (the environment's
        ``continues``, else the parser's ``incomplete``: e.g. a bare opening fence matches the closing fence's
        stop string), it goes on in a further request (same turn, same context) until the call closes, the
        model stops otherwise, or the turn's token limit is reached."""
        continues = getattr(env, "continues", None) or (self.parser.incomplete if tools else None)
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
            if (res.finish_reason != "stop" or continues is None or not continues(text)
                    or len(ids) >= params.max_new_tokens):
                return Turn(role="assistant", token_ids=ids, logprobs=logprobs, versions=versions, text=text), \
                    res.finish_reason

    async def _generate(self, context: list[int], params: SamplingParams) -> GenerationResult:
        """Generate, waiting out an overloaded engine (the episode's wall time bounds the wait)."""
        delay = 0.5
        while True:
            try:
                return await self.engine.generate(context, params)
            except EngineOverloadedError:
                await asyncio.sleep(delay)  # back-pressure from the engine queue
                delay = min(2 * delay, 5.0)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
