"""From prompt tickets out to complete batches in: admission, the staleness filter, the group buffer.

Flow::

    admission has room ──▶ next training prompt ──▶ ticket (PROMPTS)
    trajectory (TRAJECTORIES) ──▶ handle(): eval round | stale → dropped | buffered (ack deferred)
    collect() ──▶ the oldest ``groups_per_step`` complete groups

A buffered trajectory's message is *deferred* (``Delivery.defer()``): the handler returns at
once and the trainer acks it only after the step that used it is durable (its weight version
sent, the state saved), or after its
``dropped`` outcome is recorded and the freed admission slot saved. A crash in between
redelivers it. Every trajectory ends with exactly one outcome on OUTCOMES
(trained | dropped | eval), so ``published = trained + dropped + eval + pending`` holds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from proto import catalog
from proto.accounting import OutcomeBatch, TrajectoryOutcome
from proto.trajectories import ScoredGroup, ScoredTrajectory
from services.runtime import metrics, tracing
from services.runtime.consume import Delivery
from services.runtime.service import ServiceContext
from services.trainer.admission import Admission, GroupBuffer, Sample, SampleAck, fleet_bound, is_stale
from services.trainer.config import TrainerConfig
from services.trainer.evaluation import EvalRound, Evaluations
from services.trainer.state import TrainerState

log = logging.getLogger("rlbus.trainer.collect")
_OUTCOMES = metrics.counter("trajectory_outcomes", "trajectories trained, dropped (by reason) or evaluated")

#: how often collect() re-checks staleness and group timeouts while nothing arrives
RECHECK_S = 5.0
#: how often the admission bound is fitted to the live rollout fleet
FLEET_EVERY_S = 2.0


class Outcomes:
    """Records what became of trajectories (stream OUTCOMES) and counts it in the state."""

    def __init__(self, ctx: ServiceContext, state: TrainerState) -> None:
        self.ctx = ctx
        self.state = state

    async def record(self, samples: list[Sample], outcome: str, reason: str = "") -> None:
        """One outcome per sample, the lot published as one message (parts when over the size limit)."""
        self.state.count(outcome, len(samples))
        if not samples:
            return
        # the reason's kind (its text before the first colon) keeps the label set small
        _OUTCOMES(len(samples), outcome=outcome, reason=reason.split(":", 1)[0][:40] if reason else "")
        records = [TrajectoryOutcome(run_id=self.ctx.run_id, trajectory_id=s.key, group_id=s.group_id,
                                     outcome=outcome, reason=reason, step=self.state.step, version=self.state.version,
                                     sample_version=s.version, batch_index=i if outcome == "trained" else -1,
                                     msg_id=f"{s.key}-outcome") for i, s in enumerate(samples)]
        try:  # an id per first trajectory and size: a restarted trainer recording the same lot is de-duplicated
            await self.ctx.publish_parts(catalog.OUTCOMES, records, lambda part: OutcomeBatch(
                run_id=self.ctx.run_id, outcomes=part, msg_id=f"{part[0].msg_id}-{len(part)}"))
        except Exception as e:  # accounting must not stop training; the trajectories themselves are safe
            log.warning("could not record the outcomes of %d trajectories (%s): %s", len(samples), outcome, e)


class Collector:
    """Admission, the staleness filter and the group buffer between the bus and the learner."""

    def __init__(self, cfg: TrainerConfig, state: TrainerState, prompts: Iterator[Any],
                 send_ticket: Callable[[Any, str], Awaitable[None]], evals: Evaluations, outcomes: Outcomes,
                 save_state: Callable[[], Awaitable[None]],
                 on_eval: Callable[[EvalRound], Awaitable[None]],
                 fleet: Callable[[], Awaitable[int | None]] | None = None, tickets_per_worker: int = 64) -> None:
        """``fleet``: the live rollout workers (None: unknown); with it the admission bound follows the
        fleet (``admission.fleet_bound``), each worker holding ``tickets_per_worker`` groups at once."""
        self.cfg = cfg
        self.state = state
        self.prompts = prompts
        self.send_ticket = send_ticket
        self.evals = evals
        self.outcomes = outcomes
        self.save_state = save_state
        self.on_eval = on_eval
        self.admission = Admission(cfg.max_groups_in_flight)
        self.admission.restore(state.in_flight)
        self.buffer = GroupBuffer()
        self.arrived = asyncio.Event()
        self.fleet = fleet
        self.tickets_per_worker = tickets_per_worker
        self._fleet_at = float("-inf")

    def sync_state(self) -> None:
        """Copy the admission bookkeeping into the state before it is saved."""
        self.state.in_flight = self.admission.state()

    # --- trajectories in ---------------------------------------------------------------------------

    async def handle(self, msg: ScoredGroup | ScoredTrajectory, d: Delivery[Any]) -> None:
        """The consume handler: returns at once; the message is settled through its deferred ack, shared by
        the samples it carries (a scored group: its samples are trained or dropped together)."""
        trajs: list[ScoredTrajectory] = catalog.members(msg)
        acks = SampleAck.split(d.defer(), len(trajs))
        trace = tracing.traceparent()
        groups: dict[str, list[Sample]] = {}
        for t, ack in zip(trajs, acks, strict=True):
            r = t.rollout
            groups.setdefault(r.group_id, []).append(Sample(
                key=t.msg_id, group_id=r.group_id, sample_index=r.sample_index, version=r.min_version(), item=t,
                ack=ack, trace=trace))
        for group_id, samples in groups.items():
            await self._receive(group_id, samples)

    async def _receive(self, group_id: str, samples: list[Sample]) -> None:
        """Samples of one group: evaluated, dropped (their group went stale), or buffered until trained."""
        evals = [s for s in samples if s.item.rollout.is_eval]
        if evals:
            finished = [f for s in evals if (f := self.evals.record(s.item)) is not None]
            await self.outcomes.record(evals, "eval")
            await asyncio.gather(*(s.ack.ack() for s in evals))
            for f in finished:
                await self.on_eval(f)
            samples = [s for s in samples if not s.item.rollout.is_eval]
            if not samples:
                return
        if group_id in self.buffer.dropped_groups:
            await self.drop(samples, "group already dropped for staleness")
            return
        stale = next((s for s in samples if is_stale(s.version, self.state.version, self.cfg.max_staleness)), None)
        if stale is not None:
            reason = (f"stale: oldest token from version {stale.version}, trainer at {self.state.version}, "
                      f"max_staleness {self.cfg.max_staleness}")
            await self.drop([*samples, *self._give_up(group_id)], reason)
            return
        for s in samples:
            displaced = self.buffer.add(s, s.item.rollout.group_size)
            if displaced is not None:  # a redelivery of a sample already held: the newer delivery is kept
                self.state.count("duplicate")
                await displaced.ack.ack()
        self.arrived.set()

    async def drop(self, samples: list[Sample], reason: str) -> None:
        """Record ``dropped`` outcomes, make the freed admission slots durable, then ack."""
        await self.outcomes.record(samples, "dropped", reason)
        # a restarted trainer must not wait for groups whose trajectories were taken off the stream
        await self.save_state()
        await asyncio.gather(*(s.ack.ack() for s in samples))
        self.arrived.set()  # a slot may be free: admit more

    def _give_up(self, group_id: str) -> list[Sample]:
        self.admission.finish(group_id)
        return self.buffer.drop_group(group_id)

    # --- batches out -------------------------------------------------------------------------------

    async def collect(self, stop: asyncio.Event) -> list[list[Sample]]:
        """Top up admission and expire what went stale until ``groups_per_step`` groups are complete.

        Returns them (taken out of the buffer), or ``[]`` once ``stop`` is set.
        """
        n = self.cfg.groups_per_step
        while not stop.is_set():
            await self._fit_to_fleet()
            await self._top_up()
            await self._expire()
            if len(self.buffer.complete_groups()) >= n:
                return self.buffer.take(n)
            self.arrived.clear()
            arrived = asyncio.create_task(self.arrived.wait(), name="trainer-arrived")
            stopped = asyncio.create_task(stop.wait(), name="trainer-stopped")
            await asyncio.wait({arrived, stopped}, timeout=RECHECK_S, return_when=asyncio.FIRST_COMPLETED)
            arrived.cancel()
            stopped.cancel()
        return []

    def finish(self, groups: list[list[Sample]]) -> None:
        """The groups were trained on (or all their samples dropped): their admission slots are free (the
        trainer fills them with :meth:`admit` after its commit)."""
        for g in groups:
            self.admission.finish(g[0].group_id)

    async def admit(self) -> None:
        """Admit prompt groups into the room a commit freed, now: a commit that runs beside the next learner
        step (``overlap_publish``) would otherwise leave the room empty until the next collect(), and the
        rollouts idle for a whole learner step."""
        await self._top_up()

    async def _fit_to_fleet(self) -> None:
        """Every ``FLEET_EVERY_S``, set the admission bound for the live rollout fleet."""
        if self.fleet is None or time.monotonic() - self._fleet_at < FLEET_EVERY_S:
            return
        self._fleet_at = time.monotonic()
        try:
            workers = await self.fleet()
        except Exception as e:  # the members bucket unreadable for now: the bound stays as it is
            log.debug("could not read the rollout fleet: %s", e)
            return
        bound = fleet_bound(self.cfg.max_staleness, self.cfg.groups_per_step, workers, self.tickets_per_worker)
        if bound != self.admission.max_in_flight:
            log.info("admission bound %d -> %d groups (%s live rollout workers)", self.admission.max_in_flight,
                     bound, workers)
            self.admission.resize(bound)

    async def _top_up(self) -> None:
        """Admit prompt groups while there is room (the staleness-derived bound)."""
        while self.admission.room() > 0:
            group_id = f"g{self.state.data_position:08d}"
            prompt = next(self.prompts)
            self.admission.admit(group_id, self.state.version)
            self.state.data_position += 1
            await self.send_ticket(prompt, group_id)

    async def _expire(self) -> None:
        """Drop groups that went stale while waiting, and free slots of groups that never came back."""
        cfg = self.cfg
        for gid in self.buffer.stale_groups(self.state.version, cfg.max_staleness):
            await self.drop(self._give_up(gid), f"stale: waited past max_staleness {cfg.max_staleness} "
                                                f"(trainer at version {self.state.version})")
        for gid in self.admission.overdue(cfg.group_timeout_s):
            log.warning("group %s did not complete within %.0fs; its slot is freed", gid, cfg.group_timeout_s)
            await self.drop(self._give_up(gid), f"stale: group incomplete after {cfg.group_timeout_s:.0f}s")
