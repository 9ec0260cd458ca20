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
from services.runtime.service import ServiceContext, colocated_names
from services.runtime.tasks import cancel_and_wait
from services.runtime.weights_config import ConfigError, VllmTransferConfig
from services.tasks import TaskRegistrationError, UnknownTaskError, get_task
from services.tasks.base import Prompt, Task
from services.tasks.black_box import is_black_box_agent, is_command_agent, needs_sandbox
from services.tasks.env import SingleTurn, environment_of, is_environment
from services.tasks.models import resolve_model
from services.tasks.sandbox_tools import uses_sandbox
from services.tasks.tools import is_agent_task

log = logging.getLogger("rlbus.rollout")

#: how often the rollout checks that its engine has not died
ENGINE_WATCH_S = 0.5


class WeightFollowError(EngineError):
    """Weight versions could not be applied (``max_weight_failures`` in a row) or no longer arrive (the
    receiver broke): the rollout stops with exit code 1 rather than generate on old weights unseen."""


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
                         error=out.error, metadata={**out.metadata, **extra}, prompt_ids=out.prompt_ids,
                         extra_segments=out.extra_segments)


def generated_tokens(out: AgentOutcome) -> int:
    """Tokens the model generated in an episode (its assistant turns; observations are not generated)."""
    return sum(len(t.token_ids) for t in out.turns if t.role == "assistant")


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
        self.endpoint: Any = None  # the OpenAI/Anthropic-compatible endpoint, when [services.rollout] endpoint is on
        self.black_box: Any = None  # black-box agent episodes (services/rollout/black_box.py), with the endpoint
        self.weights_failure: WeightFollowError | None = None  # set when weights could not be applied
        self.weight_failures = 0  # failed applies in a row (0: healthy)
        self.weight_apply_failures = 0  # failed applies in all

    def _engine(self) -> tuple[Engine, bool]:
        """The engine (not started) and whether it sleeps while a colocated trainer steps."""
        model_dir = resolve_model(self.loaded.model.name, self.loaded.model.cache_dir or None, seed=self.loaded.run.seed,
                                  revision=self.loaded.model.revision or None)
        section = concrete_engine(self.cfg.engine, str(model_dir))  # "auto" decided once, here
        engine = build_engine(section, model_dir)
        weights = self.loaded.weights
        if isinstance(weights, VllmTransferConfig):  # straight into vLLM's workers: vLLM makes its receiving side
            if not hasattr(engine, "enable_weight_transfer"):
                raise ConfigError('[weights] type = "vllm" needs services.rollout.engine type = "vllm"')
            engine.enable_weight_transfer(weights.backend, weights.timeout_s)
        return engine, section.enable_sleep_mode

    async def run(self, ctx: ServiceContext) -> None:
        ctx.gauges["rollout/max_tickets"] = float(self.cfg.max_tickets)  # the trainer's admission sums these
        engine, sleeps = await asyncio.to_thread(self._engine)
        if sleeps:  # colocated: started once the trainer's memory is out of the way, asleep while it steps
            async with DEVICE_SHARE.engine_start(with_trainer="trainer" in colocated_names()):
                await engine.start()
            DEVICE_SHARE.register(engine)  # (services/lib/colocation.py)
        else:
            await engine.start()
        use_chat_template(engine.tokenizer, self.loaded.model.chat_template)  # [model] chat_template, if any
        self.attach(engine, engine.tokenizer, SandboxClient(
            ctx.nc, ctx.run_id, timeout_s=self.cfg.agent.sandbox_timeout_s,
            default_exec_timeout_s=self.cfg.agent.exec_timeout_s))
        if self.cfg.endpoint.enabled:
            await self.serve_endpoint(ctx)
        receiver = make_receiver(self.cfg.weight_source(self.loaded.weights), ctx.nc, ctx.run_id,
                                 device=engine_device(engine), engine=engine)
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
            await cancel_and_wait(weights, reports, watch)
            try:
                await receiver.close()
            except Exception as e:
                log.debug("closing the weight receiver: %s", e)
            if self.episodes is not None:
                await self.episodes.close()
            if self.endpoint is not None:
                await self.endpoint.stop()
            DEVICE_SHARE.unregister(self.engine)
            await self.engine.stop()
        if self.engine_failure is not None:
            raise EngineError(f"the engine died: {self.engine_failure}") from self.engine_failure
        if self.weights_failure is not None:
            raise self.weights_failure

    async def serve_endpoint(self, ctx: Any) -> None:
        """Start the OpenAI/Anthropic-compatible endpoint over the engine (services/rollout/endpoint.py)."""
        from services.rollout.black_box import BlackBoxLoop  # aiohttp only where the endpoint is on
        from services.rollout.command_agent import CommandAgents
        from services.rollout.endpoint import Endpoint

        if self.episodes is None or self.episodes.tokenizer is None:
            raise EngineError("the endpoint needs the engine's tokenizer; this engine has none")
        self.endpoint = Endpoint(self.engine, self.episodes.tokenizer, self.cfg.endpoint, self.loaded.model.name,
                                 tool_parser=self.cfg.agent.tool_parser)
        await self.endpoint.start()
        sandboxes = None if self.agents is None else self.agents.sandboxes
        self.black_box = BlackBoxLoop(self.endpoint, self.cfg.agent,
                                      None if sandboxes is None else CommandAgents(sandboxes, self.cfg.agent))
        ctx.gauges["rollout/endpoint/port"] = float(self.endpoint.port)

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
        the watching, re-checks, re-subscriptions, group rejoins and refusals (counted in ``refused``); a
        version the engine fails to apply is retried (:meth:`_apply`), and when applying keeps failing, or
        the receiver itself breaks, the service stops with :attr:`weights_failure` (exit code 1, so that its
        supervisor restarts it) instead of generating on old weights unseen."""
        self.receiver = receiver
        try:
            async with contextlib.aclosing(aiter(receiver)) as versions:
                async for version, state in versions:
                    if not await self._apply(ctx, receiver, version, state):
                        return
        except Exception as exc:  # not a refusal (the receiver skips those): no version can come any more
            self._stop_for_weights(ctx, WeightFollowError(
                f"the weight receiver failed ({type(exc).__name__}: {exc}); no newer version can be applied"))

    async def _apply(self, ctx: Any, receiver: WeightReceiver, version: int, state: Any) -> bool:
        """Apply ``version``, retrying it after ``weight_retry_s`` (doubling, at most 60 s) while it fails.
        Meanwhile the rollout says it is unhealthy (gauge ``rollout/weights_unhealthy``, heartbeat and
        metrics; ``rlbus status --healthy`` fails) and logs the failure once. False when the service stops:
        ``max_weight_failures`` failures in a row, or a stop asked for."""
        delay = self.cfg.weight_retry_s
        while True:
            try:
                await self._apply_once(ctx, receiver, version, state)
            except Exception as exc:
                self.weight_failures += 1
                self.weight_apply_failures += 1
                ctx.gauges["rollout/weights_unhealthy"] = 1.0
                ctx.gauges["rollout/weight_apply_failures"] = float(self.weight_apply_failures)
                if self.weight_failures == 1:  # once per run of failures, not once per retry
                    log.error("applying weights version %d failed (%s: %s); still serving version %d, retrying "
                              "(the rollout stops after %d failures in a row)", version, type(exc).__name__, exc,
                              self.engine.version, self.cfg.max_weight_failures)
                if self.weight_failures >= self.cfg.max_weight_failures:
                    self._stop_for_weights(ctx, WeightFollowError(
                        f"applying weights failed {self.weight_failures} times in a row (max_weight_failures), "
                        f"the last for version {version}: {type(exc).__name__}: {exc}"))
                    return False
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(ctx.stop.wait(), delay)
                if ctx.stop.is_set():
                    return False
                delay = min(2 * delay, 60.0)
                continue
            if self.weight_failures:
                log.info("weights healthy again: version %d applied after %d failed attempts", version,
                         self.weight_failures)
            self.weight_failures = 0
            ctx.gauges["rollout/weights_unhealthy"] = 0.0
            return True

    def _stop_for_weights(self, ctx: Any, error: WeightFollowError) -> None:
        if self.weights_failure is None:
            self.weights_failure = error
            ctx.gauges["rollout/weights_unhealthy"] = 1.0
            log.error("%s; stopping so that the rollout is restarted", error)
            ctx.stop.set()

    async def _apply_once(self, ctx: Any, receiver: WeightReceiver, version: int, state: Any) -> None:
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
                "rollout/weights_unhealthy": float(self.weight_failures > 0 or self.weights_failure is not None),
                "rollout/weight_apply_failures": float(self.weight_apply_failures),
                **({} if self.agents is None else {
                    "rollout/agent_loops": float(self.agents.active),
                    "rollout/agent_tool_calls": float(self.agents.counters["tool_calls"]),
                    "rollout/agent_errors": float(self.agents.counters["errors"]),
                    "rollout/agent_sandbox_retries": float(self.agents.counters["sandbox_retries"])}),
                **({} if self.endpoint is None else {
                    "rollout/endpoint/sessions": float(len(self.endpoint.sessions)),
                    **{f"rollout/endpoint/{k}": float(v) for k, v in self.endpoint.counters.items()},
                    **{f"rollout/black_box/{k}": float(v) for k, v in self.black_box.counters.items()}}),
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
                          version=self.engine.version) as span:
            outcomes = await asyncio.gather(*(self.episode(ticket, env, params, i)
                                              for i in range(ticket.group_size)), return_exceptions=True)
            # each sample's generated tokens (every assistant turn; 0: failed): the length distribution
            span.set_attribute("completion_tokens", [0 if isinstance(o, BaseException) else generated_tokens(o)
                                                     for o in outcomes])
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
        if task is not None and is_black_box_agent(task):
            if self.black_box is None:
                raise Poison(f"task {name!r} runs black-box agents against the endpoint, which is off: set "
                             "[services.rollout] endpoint.enabled = true")
            if needs_sandbox(task) and self.black_box.commands is None:
                what = "as a command in a sandbox" if is_command_agent(task) else "with a sandbox (solve takes one)"
                raise Poison(f"task {name!r} runs its agent {what}; this rollout has no sandbox client")
            return task
        if task is not None and is_agent_task(task):
            if self.agents is None:
                raise Poison(f"task {name!r} runs agent loops, which need a tokenizer; the engine has none")
            return task
        if task is not None and is_environment(task):
            if self.episodes is None or self.episodes.tokenizer is None:
                raise Poison(f"task {name!r} is a multi-turn environment, which needs a tokenizer; the engine has "
                             "none")
            if uses_sandbox(task) and self.agents is None:
                raise Poison(f"task {name!r} has tools that work in a sandbox; this rollout has no sandbox client")
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
        if is_black_box_agent(env):
            assert self.black_box is not None
            return await self.black_box.run(env, prompt, labels)
        if is_agent_task(env) or uses_sandbox(env):
            assert self.agents is not None
            return await self.agents.run(env, prompt, ticket.prompt_ids, params, labels=labels)
        return await self.episodes.run(env, prompt, ticket.prompt_ids, params, labels=labels)


def engine_device(engine: Any) -> str | None:
    """The engine's device for a weight receiver that writes into one (NCCL): the torch engine's own; for a
    vLLM engine its first GPU as this process sees it (its placement's ``CUDA_VISIBLE_DEVICES``); None on CPU."""
    device = getattr(engine, "device", None)
    if device is not None:
        return str(device)
    import torch

    return "cuda:0" if torch.cuda.is_available() else None


#: the single-turn environment reads nothing of the prompt beyond its token ids
_NO_PROMPT = Prompt(id="")


def build(loaded: Loaded) -> RolloutService:
    return RolloutService(loaded)
