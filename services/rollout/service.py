"""The rollout service: prompt tickets in, finished rollouts out, weights taken from the transport as they come.

Each ticket runs ``group_size`` episodes concurrently; every episode's requests
go to one shared engine that batches them dynamically, so hundreds of episodes
share one forward pass per decode step. Every episode runs through the one episode loop
(:class:`services.rollout.episode.EpisodeLoop`) against the ticket's environment
(:meth:`RolloutService.environment`): a sandbox agent task (:func:`services.tasks.tools.is_agent_task`) as
a :class:`services.rollout.agent.SandboxEnvironment` (through :class:`~services.rollout.agent.AgentLoop`, which
adds the sandbox's retries and hand-off), a task that is an environment (``services/tasks/env.py``) as
itself, any other task as the single-turn environment (one generation, no tools).
:meth:`RolloutService.episode` runs each, :func:`rollout_sample` makes the sample, and the group goes out as
one message carrying its ticket once (:func:`publish_group`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from proto import catalog
from proto.prompts import PromptTicket
from proto.rollouts import RolloutGroup, RolloutSample
from services.lib.chat_template import use_chat_template
from services.lib.colocation import DEVICE_SHARE
from services.lib.engine.base import (
    Engine,
    EngineError,
    EngineNotRunningError,
    EngineOverloadedError,
    SamplingParams,
)
from services.lib.sandbox_client import SandboxClient
from services.lib.weights.transport import WeightReceiver, make_receiver
from services.rollout.agent import AgentLoop, AgentOutcome
from services.rollout.config import RolloutConfig
from services.rollout.engines import build_engine, concrete_engine
from services.rollout.episode import EpisodeLoop
from services.runtime import tracing
from services.runtime.config import Loaded
from services.runtime.consume import Delivery, Poison, Retry
from services.runtime.service import ServiceContext
from services.tasks import TaskRegistrationError, UnknownTaskError, get_task
from services.tasks.base import Prompt, Task
from services.tasks.env import SingleTurn, environment_of, is_environment
from services.tasks.models import resolve_model
from services.tasks.tools import is_agent_task

log = logging.getLogger("rlbus.rollout")

#: how often the rollout checks that its engine has not died
ENGINE_WATCH_S = 0.5


def rollout_msg_id(run_id: str, group_id: str, index: int) -> str:
    """Deterministic: a redelivered ticket's rollouts are de-duplicated by JetStream."""
    return f"{run_id}-{group_id}-s{index}"


def rollout_sample(ctx: ServiceContext, ticket: PromptTicket, index: int,
                   out: AgentOutcome | BaseException) -> RolloutSample:
    """Sample ``index`` of ``ticket`` from what its episode produced; an exception makes a failed sample
    with the error (it still reaches the judge, which scores it 0, and the trainer's accounting)."""
    common = dict(id=rollout_msg_id(ctx.run_id, ticket.group_id, index), sample_index=index, worker=ctx.instance)
    if isinstance(out, BaseException):
        log.warning("rollout %s/%d failed: %s", ticket.group_id, index, out)
        return RolloutSample(**common, turns=[], finish_reason="error", error=f"{type(out).__name__}: {out}")
    # started again on a new sandbox after losing its instance: said in the sample's metadata
    extra = {"sandbox_retries": str(out.sandbox_retries)} if out.sandbox_retries else {}
    return RolloutSample(**common, turns=out.turns, finish_reason=out.finish_reason, sandbox_id=out.sandbox_id,
                         error=out.error, metadata=extra)


async def publish_group(ctx: ServiceContext, ticket: PromptTicket,
                        samples: list[RolloutSample]) -> list[tuple[RolloutGroup, Any]]:
    """A ticket's samples as one message carrying the ticket once (parts when over the size limit), each
    part with its ack.

    A part's id is deterministic (the group and its first sample), so a redelivered ticket's group is
    de-duplicated by JetStream as its rollouts used to be one by one."""
    def make(part: list[RolloutSample]) -> RolloutGroup:
        return RolloutGroup(run_id=ctx.run_id, ticket=ticket, rollouts=part,
                            msg_id=f"{rollout_msg_id(ctx.run_id, ticket.group_id, part[0].sample_index)}-g")

    return await ctx.publish_parts(catalog.ROLLOUTS, samples, make)


class RolloutService:
    def __init__(self, loaded: Loaded) -> None:
        self.loaded = loaded
        self.cfg: RolloutConfig = loaded.service
        self.weight_updates = 0
        self.first_weights = asyncio.Event()
        self.version_changed = asyncio.Condition()
        self.receiver: WeightReceiver | None = None  # the receiver being followed
        self.tasks: dict[str, Task | None] = {}
        self.engine: Any = None  # an Engine, set by attach()
        self.agents: AgentLoop | None = None  # set by attach() when the engine has a tokenizer
        self.episodes: EpisodeLoop | None = None  # set by attach(): the one loop every episode runs through
        self.engine_failure: BaseException | None = None  # set when the engine died under requests

    def _engine(self) -> tuple[Engine, bool]:
        """The engine (not started) and whether it sleeps while a colocated trainer steps."""
        model_dir = resolve_model(self.loaded.model.name, self.loaded.model.cache_dir or None, seed=self.loaded.run.seed,
                                  revision=self.loaded.model.revision or None)
        section = concrete_engine(self.cfg.engine, str(model_dir))  # "auto" decided once, here
        return build_engine(section, model_dir), section.enable_sleep_mode

    async def run(self, ctx: ServiceContext) -> None:
        ctx.gauges["rollout/max_tickets"] = float(self.cfg.max_tickets)  # the trainer's admission sums these
        engine, sleeps = await asyncio.to_thread(self._engine)
        await engine.start()
        use_chat_template(engine.tokenizer, self.loaded.model.chat_template)  # [model] chat_template, if any
        if sleeps:
            DEVICE_SHARE.register(engine)  # asleep while a colocated trainer steps (services/lib/colocation.py)
        self.attach(engine, engine.tokenizer, SandboxClient(
            ctx.nc, ctx.run_id, timeout_s=self.cfg.agent.sandbox_timeout_s,
            default_exec_timeout_s=self.cfg.agent.exec_timeout_s))
        receiver = make_receiver(self.cfg.weight_source(self.loaded.weights), ctx.nc, ctx.run_id)
        weights = asyncio.create_task(self.follow_weights(ctx, receiver), name="rollout-weights")
        reports = asyncio.create_task(self._report(ctx), name="rollout-metrics")
        watch = asyncio.create_task(self._watch_engine(ctx), name="rollout-engine-watch")
        try:
            # the first version, or a stop (a SIGTERM must not wait out initial_weights_timeout_s)
            first = asyncio.ensure_future(self.first_weights.wait())
            stopped = asyncio.ensure_future(ctx.stop.wait())
            done, _ = await asyncio.wait({first, stopped}, timeout=self.cfg.initial_weights_timeout_s or None,
                                         return_when=asyncio.FIRST_COMPLETED)
            first.cancel()
            stopped.cancel()
            if not done:
                log.warning("no weight version announced within %.0fs; serving the local weights",
                            self.cfg.initial_weights_timeout_s)
            if not ctx.stop.is_set():
                await ctx.consume(catalog.PROMPTS, lambda t, d: self.handle(ctx, t, d),
                                  concurrency=self.cfg.max_tickets)
        finally:
            for task in (weights, reports, watch):
                task.cancel()
            await asyncio.wait({weights, reports, watch})
            try:
                await receiver.close()
            except Exception as e:
                log.debug("closing the weight receiver: %s", e)
            if self.episodes is not None:
                await self.episodes.close()
            DEVICE_SHARE.unregister(self.engine)
            await self.engine.stop()
        if self.engine_failure is not None:
            raise EngineError(f"the engine died: {self.engine_failure}") from self.engine_failure

    async def _watch_engine(self, ctx: ServiceContext) -> None:
        """An engine that dies while idle (no request to fail) stops this service too, within
        :data:`ENGINE_WATCH_S` of the engine saying so (``errored``; the vLLM engine within half a second
        of one of its processes exiting): the service then drains (``drain_timeout_s``) and stops its engine."""
        while not getattr(self.engine, "errored", False):
            await asyncio.sleep(ENGINE_WATCH_S)
        if self.engine_failure is None and not ctx.stop.is_set():
            self.engine_failure = EngineNotRunningError("the engine says it errored (one of its processes died)")
            log.error("the engine died while serving; stopping so that the rollout is restarted")
            ctx.stop.set()

    def _engine_died(self, ctx: ServiceContext, error: BaseException) -> None:
        """The engine stopped under running requests (its process died): stop this service with an error,
        so the launcher (or the orchestrator) restarts it; the ticket is handed back for redelivery."""
        if self.engine_failure is None:
            self.engine_failure = error
            log.error("the engine died (%s); stopping so that the rollout is restarted", error)
            ctx.stop.set()
        raise Retry(f"the engine died: {error}", delay_s=0.0)

    def attach(self, engine: Any, tokenizer: Any, sandboxes: Any) -> None:
        """Serve with ``engine`` (an Engine); agent loops use ``tokenizer`` and ``sandboxes`` (a SandboxClient)."""

        self.engine = engine
        self.episodes = EpisodeLoop(engine, tokenizer, self.cfg.agent)
        self.agents = (AgentLoop(engine, tokenizer, sandboxes, self.cfg.agent, self.episodes)
                       if tokenizer is not None else None)

    def task(self, name: str) -> Task | None:
        """The registered task ``name`` (built once), or None when this process does not know it."""

        if name not in self.tasks:
            try:
                self.tasks[name] = get_task(name, **self.loaded.task.options_for(name))
            except (UnknownTaskError, TaskRegistrationError) as e:
                log.warning("task %r is not known to this rollout process (%s); its tickets run single-turn", name, e)
                self.tasks[name] = None
        return self.tasks[name]

    async def follow_weights(self, ctx: Any, receiver: WeightReceiver) -> None:
        """Apply each newer verified version ``receiver`` (a WeightReceiver) delivers. The receiver owns
        the watching, re-checks, re-subscriptions, group rejoins and refusals (counted in ``refused``)."""
        self.receiver = receiver
        async with contextlib.aclosing(aiter(receiver)) as versions:
            async for version, state in versions:
                t0 = time.perf_counter()
                # the engine's apply links to the trainer's step that sent the version (many engines, one step)
                sent_by = getattr(receiver, "traces", {}).get(version, "")
                # the digest the receiver verified this version against: "never applied a corrupt version"
                # can be checked from the log (and the span) against the announced manifests
                digest = getattr(receiver, "digests", {}).get(version, "")
                with tracing.span("apply weights", links=tracing.link_to([sent_by]), version=version,
                                  digest=digest):
                    await self.engine.update_weights(state, version)
                log.info("applied weights version %d digest %s in %.3fs", version,
                         digest or "none (not verified: in-process weights)", time.perf_counter() - t0)
                async with self.version_changed:
                    self.version_changed.notify_all()
                self.weight_updates += 1
                ctx.gauges["rollout/weight_version"] = float(version)
                ctx.gauges["rollout/weight_apply_s"] = time.perf_counter() - t0
                ctx.gauges["rollout/weight_errors"] = float(receiver.refused)
                self.first_weights.set()

    @property
    def weight_errors(self) -> int:
        """Weight versions refused so far (failed verification; the engine kept its version)."""
        return 0 if self.receiver is None else self.receiver.refused

    async def _report(self, ctx: ServiceContext) -> None:
        while True:
            await asyncio.sleep(self.cfg.report_every_s)  # reporting period
            st = self.engine.stats()
            ctx.gauges["rollout/weight_errors"] = float(self.weight_errors)  # refusals apply nothing
            await ctx.report({
                "rollout/pending_requests": float(st.pending), "rollout/running": float(st.running),
                "rollout/tokens_per_s": float(st.tokens_per_s), "rollout/tokens_total": float(st.total_generated_tokens),
                "rollout/weight_version": float(st.version), "rollout/weight_errors": float(self.weight_errors),
                **({} if self.agents is None else {
                    "rollout/agent_loops": float(self.agents.active),
                    "rollout/agent_tool_calls": float(self.agents.counters["tool_calls"]),
                    "rollout/agent_errors": float(self.agents.counters["errors"]),
                    "rollout/agent_sandbox_retries": float(self.agents.counters["sandbox_retries"])}),
                **({} if self.episodes is None else {
                    **{f"rollout/episode/{k}": float(v) for k, v in self.episodes.counters.items()},
                    **{f"rollout/tools/{k}": v for k, v in self.episodes.tools.metrics().items()}}),
            })

    async def handle(self, ctx: ServiceContext, ticket: PromptTicket, d: Delivery[PromptTicket]) -> None:

        # a ticket admitted at version v is generated by weights no older than v: otherwise the
        # weight pull's lag would make samples stale beyond what admission control promises
        if self.engine.version < ticket.policy_version:
            try:
                async with self.version_changed:
                    await asyncio.wait_for(self.version_changed.wait_for(
                        lambda: self.engine.version >= ticket.policy_version), self.cfg.version_wait_s)
            except TimeoutError:
                log.warning("engine still at version %d after %.0fs; generating %s for version %d anyway",
                            self.engine.version, self.cfg.version_wait_s, ticket.group_id, ticket.policy_version)
        s = ticket.sampling
        params = SamplingParams(max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p,
                                stop=list(s.stop))
        env = self.environment(ticket.task)
        with tracing.span("generate group", group_id=ticket.group_id, samples=ticket.group_size,
                          version=self.engine.version):
            outcomes = await asyncio.gather(*(self.episode(ticket, env, params, i)
                                              for i in range(ticket.group_size)), return_exceptions=True)
        for out in outcomes:
            if isinstance(out, EngineOverloadedError):
                raise Retry(str(out), delay_s=2.0)
            if isinstance(out, EngineNotRunningError) and not ctx.stop.is_set():
                self._engine_died(ctx, out)
        samples = [rollout_sample(ctx, ticket, i, out) for i, out in enumerate(outcomes)]
        for part, ack in await publish_group(ctx, ticket, samples):
            if ack is None or not ack.duplicate or self.agents is None:
                continue
            for r in part.rollouts:  # a redelivered ticket: the judge has the first copies, not these sandboxes
                out = outcomes[r.sample_index]
                if not isinstance(out, BaseException) and out.handed_off and out.sandbox_id:
                    await self.agents.destroy_quietly(out.sandbox_id)

    def environment(self, name: str) -> Any:
        """The environment tickets of task ``name`` run in: the sandbox agent task itself (run by
        :attr:`agents`), a task that is an environment, or the single-turn environment (also for a task this
        process does not know: one generation on the ticket's prompt ids)."""
        task = self.task(name)
        if task is not None and is_agent_task(task):
            if self.agents is None:
                raise Poison(f"task {name!r} runs agent loops, which need a tokenizer; the engine has none")
            return task
        if task is not None and is_environment(task):
            if self.episodes is None or self.episodes.tokenizer is None:
                raise Poison(f"task {name!r} is a multi-turn environment, which needs a tokenizer; the engine has "
                             "none")
            return task
        return environment_of(task) if task is not None else SingleTurn()

    async def episode(self, ticket: PromptTicket, env: Any, params: SamplingParams, index: int) -> AgentOutcome:
        """Sample ``index`` of ``ticket`` in ``env`` (:meth:`environment`), through the one episode loop (a
        sandbox agent task with its sandbox's lifecycle around it). Raises what the engine raises (the caller
        decides what becomes of the ticket)."""
        assert self.episodes is not None, "attach() an engine first"
        if isinstance(env, SingleTurn):  # the single-turn path: one generation, nothing else built
            return await self.episodes.run(env, _NO_PROMPT, ticket.prompt_ids, params)
        prompt = Prompt(id=ticket.prompt_id, text=ticket.prompt_text, metadata=dict(ticket.metadata))
        labels = {"task": ticket.task, "group": ticket.group_id, "sample": str(index), "prompt": ticket.prompt_id}
        if is_agent_task(env):
            assert self.agents is not None
            return await self.agents.run(env, prompt, ticket.prompt_ids, params, labels=labels)
        return await self.episodes.run(env, prompt, ticket.prompt_ids, params, labels=labels)


#: the single-turn environment reads nothing of the prompt beyond its token ids
_NO_PROMPT = Prompt(id="")


def build(loaded: Loaded) -> RolloutService:
    return RolloutService(loaded)
