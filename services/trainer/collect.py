"""From prompt tickets out to complete batches in: admission, the staleness filter, the group buffer.

Flow::

    admission has room ──▶ next training prompt ──▶ ticket (PROMPTS, built and published here)
    trajectory (TRAJECTORIES) ──▶ handle(): eval round | stale → dropped | buffered (ack deferred)
    a group complete ──▶ dynamic sampling: no reward signal → dropped ("filtered"), its slot admits another
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
from proto.accounting import TrajectoryOutcome
from proto.membership import Heartbeat
from proto.trajectories import ScoredGroup, ScoredTrajectory
from services.runtime import bus, metrics, tracing
from services.runtime.consume import Delivery, Poison
from services.runtime.service import ServiceContext
from services.tasks.base import Prompt
from services.trainer.admission import GroupBuffer, Sample, SampleAck, fleet_bound, fleet_tickets, is_stale
from services.trainer.config import TrainerConfig
from services.trainer.evaluation import Evaluations
from services.trainer.ledger import Ledger
from services.trainer.outbox import Outcomes, Tickets, TicketTooLarge, indices

log = logging.getLogger("rlbus.trainer.collect")

#: how often collect() re-checks staleness and group timeouts while nothing arrives
RECHECK_S = 5.0
#: samples refused (never admitted, a copy of a finished group, malformed): dead-lettered, never trained
_REJECTED = metrics.counter("trainer_rejected_samples", "samples dead-lettered by the trainer, by reason")
#: how often the admission bound is fitted to the live rollout fleet
FLEET_EVERY_S = 2.0


def without_signal(samples: list[Sample]) -> str:
    """Why a complete group gives GRPO no signal, as a ``filtered`` reason ("" if it gives some): the rewards of
    its successful samples are all equal (so every advantage is 0). Failed samples are left out (they are dropped
    with their error, never trained); a group whose every sample failed is not this filter's."""
    rewards = [s.item.reward for s in samples if not s.item.rollout.error]
    if not rewards or max(rewards) != min(rewards):
        return ""
    return f"filtered: no reward signal (dynamic sampling), all {len(rewards)} rewards {rewards[0]:g}"


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
        #: groups taken by a step whose version is not yet sent -> redelivered copies settled with that step
        self._stepping: dict[str, list[Sample]] = {}
        #: groups filtered (dynamic sampling) since the last batch was taken
        self.filtered = 0
        #: the figures of the last batch taken (``trainer/filtered_frac``), reported with its step
        self.figures: dict[str, float] = {}

    # --- trajectories in ---------------------------------------------------------------------------

    async def handle(self, msg: ScoredGroup, d: Delivery[Any]) -> None:
        """The consume handler: returns at once; the message is settled through its deferred ack, shared by
        the samples it carries (a scored group: its samples are trained or dropped together). A message with a
        sample the trainer must not train (a group never admitted, a copy of a finished one) is dead-lettered
        whole, with the reason (``Poison``)."""
        trajs: list[ScoredTrajectory] = msg.records()  # each joined with the group's ticket
        refused = self._refused(trajs, redelivered=d.num_delivered > 1)
        if refused:
            self.ledger.count("rejected", len(trajs))
            _REJECTED(len(trajs), reason=refused.split(":", 1)[0])
            raise Poison(refused)
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

    def _refused(self, trajs: list[ScoredTrajectory], redelivered: bool) -> str:
        """Why a message's training samples must not be taken (rule 3 of :mod:`services.trainer.ledger`); "" if
        they may."""
        for t in trajs:
            r = t.rollout
            if r.is_eval:
                continue
            if r.group_size != self.cfg.group_size or not 0 <= r.sample_index < r.group_size:
                return (f"malformed: sample {r.sample_index} of group {r.group_id} of size {r.group_size}; this "
                        f"trainer issues groups of {self.cfg.group_size}")
            status = self.ledger.status(r.group_id, r.sample_index)
            if status == "never":
                return (f"never admitted: group {r.group_id} was not issued by this trainer (next data position "
                        f"{self.ledger.state.data_position}); its samples are never trained")
            copy = status in ("outcome", "forgotten") or (r.group_id in self._stepping and not redelivered)
            if copy and not redelivered:
                return (f"group already finished: sample {r.sample_index} of {r.group_id} already has its outcome; "
                        "a new message carrying it (replayed or forged) is never trained")
        return ""

    async def _receive(self, group_id: str, samples: list[Sample]) -> None:
        """Samples of one group: evaluated, dropped (their group went stale), or buffered until trained."""
        evals = [s for s in samples if s.item.rollout.is_eval]
        if evals:
            await self.evals.receive(evals)
            await self.outcomes.record(evals, "eval", save=False)
            await asyncio.gather(*(s.settle() for s in evals))
            samples = [s for s in samples if not s.item.rollout.is_eval]
            if not samples:
                return
        stepping = self._stepping.get(group_id)
        if stepping is not None:  # redelivered while its step's version is sent: settled with that step
            self.ledger.count("duplicate", len(samples))
            stepping.extend(samples)
            return
        status = {s.key: self.ledger.status(group_id, s.sample_index) for s in samples}
        copies = [s for s in samples if status[s.key] in ("outcome", "forgotten")]
        if copies:  # redelivered after its outcome was written (a lost ack): settled, no second outcome
            self.ledger.count("duplicate", len(copies))
            await asyncio.gather(*(s.settle() for s in copies))
        late = [s for s in samples if status[s.key] == "finished"]
        if late:
            await self.drop(late, "group already dropped for staleness" if group_id in self.buffer.dropped_groups
                            else "group already finished")
        samples = [s for s in samples if status[s.key] == "in_flight"]
        if not samples:
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
            if displaced is not None:  # a redelivery of a sample already held: the newer delivery is kept, and
                self.ledger.count("duplicate")  # the older settles with it (acking it now would ack the message)
                s.copies.append(displaced)
        if self.cfg.dynamic_sampling:
            await self._filter(group_id)
        self.arrived.set()

    async def _filter(self, group_id: str) -> None:
        """Dynamic sampling (DAPO): a complete group without reward signal is dropped with the reason, its slot
        freed, so the next collect() admits another group in its place (through the same admission bound)."""
        held = self.buffer.held(group_id)
        if not held or len(held) < held[0].item.rollout.group_size:
            return
        reason = without_signal(held)
        if not reason or self.filtered >= self.cfg.dynamic_sampling_bound * self.cfg.groups_per_step:
            return
        self.filtered += 1
        held = self._give_up(group_id)
        failed = [s for s in held if s.item.rollout.error]
        await self.drop([s for s in held if not s.item.rollout.error], reason)
        for s in failed:
            await self.drop([s], f"rollout failed: {(s.item.rollout.error or '')[:300]}")

    async def drop(self, samples: list[Sample], reason: str) -> None:
        """Record ``dropped`` outcomes (one per trajectory: a redelivered copy and the one held are one), make
        them and the freed admission slots durable, then ack."""
        await self.outcomes.record(list({s.key: s for s in samples}.values()), "dropped", reason)
        await asyncio.gather(*(s.settle() for s in samples))
        self.arrived.set()  # a slot may be free: admit more

    def _give_up(self, group_id: str) -> list[Sample]:
        self.ledger.abandon(group_id)
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
                taken = self.buffer.take(n)
                if self.cfg.dynamic_sampling:
                    self.figures = {"trainer/filtered_groups": float(self.filtered),
                                    "trainer/filtered_frac": self.filtered / (self.filtered + len(taken))}
                    self.filtered = 0
                for g in taken:  # until its step commits, a redelivered copy is held with it
                    self._stepping[g[0].group_id] = []
                return taken
            self.arrived.clear()
            arrived = asyncio.create_task(self.arrived.wait(), name="trainer-arrived")
            stopped = asyncio.create_task(stop.wait(), name="trainer-stopped")
            await asyncio.wait({arrived, stopped}, timeout=RECHECK_S, return_when=asyncio.FIRST_COMPLETED)
            arrived.cancel()
            stopped.cancel()
        return []

    def failed_outcomes(self, failed: list[Sample]) -> list[TrajectoryOutcome]:
        """Rollouts that failed (sandbox died, engine error) are dropped with their error, never trained on."""
        return [o for s in failed for o in self.outcomes.records([s], "dropped",
                                                                 f"rollout failed: {s.item.rollout.error[:300]}")]

    async def fail_groups(self, groups: list[list[Sample]], failed: list[Sample]) -> None:
        """A batch with nothing to train (every rollout failed): its groups end with their failed outcomes."""
        for g in groups:
            self.ledger.abandon(g[0].group_id)
        self.ledger.owe(self.failed_outcomes(failed), indices(failed))
        await self._settle_groups(groups)

    async def commit(self, groups: list[list[Sample]]) -> None:
        """The staged step's version is sent: its groups are released and its outcomes owed (the ledger), the
        state saved, the outcomes published, the trajectories acked; then prompt groups are admitted into the
        freed room at once (a commit that runs beside the next learner step, ``overlap_publish``, would
        otherwise leave the room empty until the next collect(), and the rollouts idle for a whole learner
        step)."""
        self.ledger.commit_pending()
        await self._settle_groups(groups)

    async def _settle_groups(self, groups: list[list[Sample]]) -> None:
        admitted = self._admit()  # into the freed room, saved with the commit (admitted before issued)
        await self.ledger.save()  # the outcomes owed and the new groups admitted: both durable from here
        held = [s for g in groups for s in g + self._stepping.pop(g[0].group_id, [])]

        async def record() -> None:  # outcomes written before their trajectories are acked (ledger.py, rule 1)
            await self.outcomes.flush()
            await asyncio.gather(*(s.settle() for s in held))

        # the next batch's tickets do not wait for this batch's outcomes and acks: in a synchronous run they
        # are the next step's critical path (bench/bus_gaps.py: to_tickets)
        await asyncio.gather(self._issue(admitted), record())

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
        """Admit prompt groups while there is room (the staleness-derived bound), save, then send their tickets."""
        admitted = self._admit()
        if admitted:
            await self.ledger.save()
            await self._issue(admitted)

    def _admit(self) -> list[tuple[Prompt, str]]:
        """Admit the next prompt groups into the room there is (not yet issued: :meth:`_issue`).

        A group is *admitted before it is issued*: the state that records it (the data position past it, the
        group in flight) is saved before its ticket leaves. Otherwise a trainer stopped between the two would
        restart behind its own tickets: it would dead-letter their answers as never admitted, and issue the
        same group ids again, whose tickets and answers JetStream drops as duplicates of the first ones (fixed
        message ids), so those groups would wait out ``group_timeout_s``."""
        admitted = []
        while self.admission.room() > 0:
            admitted.append((next(self.prompts), self.ledger.admit_next()))
        return admitted

    async def _issue(self, admitted: list[tuple[Prompt, str]]) -> None:
        """Send the admitted groups' tickets, in a window (``[common] publish_window``: their acks awaited
        together; a rollout takes tickets in any order); a prompt whose ticket cannot be published is
        dead-lettered. Every ticket is tried; then a publish that failed for good is raised (its group stays
        in flight until ``group_timeout_s`` frees its slot)."""
        if not admitted:
            return
        # built first, in a thread: tokenizing a long prompt must neither stall the event loop (heartbeats, the
        # consumer) nor hold back the tickets before it, which would sit unsent in the connection's buffer
        built = await asyncio.to_thread(self.tickets.build_all, admitted, self.ledger.state.version)
        sending = [t for t in built if not isinstance(t, TicketTooLarge)]
        sent = iter(await bus.in_window((self.tickets.send(t) for t in sending), self.tickets.window))
        abandoned, failure = False, None
        for (prompt, group_id), ticket in zip(admitted, built, strict=True):
            result = ticket if isinstance(ticket, TicketTooLarge) else next(sent)
            if isinstance(result, TicketTooLarge):  # the row costs only itself: dead-lettered, counted, passed over
                self.ledger.abandon(group_id)
                self.ledger.count("prompts_dead_lettered")
                log.warning("prompt %s skipped (%s): %s", prompt.id, group_id, result)
                await self.tickets.dead_letter(prompt, group_id, str(result))
                abandoned = True
            elif isinstance(result, BaseException) and failure is None:
                failure = result
        if abandoned:  # its slot freed durably: a restart does not wait for it
            await self.ledger.save()
        if failure is not None:
            raise failure

    async def _expire(self) -> None:
        """Drop groups that went stale while waiting, and free slots of groups that never came back."""
        cfg, version = self.cfg, self.ledger.state.version
        for gid in self.buffer.stale_groups(version, cfg.max_staleness):
            await self.drop(self._give_up(gid), f"stale: waited past max_staleness {cfg.max_staleness} "
                                                f"(trainer at version {version})")
        for gid in self.admission.overdue(cfg.group_timeout_s):
            log.warning("group %s did not complete within %.0fs; its slot is freed", gid, cfg.group_timeout_s)
            await self.drop(self._give_up(gid), f"stale: group incomplete after {cfg.group_timeout_s:.0f}s")
