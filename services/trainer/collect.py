"""From prompt tickets out to complete batches in: admission, the staleness filter, the group buffer.

Flow::

    admission has room ──▶ next training prompt ──▶ ticket (PROMPTS, built and published here)
    trajectory (TRAJECTORIES) ──▶ handle(): eval round | stale → dropped | buffered (ack deferred)
    collect() ──▶ the oldest ``groups_per_step`` complete groups

A buffered trajectory's message is *deferred* (``Delivery.defer()``): the handler returns at
once and the trainer acks it only after the step that used it is durable (its weight version
sent, the state saved), or after its
``dropped`` outcome is recorded and the freed admission slot saved. A crash in between
redelivers it. Every trajectory ends with exactly one outcome on OUTCOMES
(trained | dropped | eval), so ``published = trained + dropped + eval + pending`` holds.

The collector changes the trainer's state only through the :class:`~services.trainer.ledger.Ledger`
(admissions, freed slots, saves); the admission bound follows the live rollout fleet's advertised
capacity (:class:`Fleet`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from typing import Any

from nats.js.errors import KeyDeletedError, KeyNotFoundError

from proto import catalog, codec
from proto.membership import Heartbeat
from proto.trajectories import ScoredGroup, ScoredTrajectory
from services.runtime import bus, tracing
from services.runtime.consume import Delivery
from services.runtime.service import ServiceContext
from services.tasks.base import Prompt
from services.trainer.admission import GroupBuffer, Sample, SampleAck, fleet_bound, fleet_tickets, is_stale
from services.trainer.config import TrainerConfig
from services.trainer.evaluation import Evaluations
from services.trainer.ledger import Ledger
from services.trainer.outbox import Outcomes, Tickets

log = logging.getLogger("rlbus.trainer.collect")

#: how often collect() re-checks staleness and group timeouts while nothing arrives
RECHECK_S = 5.0
#: how often the admission bound is fitted to the live rollout fleet
FLEET_EVERY_S = 2.0


class Fleet:
    """The live rollout fleet, from its heartbeats (members bucket): the prompt groups it works on at once."""

    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx = ctx
        self.kv: Any = None

    async def tickets(self) -> int:
        """What the rollout workers whose heartbeats say running, within three heartbeat periods, advertise
        they hold at once (``admission.fleet_tickets``)."""
        if self.kv is None:  # opened once: the bound is refitted every FLEET_EVERY_S
            self.kv = await bus.ensure_kv(self.ctx.js, catalog.MEMBERS)
        beats = []
        for key in await bus.kv_keys(self.ctx.js, catalog.MEMBERS.bucket, f"{self.ctx.run_id}.rollout."):
            try:
                beats.append(codec.decode((await self.kv.get(key)).value, Heartbeat))
            except (KeyNotFoundError, KeyDeletedError):  # left (entry deleted), or between listing and read
                continue
        return fleet_tickets(beats, "rollout", time.time(), 3 * self.ctx.cfg.common.heartbeat_s)


class Collector:
    """Admission, the staleness filter and the group buffer between the bus and the learner."""

    def __init__(self, cfg: TrainerConfig, ledger: Ledger, prompts: Iterator[Prompt], tickets: Tickets,
                 evals: Evaluations, outcomes: Outcomes, fleet: Fleet | None = None) -> None:
        """``fleet``: the live rollout fleet (None: unknown); with it the admission bound follows what the
        fleet can work on at once (``admission.fleet_bound``)."""
        self.cfg = cfg
        self.ledger = ledger
        self.admission = ledger.admission
        self.prompts = prompts
        self.tickets = tickets
        self.evals = evals
        self.outcomes = outcomes
        self.buffer = GroupBuffer()
        self.arrived = asyncio.Event()
        self.fleet = fleet
        self._fleet_at = float("-inf")

    # --- trajectories in ---------------------------------------------------------------------------

    async def handle(self, msg: ScoredGroup, d: Delivery[Any]) -> None:
        """The consume handler: returns at once; the message is settled through its deferred ack, shared by
        the samples it carries (a scored group: its samples are trained or dropped together)."""
        trajs: list[ScoredTrajectory] = msg.records()  # each joined with the group's ticket
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
            await self.evals.receive(evals)
            await self.outcomes.record(evals, "eval")
            await asyncio.gather(*(s.settle() for s in evals))
            samples = [s for s in samples if not s.item.rollout.is_eval]
            if not samples:
                return
        if group_id in self.buffer.dropped_groups:
            await self.drop(samples, "group already dropped for staleness")
            return
        version, max_staleness = self.ledger.state.version, self.cfg.max_staleness
        stale = next((s for s in samples if is_stale(s.version, version, max_staleness)), None)
        if stale is not None:
            reason = (f"stale: oldest token from version {stale.version}, trainer at {version}, "
                      f"max_staleness {max_staleness}")
            await self.drop([*samples, *self._give_up(group_id)], reason)
            return
        for s in samples:
            displaced = self.buffer.add(s, s.item.rollout.group_size)
            if displaced is not None:  # a redelivery of a sample already held: the newer delivery is kept
                self.ledger.count("duplicate")
                await displaced.settle()
        self.arrived.set()

    async def drop(self, samples: list[Sample], reason: str) -> None:
        """Record ``dropped`` outcomes, make the freed admission slots durable, then ack."""
        await self.outcomes.record(samples, "dropped", reason)
        # a restarted trainer must not wait for groups whose trajectories were taken off the stream
        await self.ledger.save()
        await asyncio.gather(*(s.settle() for s in samples))
        self.arrived.set()  # a slot may be free: admit more

    def _give_up(self, group_id: str) -> list[Sample]:
        self.ledger.release(group_id)
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

    async def record_failed(self, failed: list[Sample]) -> None:
        """Rollouts that failed (sandbox died, engine error) are dropped with their error, never trained on."""
        await asyncio.gather(*(self.outcomes.record([s], "dropped", f"rollout failed: {s.item.rollout.error[:300]}")
                               for s in failed))

    async def commit(self, groups: list[list[Sample]], failed: list[Sample], trained: list[Sample]) -> None:
        """The step is durable (its version sent): free the groups' slots, record the trained outcomes, save
        the state, ack the trajectories; then admit prompt groups into the freed room at once (a commit that
        runs beside the next learner step, ``overlap_publish``, would otherwise leave the room empty until
        the next collect(), and the rollouts idle for a whole learner step)."""
        for g in groups:
            self.ledger.release(g[0].group_id)
        await self.outcomes.record(trained, "trained")
        await self.ledger.save()
        await asyncio.gather(*(s.settle() for s in failed + trained))
        await self._top_up()

    async def _fit_to_fleet(self) -> None:
        """Every ``FLEET_EVERY_S``, set the admission bound for the live rollout fleet."""
        if self.fleet is None or time.monotonic() - self._fleet_at < FLEET_EVERY_S:
            return
        self._fleet_at = time.monotonic()
        try:
            tickets = await self.fleet.tickets()
        except Exception as e:  # the members bucket unreadable for now: the bound stays as it is
            log.debug("could not read the rollout fleet: %s", e)
            return
        bound = fleet_bound(self.cfg.max_staleness, self.cfg.groups_per_step, tickets)
        if bound != self.admission.max_in_flight:
            log.info("admission bound %d -> %d groups (the live rollout workers hold %d at once)",
                     self.admission.max_in_flight, bound, tickets)
            self.admission.resize(bound)

    async def _top_up(self) -> None:
        """Admit prompt groups while there is room (the staleness-derived bound), each one's ticket sent."""
        while self.admission.room() > 0:
            prompt = next(self.prompts)
            group_id = self.ledger.admit_next()
            await self.tickets.publish(prompt, group_id, self.ledger.state.version)

    async def _expire(self) -> None:
        """Drop groups that went stale while waiting, and free slots of groups that never came back."""
        cfg, version = self.cfg, self.ledger.state.version
        for gid in self.buffer.stale_groups(version, cfg.max_staleness):
            await self.drop(self._give_up(gid), f"stale: waited past max_staleness {cfg.max_staleness} "
                                                f"(trainer at version {version})")
        for gid in self.admission.overdue(cfg.group_timeout_s):
            log.warning("group %s did not complete within %.0fs; its slot is freed", gid, cfg.group_timeout_s)
            await self.drop(self._give_up(gid), f"stale: group incomplete after {cfg.group_timeout_s:.0f}s")
