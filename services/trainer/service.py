"""The trainer service, read top to bottom as a recipe::

    start = task and learner from the newest durable point, weight sender     (startup.py, resume.py)
    send the current weights (version v)
    consume trajectories: eval rounds, staleness filter, group buffer         (collect.py, admission.py)
    repeat total_steps times:
        groups  = await collect()               admission, tickets, complete groups     (collect.py)
        batch   = assemble(groups)              failed rollouts split off, dropped      (trainable.py)
        metrics = learner.step(batch)           GRPO update in a worker thread (learner.py, loss.py)
        weights = learner.snapshot()            version v + 1, a copy the next step cannot change
        in the background, while the next batch is collected and trained on:   (overlap.py)
            await sender.send(weights, v + 1)   durable/delivered before anything is acked
            await commit(batch)                 state saved, outcomes recorded, trajectories acked
            metrics, evaluation round           (ledger.py, outbox.py, step_figures.py, evaluation.py)
        checkpoint (the background work settled first)                          (saves.py)
    final evaluation, final model, summary                                      (saves.py)

The state (step, version, counters, ...) has one writer, the ledger (ledger.py); the collector, the
outcomes, the evaluations and this loop change it through it. Trajectory messages are deferred by the
consume handler (``Delivery.defer()``) and acked in ``commit``: a crash before their version is sent
redelivers them.

Publishing overlaps the next step (``overlap_publish``, on by default: overlap.py). The bookkeeping stays in
order: the next step moves the state (step, version) only after the previous step's publish and commit have
finished, so the state saved, the outcomes and the acks are exactly those of the serial loop; the commit
admits new prompt groups into the room it freed at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

from proto import catalog
from services.lib.colocation import DEVICE_SHARE
from services.runtime import tracing
from services.runtime.config import Loaded
from services.runtime.service import ServiceContext
from services.trainer import devices, nodes, saves, startup, trainable
from services.trainer.admission import Sample
from services.trainer.collect import Collector, Fleet
from services.trainer.config import TrainerConfig
from services.trainer.evaluation import Evaluations
from services.trainer.faults import fault_point
from services.trainer.learner import Learner
from services.trainer.outbox import Outcomes, Reporter, Tickets, Versions, indices
from services.trainer.overlap import Overlap
from services.trainer.ranks import RankGroup
from services.trainer.step_figures import batch_figures, commit_figures, record_version_lag, timed

log = logging.getLogger("rlbus.trainer")


class TrainerService:
    """``build(loaded)`` makes it (cheap); ``run(ctx)`` loads the model and trains."""

    def __init__(self, loaded: Loaded) -> None:
        self.loaded = loaded
        self.cfg: TrainerConfig = loaded.service
        # a device or world size this host cannot serve stops start-up here, naming the key
        self.placement = devices.resolve(self.cfg, dtype=loaded.model.dtype)

    async def run(self, ctx: ServiceContext) -> None:
        run_dir = Path(self.loaded.run.dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        if self.cfg.devices.node_rank > 0:  # another node of a multi-node group: node 0's rank 0 drives its ranks
            code = await asyncio.to_thread(nodes.node_agent, self.cfg.devices, run_dir)
            if code:
                raise RuntimeError(f"trainer node {self.cfg.devices.node_rank}: its rank group failed (exit {code}); "
                                   f"see {run_dir / 'ranks'}")
            return
        if self.cfg.devices.world_size == 1:
            await self._run(ctx, run_dir, None)
            return
        group = RankGroup.start(self.cfg, run_dir)  # from the event loop's (main) thread: see RankGroup
        try:
            await group.until_failed(self._run(ctx, run_dir, group))
        finally:
            await asyncio.to_thread(group.close)

    async def _run(self, ctx: ServiceContext, run_dir: Path, group: RankGroup | None) -> None:
        async with startup.started(ctx, self.loaded, run_dir, self.placement, group) as begun:
            await Trainer(ctx, self.cfg, self.loaded, run_dir, begun).run()


class Trainer:
    """One run of the training loop; every part it uses is made here."""

    def __init__(self, ctx: ServiceContext, cfg: TrainerConfig, loaded: Loaded, run_dir: Path,
                 begun: startup.Started) -> None:
        self.ctx = ctx
        self.cfg = cfg
        self.run_dir = run_dir
        self.task = begun.start.task
        self.distill = loaded.distill
        self.learner: Learner = begun.start.learner
        self.ledger = ledger = begun.ledger
        self.version_kept = begun.start.version_kept
        self.versions = Versions(begun.sender, ledger)
        self.started = time.time() - ledger.state.trained_s  # a resumed run's clock goes on
        self.reporter = Reporter(ctx, run_dir)
        tickets = Tickets(ctx, cfg, self.task, self.learner.tokenizer)
        self.evals = Evaluations(self.task.eval_prompts(cfg.eval.prompts), cfg.eval.samples, ledger, tickets,
                                 self.reporter, per_env=self.task.is_mixture)
        self.outcomes = Outcomes(ctx, ledger)
        prompts = self.task.train_prompts(loaded.run.seed, start=ledger.state.data_position)
        self.collector = Collector(cfg, ledger, prompts, tickets, self.evals, self.outcomes, Fleet(ctx))
        self.overlap = Overlap(cfg.overlap_publish)  # the last step's publish and commit, beside the next step

    async def run(self) -> None:
        ctx, state = self.ctx, self.ledger.state
        if not self.version_kept:  # the engines' first version (or the checkpoint's under a new number)
            await self.versions.send(await asyncio.to_thread(self.learner.state_dict))
        await self.ledger.save()
        await self.outcomes.flush()  # what a crash left owed (ledger.py, rule 1)
        if figures := self.task.metrics():  # figures about the tasks' data (their prompts are built by now)
            await self.reporter.emit(figures, step=state.step)
        # trajectories in: evaluation rounds, the staleness filter, the group buffer (collect.py)
        consumer = asyncio.create_task(ctx.consume(catalog.TRAJECTORIES, self.collector.handle, concurrency=64),
                                       name="trainer-consume")
        try:
            await self.evals.start()
            while state.step < self.cfg.total_steps and not ctx.stop.is_set() and not self._out_of_time():
                t_wait = time.perf_counter()
                groups = await self.collector.collect(ctx.stop)
                if not groups:
                    break
                await self._train_step(groups, wait_s=time.perf_counter() - t_wait)
            await self.overlap.settle()
            if not ctx.stop.is_set():
                await self._finish()
        finally:
            await self.overlap.settle(quiet=True)  # a version being sent is finished, its batch committed
            ctx.stop.set()
            await consumer  # unsettled trajectories are naked on the way out: redelivered at once

    async def _train_step(self, groups: list[list[Sample]], wait_s: float = 0.0) -> None:
        state = self.ledger.state
        batch = trainable.assemble(groups, self.distill)
        if not batch.samples:  # every rollout failed: the groups end with their failed outcomes
            await self.overlap.settle()
            await self.collector.fail_groups(groups, batch.failed)
            return
        # one span for the step, linked to every trajectory it trains on; the version it sends carries its
        # context to the engines (their "apply weights" spans link back to it)
        with tracing.span("train step", links=tracing.link_to([s.trace for s in batch.samples]),
                          step=state.step + 1, samples=len(batch.samples), groups=len(groups)):
            async with DEVICE_SHARE.trainer_turn():  # colocated engines with enable_sleep_mode give memory back
                with tracing.span("learner step"):
                    metrics = await asyncio.to_thread(self.learner.step, batch.trajectories, self.distill)
            # the previous step's version is sent and its batch committed before this step moves the state
            with timed(metrics, "time/settle_s"):  # what the overlap did not hide
                await self.overlap.settle()
            version_lag = record_version_lag(batch.samples, state.version)
            self.ledger.advance()
            state.trained_s = time.time() - self.started
            # the step's bookkeeping waits with its version: committed once it is sent (ledger.py, rule 2)
            outcomes = self.outcomes.records(batch.samples, "trained") + self.collector.failed_outcomes(batch.failed)
            self.ledger.stage(indices(s for g in groups for s in g), outcomes)
            # sent while the next step computes: a copy it cannot change
            background = self.overlap.now()
            with timed(metrics, "time/snapshot_s"):
                weights = await asyncio.to_thread(self.learner.snapshot if background else self.learner.state_dict)
            metrics["time/wait_s"] = wait_s  # blocked in collect for this batch
            metrics.update(batch_figures(batch.samples, self.collector.figures, self.task.is_mixture))
            done = self._publish_and_commit(groups, weights, metrics, version_lag)
            await self.overlap.hand_off(done, background, name=f"trainer-publish-{state.version}")
        if self.cfg.checkpoint_every and state.step % self.cfg.checkpoint_every == 0:
            await self.overlap.settle()  # the checkpoint holds this step's state: its commit first
            if not await saves.checkpoint(self.learner, self.ledger, self.run_dir):  # the disk is full: logged
                skipped = self.ctx.gauges.get("trainer/checkpoints_skipped", 0.0) + 1
                await self.ctx.report({"trainer/checkpoints_skipped": skipped})

    async def _publish_and_commit(self, groups: list[list[Sample]], weights: dict[str, Any],
                                  metrics: dict[str, float], version_lag: list[int]) -> None:
        """Save the staged step, send its version (durable before anything is acked), commit its batch,
        report it, and start an evaluation round when one is due."""
        state = self.ledger.state
        await self.ledger.save()  # the staged step first: a restart finds it whether or not the send finished
        with tracing.span("publish weights", version=state.version):  # a child of "train step" (a task copies the context)
            metrics["time/publish_s"] = await self.versions.send(weights)
        fault_point(self.run_dir, state.version)
        with timed(metrics, "time/commit_s"):  # outcomes, state, acks
            await self.collector.commit(groups)  # and the freed room is filled now
        metrics.update(commit_figures(self.ledger, self.versions, version_lag))
        await self.reporter.emit(metrics, step=state.step)
        if self.cfg.eval.every and state.step % self.cfg.eval.every == 0:
            await self.evals.start()

    def _out_of_time(self) -> bool:
        if over := bool(self.cfg.max_wall_s) and time.time() - self.started > self.cfg.max_wall_s:
            log.info("wall-clock budget of %.0fs reached at step %d", self.cfg.max_wall_s, self.ledger.state.step)
        return over

    async def _finish(self) -> None:
        """Final evaluation, then the final model, checkpoint and summary; the state says ``finished``."""
        await self.evals.start()
        await self.evals.wait_all(self.ctx.stop)
        await saves.finish(self.learner, self.ledger, self.run_dir, lora=self.cfg.lora is not None,
                           started=self.started)


def build(loaded: Loaded) -> TrainerService:
    return TrainerService(loaded)
