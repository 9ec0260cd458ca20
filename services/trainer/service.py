"""The trainer service, read top to bottom as a recipe::

    start = load the task and learner, continue from the newest durable point   (resume.py)
    send the current weights (version v)
    repeat total_steps times:
        batch   = await collect()                 admission, staleness filter, groups (collect.py)
        metrics = learner.step(batch)             GRPO update in a worker thread (learner.py, loss.py)
        weights = learner.snapshot()              version v + 1, a copy the next step cannot change
        in the background, while the next batch is collected and trained on:
            await sender.send(weights, v + 1)     durable/delivered before anything is acked
            await commit(batch)                   state saved, outcomes recorded, trajectories acked
            metrics, evaluation round             (state.py, evaluation.py)
        checkpoint (the background work settled first)
    final evaluation, final model, summary

Trajectory messages are deferred by the consume handler (``Delivery.defer()``) and acked in
``commit``, so a crash before the version trained on them is sent redelivers them.

Publishing overlaps the next step (``overlap_publish``, on by default): a step's version is sent and
its batch committed while the next batch is collected and the learner computes the next update. The
bookkeeping stays in order: the next step moves the state (step, version) only after the previous
step's publish and commit have finished, so the state saved, the outcomes recorded and the acks are
exactly those of the serial loop. The commit admits new prompt groups into the room it freed at once,
so the rollouts generate beside the learner step as in the serial loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any

import msgspec
from nats.js.errors import KeyDeletedError, KeyNotFoundError

from proto import catalog, codec
from proto.membership import Heartbeat
from proto.prompts import PromptTicket, Sampling
from services.lib.colocation import DEVICE_SHARE
from services.lib.weights.transport import WeightSender, make_sender
from services.runtime import bus, metrics, tracing
from services.runtime.config import Loaded
from services.runtime.service import ServiceContext
from services.tasks.base import TaskMetrics
from services.trainer import devices, resume
from services.trainer.admission import Sample, live_workers
from services.trainer.collect import Collector, Outcomes
from services.trainer.config import TrainerConfig
from services.trainer.evaluation import EvalRound, Evaluations
from services.trainer.learner import Learner
from services.trainer.ranks import RankGroup
from services.trainer.state import TrainerState, load_from_kv, save_to_kv, to_checkpoint

log = logging.getLogger("rlbus.trainer")
_STALENESS = metrics.histogram("trainer_staleness", "versions between a trained sample's oldest token and the step")


class TrainerService:
    """``build(loaded)`` makes it (cheap); ``run(ctx)`` loads the model and trains."""

    def __init__(self, loaded: Loaded) -> None:
        self.loaded = loaded
        self.cfg: TrainerConfig = loaded.service
        # a device or world size this host cannot serve stops start-up here, naming the key
        self.placement = devices.resolve(self.cfg)

    async def run(self, ctx: ServiceContext) -> None:
        run_dir = Path(self.loaded.run.dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        if self.cfg.world_size == 1:
            await self._run(ctx, run_dir, None)
            return
        group = RankGroup.start(self.cfg, run_dir)  # from the event loop's (main) thread: see RankGroup
        try:
            await group.until_failed(self._run(ctx, run_dir, group))
        finally:
            await asyncio.to_thread(group.close)

    async def _run(self, ctx: ServiceContext, run_dir: Path, group: RankGroup | None) -> None:
        start = await asyncio.to_thread(resume.load, self.cfg, run_dir / "checkpoints", self.loaded.run.seed,
                                        self.placement, group)
        runs_kv = await bus.ensure_kv(ctx.js, catalog.RUNS)
        sender = make_sender(self.cfg.transport, ctx.nc, ctx.run_id)
        await sender.start()
        try:
            await resume.continue_from_saved(start, await load_from_kv(runs_kv, ctx.run_id), sender)
            await Trainer(ctx, self.cfg, run_dir, start, sender, runs_kv, self.loaded.run.seed).run()
        finally:
            await sender.close()


class Trainer:
    """One run of the training loop; every part it uses is made here."""

    def __init__(self, ctx: ServiceContext, cfg: TrainerConfig, run_dir: Path, start: resume.Start,
                 sender: WeightSender, runs_kv: Any, seed: int) -> None:
        self.ctx = ctx
        self.cfg = cfg
        self.run_dir = run_dir
        self.task = start.task
        self.learner: Learner = start.learner
        self.state: TrainerState = start.state
        self.version_kept = start.version_kept
        self.sender = sender
        self.runs_kv = runs_kv
        self.weight_bytes = 0
        self.started = time.time()
        self.sampling = Sampling(max_new_tokens=cfg.max_new_tokens or self.task.max_new_tokens,
                                 temperature=cfg.temperature, top_p=cfg.top_p, stop=list(self.task.stop))
        eval_prompts = self.task.eval_prompts()
        self.evals = Evaluations(eval_prompts[: cfg.eval_prompts] if cfg.eval_prompts else eval_prompts,
                                 cfg.eval_samples, self.state.eval_history)
        self.outcomes = Outcomes(ctx, self.state)
        self.members_kv: Any = None
        #: the previous step's publish and commit, running while the next step computes (overlap_publish)
        self._pending: asyncio.Task[None] | None = None
        rollout = ((ctx.cfg.tree.get("services") or {}).get("rollout") or {})
        self.collector = Collector(cfg, self.state, self.task.train_prompts(seed, start=self.state.data_position),
                                   self._train_ticket, self.evals, self.outcomes, self.save_state, self._eval_done,
                                   fleet=self._live_rollouts, tickets_per_worker=int(rollout.get("max_tickets", 64)))

    async def run(self) -> None:
        ctx = self.ctx
        if not self.version_kept:  # the engines' first version (or the checkpoint's under a new number)
            await self._send_weights()
        await self.save_state()
        if isinstance(self.task, TaskMetrics):  # figures about the task's data (its prompts are built by now)
            await self._metrics(self.task.metrics(), step=self.state.step)
        consumer = asyncio.create_task(
            ctx.consume(catalog.TRAJECTORIES, self.collector.handle, concurrency=64),
            name="trainer-consume")
        try:
            await self._start_eval()
            while self.state.step < self.cfg.total_steps and not ctx.stop.is_set() and not self._out_of_time():
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
        samples = [s for g in groups for s in g]
        # a rollout that failed (sandbox died, engine error) says nothing about the policy:
        # it is dropped with its error, never trained on as a zero reward
        failed = [s for s in samples if s.item.rollout.error]
        samples = [s for s in samples if not s.item.rollout.error]
        if not samples:
            await self._settle()
            await self._record_failed(failed)
            await self._commit(groups, failed, [])
            return
        # one span for the step, linked to every trajectory it trains on; the version it sends carries its
        # context to the engines (their "apply weights" spans link back to it)
        with tracing.span("train step", links=tracing.link_to([s.trace for s in samples]),
                          step=self.state.step + 1, samples=len(samples), groups=len(groups)):
            async with DEVICE_SHARE.trainer_turn():  # colocated engines with enable_sleep_mode give memory back
                with tracing.span("learner step"):
                    metrics = await asyncio.to_thread(self.learner.step, [s.item for s in samples])
            # the previous step's version is sent and its batch committed before this step moves the state
            t_settle = time.perf_counter()
            await self._settle()
            metrics["time/settle_s"] = time.perf_counter() - t_settle  # what the overlap did not hide
            await self._record_failed(failed)
            staleness = [self.state.version - s.version for s in samples]
            for v in staleness:
                _STALENESS(v)
            self.state.step += 1
            self.state.version += 1
            t0 = time.perf_counter()
            overlap = self._overlaps()
            weights = await asyncio.to_thread(self.learner.snapshot if overlap else self.learner.state_dict)
            metrics["time/snapshot_s"] = time.perf_counter() - t0
            metrics["time/wait_s"] = wait_s  # blocked in collect for this batch
            done = self._publish_and_commit(groups, failed, samples, weights, metrics, staleness)
            if overlap:
                self._pending = asyncio.create_task(done, name=f"trainer-publish-{self.state.version}")
            else:
                await done
        if self.cfg.checkpoint_every and self.state.step % self.cfg.checkpoint_every == 0:
            await self._settle()  # the checkpoint holds this step's state: its commit first
            await self._checkpoint()

    def _overlaps(self) -> bool:
        """Whether this step's version is sent while the next step computes: on unless configured off, or
        while colocated engines sleep during learner steps (they must apply versions while awake)."""
        return self.cfg.overlap_publish and DEVICE_SHARE.engines == 0

    async def _settle(self, quiet: bool = False) -> None:
        """Wait for the previous step's publish and commit (running beside this step); its error is raised
        here (``quiet``: logged, on the way out after another error)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            await pending
        except Exception:
            if not quiet:
                raise
            log.exception("sending the last version or committing its batch failed")

    async def _record_failed(self, failed: list[Sample]) -> None:
        await asyncio.gather(*(self.outcomes.record([s], "dropped", f"rollout failed: {s.item.rollout.error[:300]}")
                               for s in failed))

    async def _publish_and_commit(self, groups: list[list[Sample]], failed: list[Sample], samples: list[Sample],
                                  weights: dict[str, Any], metrics: dict[str, float], staleness: list[int]) -> None:
        """Send the step's version (durable before anything is acked), commit its batch, report it, and
        start an evaluation round when one is due."""
        with tracing.span("publish weights", version=self.state.version):  # a child of "train step" (a task copies the context)
            publish_s = await self._publish_version(weights)
        t_commit = time.perf_counter()
        await self._commit(groups, failed, samples)
        metrics["time/commit_s"] = time.perf_counter() - t_commit  # outcomes, state, acks
        await self.collector.admit()  # the freed room is filled now, not after the next learner step
        metrics.update({
            "trainer/version": float(self.state.version),
            "trainer/staleness_mean": sum(staleness) / len(staleness),
            "trainer/staleness_max": float(max(staleness)),
            "trainer/trained_total": float(self.state.counters.get("trained", 0)),
            "trainer/dropped_total": float(self.state.counters.get("dropped", 0)),
            "trainer/in_flight_groups": float(len(self.collector.admission.in_flight)),
            "trainer/in_flight_peak": float(self.collector.admission.peak),
            "trainer/admission_bound": float(self.collector.admission.max_in_flight),
            "time/publish_s": publish_s,
            "weights/bytes": float(self.weight_bytes),
        })
        await self._metrics(metrics, step=self.state.step)
        if self.cfg.eval_every and self.state.step % self.cfg.eval_every == 0:
            await self._start_eval()

    async def _commit(self, groups: list[list[Sample]], failed: list[Sample], trained: list[Sample]) -> None:
        """The step is durable (its version sent): record outcomes, save the state, ack the trajectories."""
        self.collector.finish(groups)
        await self.outcomes.record(trained, "trained")
        await self.save_state()
        await asyncio.gather(*(s.ack.ack() for s in failed + trained))

    # --- weights, state, checkpoints ------------------------------------------------------------

    async def _send_weights(self) -> float:
        """Send the learner's current weights as ``state.version`` (the first version, or a resumed one)."""
        return await self._publish_version(await asyncio.to_thread(self.learner.state_dict))

    async def _publish_version(self, state_dict: dict[str, Any]) -> float:
        t0 = time.perf_counter()
        # the version's tensor bytes as sent (before a transport's delta or compression)
        self.weight_bytes = sum(t.numel() * t.element_size() for t in state_dict.values())
        await self.sender.send(state_dict, self.state.version)
        return time.perf_counter() - t0

    async def save_state(self) -> None:
        self.collector.sync_state()
        await save_to_kv(self.runs_kv, self.ctx.run_id, self.state)

    async def _checkpoint(self) -> None:
        self.collector.sync_state()
        await asyncio.to_thread(self.learner.save_checkpoint, self.run_dir / "checkpoints", self.state.step,
                                to_checkpoint(self.state))

    def _out_of_time(self) -> bool:
        if self.cfg.max_wall_s and time.time() - self.started > self.cfg.max_wall_s:
            log.info("wall-clock budget of %.0fs reached at step %d", self.cfg.max_wall_s, self.state.step)
            return True
        return False

    # --- tickets, evaluation, metrics -----------------------------------------------------------

    async def _ticket(self, prompt: Any, group_id: str, group_size: int, is_eval: bool, sampling: Sampling) -> None:
        ticket = PromptTicket(
            run_id=self.ctx.run_id, task=self.cfg.task, group_id=group_id, prompt_id=prompt.id,
            prompt_ids=self.task.format_prompt(self.learner.tokenizer, prompt), prompt_text=prompt.text,
            group_size=group_size, policy_version=self.state.version, sampling=sampling,
            metadata=dict(prompt.metadata), is_eval=is_eval)
        # deterministic msg id: a retried publish (or a resumed trainer) is de-duplicated by JetStream
        ticket.msg_id = f"{self.ctx.run_id}-{group_id}"
        # a trace per prompt group starts here: rollout, sandbox execs, judge and trainer are its spans
        with tracing.span("admit group", root=True, group_id=group_id, eval=is_eval,
                          version=self.state.version, group_size=group_size):
            await self.ctx.publish(catalog.PROMPTS, ticket)

    async def _live_rollouts(self) -> int:
        """Rollout workers whose heartbeats (members bucket) say running, within three heartbeat periods."""
        if self.members_kv is None:  # opened once: the bound is refitted every 2 s
            self.members_kv = await bus.ensure_kv(self.ctx.js, catalog.MEMBERS)
        kv = self.members_kv
        beats = []
        for key in await bus.kv_keys(self.ctx.js, catalog.MEMBERS.bucket, f"{self.ctx.run_id}.rollout."):
            try:
                beats.append(codec.decode((await kv.get(key)).value, Heartbeat))
            except (KeyNotFoundError, KeyDeletedError):  # left (entry deleted), or between listing and read
                continue
        return live_workers(beats, "rollout", time.time(), 3 * self.ctx.cfg.common.heartbeat_s)

    async def _train_ticket(self, prompt: Any, group_id: str) -> None:
        await self._ticket(prompt, group_id, self.cfg.group_size, False, self.sampling)

    async def _start_eval(self) -> None:
        sampling = msgspec.structs.replace(self.sampling, temperature=self.cfg.eval_temperature)
        for group_id, prompt in self.evals.start(self.state.version, self.state.step):
            await self._ticket(prompt, group_id, self.cfg.eval_samples, True, sampling)

    async def _eval_done(self, rnd: EvalRound) -> None:
        await self._metrics({"eval/reward": rnd.mean, "eval/version": float(rnd.version)}, step=rnd.step)

    async def _metrics(self, values: dict[str, float], step: int) -> None:
        rec = {"step": step, "time": time.time(), "elapsed_s": time.time() - self.started, **values}
        with open(self.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")
        await self.ctx.report(values, step=step)

    async def _finish(self) -> None:
        """Final evaluation, final model, checkpoint and summary; the state says ``finished``."""
        await self._start_eval()
        await self.evals.wait_all(self.ctx.stop)
        final = self.run_dir / "final_model"
        await asyncio.to_thread(self.learner.save_pretrained, final)  # LoRA: adapters merged in
        extra = {}
        if self.cfg.lora is not None:  # and the adapters on their own, as a peft directory
            extra["final_adapter"] = str(await asyncio.to_thread(self.learner.save_adapter,
                                                                 self.run_dir / "final_adapter"))
        await self._checkpoint()
        self.state.state, self.state.final_model = "finished", str(final)
        summary = {"step": self.state.step, "version": self.state.version, "eval_history": self.state.eval_history,
                   "counters": self.state.counters, "wall_s": time.time() - self.started, "final_model": str(final),
                   **extra}
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        await self.save_state()
        log.info("finished: %d steps, final model in %s", self.state.step, final)


def build(loaded: Loaded) -> TrainerService:
    return TrainerService(loaded)
