"""The trainer service, read top to bottom as a recipe::

    start = load the task and learner, continue from the newest durable point   (resume.py)
    send the current weights (version v)
    repeat total_steps times:
        batch   = await collect()                 admission, tickets, staleness filter, groups (collect.py)
        metrics = learner.step(batch)             GRPO update in a worker thread (learner.py, loss.py)
        weights = learner.snapshot()              version v + 1, a copy the next step cannot change
        in the background, while the next batch is collected and trained on:
            await sender.send(weights, v + 1)     durable/delivered before anything is acked
            await commit(batch)                   state saved, outcomes recorded, trajectories acked
            metrics, evaluation round             (ledger.py, outbox.py, evaluation.py)
        checkpoint (the background work settled first)
    final evaluation, final model, summary

The state (step, version, counters, ...) has one writer, the ledger (ledger.py); the collector, the
outcomes, the evaluations and this loop change it through it. Trajectory messages are deferred by the
consume handler (``Delivery.defer()``) and acked in ``commit``: a crash before their version is sent
redelivers them.

Publishing overlaps the next step (``overlap_publish``, on by default). The bookkeeping stays in order:
the next step moves the state (step, version) only after the previous step's publish and commit have
finished, so the state saved, the outcomes and the acks are exactly those of the serial loop; the commit
admits new prompt groups into the room it freed at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any

from proto import catalog
from services.lib.chat_template import use_chat_template
from services.lib.colocation import DEVICE_SHARE, HostOffload
from services.lib.weights.transport import WeightSender, make_sender
from services.runtime import bus, metrics, tracing
from services.runtime.config import Loaded
from services.runtime.service import ServiceContext, colocated_names
from services.tasks.mixture import env_figures
from services.trainer import devices, nodes, resume
from services.trainer.admission import Sample
from services.trainer.collect import Collector, Fleet
from services.trainer.config import TrainerConfig
from services.trainer.distill import fail_missing_teacher
from services.trainer.evaluation import Evaluations
from services.trainer.faults import fault_point
from services.trainer.learner import Learner
from services.trainer.ledger import Ledger
from services.trainer.outbox import Outcomes, Reporter, Tickets, Versions, indices
from services.trainer.ranks import RankGroup
from services.trainer.state import load_from_kv, summary_of

log = logging.getLogger("rlbus.trainer")
#: the trainer's version minus each trained sample's oldest-token version (its ``version_lag``)
_STALENESS = metrics.histogram("trainer_staleness", "versions between a trained sample's oldest token and the step")


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
        loaded = self.loaded
        start = await asyncio.to_thread(resume.load, self.cfg, loaded.model, loaded.task, run_dir / "checkpoints",
                                        loaded.run.seed, self.placement, group)
        if "rollout" in colocated_names():  # its engines start once this is said (services/lib/colocation.py)
            # on a GPU they take the device between steps: the learner's memory moves out of their way
            learner, on_gpu = start.learner, self.placement.device_type == "cuda" and group is None
            await DEVICE_SHARE.set_trainer(HostOffload([learner.model, learner.ref_model], [learner.optimizer],
                                                       self.placement.device) if on_gpu else None)
        runs_kv = await bus.ensure_kv(ctx.js, catalog.RUNS)
        sender = make_sender(loaded.weights, ctx.nc, ctx.run_id, device=self.placement.device)
        await sender.start()
        try:
            await resume.continue_from_saved(start, await load_from_kv(runs_kv, ctx.run_id), sender)
            ledger = Ledger(start.state, runs_kv, ctx.run_id, self.cfg.max_groups_in_flight)
            await Trainer(ctx, self.cfg, loaded, run_dir, start, sender, ledger).run()
        finally:
            await sender.close()


class Trainer:
    """One run of the training loop; every part it uses is made here."""

    def __init__(self, ctx: ServiceContext, cfg: TrainerConfig, loaded: Loaded, run_dir: Path,
                 start: resume.Start, sender: WeightSender, ledger: Ledger) -> None:
        self.ctx = ctx
        self.cfg = cfg
        self.run_dir = run_dir
        self.task = start.task
        self.distill = loaded.distill
        self.learner: Learner = start.learner
        self.ledger = ledger
        self.version_kept = start.version_kept
        self.versions = Versions(sender, ledger)
        self.started = time.time() - ledger.state.trained_s  # a resumed run's clock goes on
        self.reporter = Reporter(ctx, run_dir)
        use_chat_template(self.learner.tokenizer, loaded.model.chat_template)  # [model] chat_template, if any
        tickets = Tickets(ctx, cfg, self.task, self.learner.tokenizer)
        self.evals = Evaluations(self.task.eval_prompts(cfg.eval.prompts), cfg.eval.samples, ledger, tickets,
                                 self.reporter, per_env=self.task.is_mixture)
        self.outcomes = Outcomes(ctx, ledger)
        prompts = self.task.train_prompts(loaded.run.seed, start=ledger.state.data_position)
        self.collector = Collector(cfg, ledger, prompts, tickets, self.evals, self.outcomes, Fleet(ctx))
        self._pending: asyncio.Task[None] | None = None  # the last step's publish and commit (overlap_publish)

    async def run(self) -> None:
        ctx, state = self.ctx, self.ledger.state
        if not self.version_kept:  # the engines' first version (or the checkpoint's under a new number)
            await self.versions.send(await asyncio.to_thread(self.learner.state_dict))
        await self.ledger.save()
        await self.outcomes.flush()  # what a crash left owed (ledger.py, rule 1)
        if figures := self.task.metrics():  # figures about the tasks' data (their prompts are built by now)
            await self.reporter.emit(figures, step=state.step)
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
            await self._settle()
            if not ctx.stop.is_set():
                await self._finish()
        finally:
            await self._settle(quiet=True)  # a version being sent is finished, its batch committed
            ctx.stop.set()
            await consumer  # unsettled trajectories are naked on the way out: redelivered at once

    async def _train_step(self, groups: list[list[Sample]], wait_s: float = 0.0) -> None:
        state = self.ledger.state
        samples = [s for g in groups for s in g]
        if self.distill.enabled:  # never trained without its teacher logprobs: dropped with the reason
            fail_missing_teacher(samples)
        # a failed rollout (sandbox died, engine error) is dropped with its error, never trained on as reward 0
        failed = [s for s in samples if s.item.rollout.error]
        samples = [s for s in samples if not s.item.rollout.error]
        if not samples:
            await self._settle()
            await self.collector.fail_groups(groups, failed)
            return
        # one span for the step, linked to every trajectory it trains on; the version it sends carries its
        # context to the engines (their "apply weights" spans link back to it)
        with tracing.span("train step", links=tracing.link_to([s.trace for s in samples]),
                          step=state.step + 1, samples=len(samples), groups=len(groups)):
            async with DEVICE_SHARE.trainer_turn():  # colocated engines with enable_sleep_mode give memory back
                with tracing.span("learner step"):
                    metrics = await asyncio.to_thread(self.learner.step, [s.item for s in samples], self.distill)
            # the previous step's version is sent and its batch committed before this step moves the state
            t_settle = time.perf_counter()
            await self._settle()
            metrics["time/settle_s"] = time.perf_counter() - t_settle  # what the overlap did not hide
            # versions each sample's oldest token is behind the trainer (unlike step_input.behind_freshest)
            version_lag = [state.version - s.version for s in samples]
            for v in version_lag:
                _STALENESS(v)
            self.ledger.advance()
            state.trained_s = time.time() - self.started
            # the step's bookkeeping waits with its version: committed once it is sent (ledger.py, rule 2)
            self.ledger.stage(indices(s for g in groups for s in g),
                              self.outcomes.records(samples, "trained") + self.collector.failed_outcomes(failed))
            t0 = time.perf_counter()
            # sent while the next step computes: a copy it cannot change (never while colocated engines sleep)
            overlap = self.cfg.overlap_publish and DEVICE_SHARE.engines == 0
            weights = await asyncio.to_thread(self.learner.snapshot if overlap else self.learner.state_dict)
            metrics["time/snapshot_s"] = time.perf_counter() - t0
            metrics["time/wait_s"] = wait_s  # blocked in collect for this batch
            metrics.update(self.collector.figures)  # dynamic sampling's filtered fraction
            if self.task.is_mixture:  # each environment's reward and share of the batch
                metrics.update(env_figures([(s.item.rollout.task, s.item.reward) for s in samples]))
            done = self._publish_and_commit(groups, weights, metrics, version_lag)
            if overlap:
                self._pending = asyncio.create_task(done, name=f"trainer-publish-{state.version}")
            else:
                await done
        if self.cfg.checkpoint_every and state.step % self.cfg.checkpoint_every == 0:
            await self._settle()  # the checkpoint holds this step's state: its commit first
            await self._checkpoint()

    async def _settle(self, quiet: bool = False) -> None:
        """Wait for the previous step's publish and commit; its error is raised (``quiet``: logged)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            await pending
        except Exception:
            if not quiet:
                raise
            log.exception("sending the last version or committing its batch failed")

    async def _publish_and_commit(self, groups: list[list[Sample]], weights: dict[str, Any],
                                  metrics: dict[str, float], version_lag: list[int]) -> None:
        """Save the staged step, send its version (durable before anything is acked), commit its batch,
        report it, and start an evaluation round when one is due."""
        state = self.ledger.state
        await self.ledger.save()  # the staged step first: a restart finds it whether or not the send finished
        with tracing.span("publish weights", version=state.version):  # a child of "train step" (a task copies the context)
            metrics["time/publish_s"] = await self.versions.send(weights)
        fault_point(self.run_dir, state.version)
        t_commit = time.perf_counter()
        await self.collector.commit(groups)  # and the freed room is filled now
        metrics["time/commit_s"] = time.perf_counter() - t_commit  # outcomes, state, acks
        # the names keep "staleness" (of the version lag): the dashboard and the simulator's fit read them
        metrics.update(self.ledger.figures(), **{"trainer/staleness_mean": sum(version_lag) / len(version_lag),
                       "trainer/staleness_max": float(max(version_lag)), "weights/bytes": float(self.versions.bytes),
                       "weights/undelivered": float(self.versions.undelivered)})
        await self.reporter.emit(metrics, step=state.step)
        if self.cfg.eval.every and state.step % self.cfg.eval.every == 0:
            await self.evals.start()

    async def _checkpoint(self) -> None:
        await asyncio.to_thread(self.learner.save_checkpoint, self.run_dir / "checkpoints", self.ledger.state.step,
                                self.ledger.for_checkpoint())

    def _out_of_time(self) -> bool:
        if over := bool(self.cfg.max_wall_s) and time.time() - self.started > self.cfg.max_wall_s:
            log.info("wall-clock budget of %.0fs reached at step %d", self.cfg.max_wall_s, self.ledger.state.step)
        return over

    async def _finish(self) -> None:
        """Final evaluation, final model, checkpoint and summary; the state says ``finished``."""
        await self.evals.start()
        await self.evals.wait_all(self.ctx.stop)
        final = self.run_dir / "final_model"
        await asyncio.to_thread(self.learner.save_pretrained, final)  # LoRA: adapters merged in
        extra = {}
        if self.cfg.lora is not None:  # and the adapters on their own, as a peft directory
            extra["final_adapter"] = str(await asyncio.to_thread(self.learner.save_adapter,
                                                                 self.run_dir / "final_adapter"))
        await self._checkpoint()
        self.ledger.finish(str(final))
        summary = summary_of(self.ledger.state, wall_s=time.time() - self.started, **extra)
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        await self.ledger.save()
        log.info("finished: %d steps, final model in %s", self.ledger.state.step, final)


def build(loaded: Loaded) -> TrainerService:
    return TrainerService(loaded)
