"""Black-box agent episodes: the task's own agent code (``solve``) against a session of the endpoint.

Per episode: open a session with the episode's budgets (``max_turns`` calls, ``max_total_tokens`` tokens),
await ``task.solve(AgentEndpoint(base_url, session id, model), prompt)`` within ``wall_time_s``, close the
session, and assemble the trajectory from what the session recorded (``services/rollout/sessions.py``):

* **one segment** (every call continued the previous one, or a single call): the sample's prompt is the
  segment's prompt (what the agent's first call rendered; the sample carries it, ``RolloutSample.prompt_ids``)
  and its turns the segment's runs of generated (``assistant``, trained) and other (``tool``, masked) tokens;
* **several segments** (the agent rewrote or truncated its history): the first segment is the sample's prompt
  and turns as above, the others its ``extra_segments`` (each its own prompt, what that call rendered, and
  turns), in the order they started. The trainer trains each as its own sequence with the episode's reward and
  advantage, counting the episode once (``services/trainer/step_input.py``), and the staleness filter reads
  the oldest version over all of them (``Rollout.min_version``); no token is trained on a context the model
  did not see;
* **no model call**: an error with the reason.

The finish reason is the last generated choice's (``eos``/``stop``/``length``), or the budget the agent ran
into (``turn_limit``/``token_budget``; the agent saw the refusal and returned or raised), or ``wall_time``.
An agent that raises (for a reason other than a spent budget) ends its episode with ``error`` and the
exception. ``solve``'s return value is kept as the sample's ``agent_answer`` metadata (cut to 2,000 chars).

A ``solve`` that declares a ``sandbox`` parameter gets the episode's own sandbox: created before ``solve``
exactly as a command agent's (:meth:`CommandAgents.create`: the task's files, the prompt file, egress to the
endpoint only), handed to ``solve`` as ``sandbox=`` an :class:`services.rollout.sandbox_env.EpisodeSandbox`
(``exec``/``write``/``read``; paused between them), and settled like a command agent's at the end: handed to
the judge when the episode is scored, destroyed when it failed (the agent raised, a sandbox error) and also
when the episode is cancelled. The plain two-argument ``solve`` runs without a sandbox, as before.

A **command agent** (:class:`services.tasks.black_box.CommandAgentTask`) runs as a command in the episode's
sandbox instead of ``solve`` (``services/rollout/command_agent.py``): the same session, budgets and trajectory;
its exit is read as said there, and its sandbox is handed to the judge when the episode is scored.

Per episode the sample's metadata says ``agent_calls`` (model calls), ``agent_tokens`` (generated tokens),
``agent_prompt_tokens`` (prompt tokens prefilled) and ``agent_wall_s`` (seconds, the agent's whole run).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from proto.rollouts import EpisodeSegment
from services.lib.sandbox_client import SandboxClientError
from services.rollout.command_agent import CommandAgentError, CommandAgents, egress_entry
from services.rollout.config import AgentSection
from services.rollout.endpoint import Endpoint
from services.rollout.episode import EpisodeOutcome
from services.rollout.sandbox_env import EpisodeSandbox
from services.tasks.base import Prompt
from services.tasks.black_box import AgentEndpoint, is_command_agent, solve_takes_sandbox

log = logging.getLogger("rlbus.rollout.black_box")

#: characters of ``solve``'s return value kept in the sample's metadata
ANSWER_CHARS = 2000


class BlackBoxLoop:
    """Runs black-box agent episodes against one endpoint; one instance serves every such episode."""

    def __init__(self, endpoint: Endpoint, cfg: AgentSection, commands: CommandAgents | None = None) -> None:
        self.endpoint = endpoint
        self.cfg = cfg
        #: creates and settles agents' sandboxes, runs command agents in them (None: a rollout without a sandbox
        #: client refuses agents that need one)
        self.commands = commands
        self.counters = {"episodes": 0, "errors": 0, "segmented": 0, "wall_time": 0, "calls": 0,
                         "tokens": 0, "prompt_tokens": 0, "seconds": 0.0}

    async def run(self, task: Any, prompt: Prompt, labels: dict[str, str] | None = None) -> EpisodeOutcome:
        out = EpisodeOutcome(turns=[], finish_reason="error")
        try:
            await self._run(task, prompt, labels or {}, out)
        except asyncio.CancelledError:  # nothing to grade: its sandbox is destroyed, not handed over
            out.finish_reason, out.error = "error", "cancelled"
            raise
        finally:  # also when cancelled: an agent's sandbox is never left behind
            if self.commands is not None and out.sandbox_id is not None:
                await self.commands.settle(out)
        if out.error is not None:
            self.counters["errors"] += 1
            log.warning("black-box episode %s: %s", prompt.id, out.error)
        return out

    async def _run(self, task: Any, prompt: Prompt, labels: dict[str, str], out: EpisodeOutcome) -> None:
        self.counters["episodes"] += 1
        ep = self.endpoint
        session = ep.sessions.open(labels, max_calls=self.cfg.max_turns, max_tokens=self.cfg.max_total_tokens)
        finish: str | None = None
        agent = AgentEndpoint(ep.base_url, session.id, ep.model_name)
        command = is_command_agent(task)
        boxed = solve_takes_sandbox(task)
        commands = self.commands
        egress = egress_entry(ep.agent_host, ep.port)
        exit_error: str | None = None
        started = time.monotonic()
        try:
            if (command or boxed) and commands is None:
                raise RuntimeError("an agent with a sandbox needs the rollout's sandbox client")
            # a command's own exec limit is the wall time: its reply (timed out) comes before this bound
            async with asyncio.timeout(self.cfg.wall_time_s + (self.cfg.sandbox_timeout_s if command else 0.0)):
                if commands is not None and command:
                    answer, exit_error = await commands.run(task, agent, egress, prompt, out, labels)
                elif commands is not None and boxed:
                    sandbox_id = await commands.create(task, egress, prompt, out, labels)
                    await commands.sandboxes.pause(sandbox_id)  # resumed only while the agent works in it
                    answer = await task.solve(agent, prompt, sandbox=EpisodeSandbox(commands.sandboxes, sandbox_id,
                                                                                    self.cfg))
                else:
                    answer = await task.solve(agent, prompt)
            if answer is not None:
                out.metadata["agent_answer"] = str(answer)[:ANSWER_CHARS]
            if out.finish_reason == "wall_time":  # the command's exec ran out of time
                finish = "wall_time"
                self.counters["wall_time"] += 1
        except TimeoutError:
            finish = "wall_time"
            self.counters["wall_time"] += 1
        except (SandboxClientError, CommandAgentError) as e:
            out.error = f"sandbox: {e}"
        except Exception as e:  # the agent's own failure ends its episode only
            if session.exhausted is None:
                out.error = f"agent: {type(e).__name__}: {e}"
        finally:
            ep.sessions.close(session.id)
        if exit_error is not None and session.exhausted is None:  # after a refused call the exit is the budget's
            out.error = exit_error
        elapsed = time.monotonic() - started
        generated = session.generated_tokens
        self.counters["calls"] += len(session.calls)
        self.counters["tokens"] += generated
        self.counters["prompt_tokens"] += session.prefilled_tokens
        self.counters["seconds"] += elapsed
        out.metadata.update(agent_calls=str(len(session.calls)), agent_tokens=str(generated),
                            agent_prompt_tokens=str(session.prefilled_tokens), agent_wall_s=f"{elapsed:.3f}")
        segments = session.close()
        if out.error is None and not segments:
            out.error = "agent: the agent returned without a model call that finished"
        if out.error is not None:
            out.finish_reason = "error"
            return

        def decode(ids: list[int]) -> str:
            return ep.renderer.decode(ids)

        out.prompt_ids, out.turns = segments[0].sequence(decode)
        for seg in segments[1:]:
            prompt_ids, turns = seg.sequence(decode)
            out.extra_segments.append(EpisodeSegment(prompt_ids=prompt_ids, turns=turns))
        if len(segments) > 1:
            self.counters["segmented"] += 1
            out.metadata["agent_segments"] = str(len(segments))
        last = next(c for c in reversed(session.calls) if c.choices and c.continued_by is not None)
        out.finish_reason = finish or session.exhausted or last.choices[last.continued_by].finish_reason
