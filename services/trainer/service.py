"""The trainer service: admission, staleness filter, GRPO steps, weight publishing, checkpoints.

Flow per step::

    top up admission ──▶ prompt tickets (PROMPTS)
    trajectories (TRAJECTORIES) ──▶ staleness filter ──▶ group buffer
    groups_per_step complete groups ──▶ learner.step (worker thread)
    ──▶ publish version v+1 (durable) ──▶ ack the trajectories used, record outcomes

A trajectory's handler waits until the step that used it is durable, so the
shared consume loop acks it only then; a crash before that redelivers it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any

import msgspec

from proto import catalog, codec
from proto.accounting import TrajectoryOutcome
from proto.prompts import PromptTicket, Sampling
from proto.trajectories import ScoredTrajectory
from services.runtime import bus
from services.runtime.config import Loaded
from services.runtime.consume import Delivery
from services.runtime.service import ServiceContext
from services.trainer.admission import Admission, GroupBuffer, Sample, is_stale
from services.trainer.config import TrainerConfig

log = logging.getLogger("rlbus.trainer")


class RunState(msgspec.Struct, kw_only=True):
    """Value of KV ``rlbus_runs`` key ``<run>.state``, written after every step.

    With the published weights of ``version`` it is the trainer's durable state:
    a restarted trainer takes model weights from the store and this bookkeeping
    from here, and only the optimiser moments and RNG from its last checkpoint.
    """

    state: str  # "running" | "finished" | "failed"
    step: int = 0
    version: int = 0
    data_position: int = 0
    in_flight: dict[str, int] = {}
    counters: dict[str, int] = {}
    eval_history: list[tuple[int, float]] = []
    final_model: str = ""
    reason: str = ""
    updated_at: float = msgspec.field(default_factory=time.time)


class EvalRound:
    def __init__(self, version: int, step: int, expected: int) -> None:
        self.version = version
        self.step = step
        self.expected = expected
        self.rewards: dict[str, float] = {}


class TrainerService:
    def __init__(self, loaded: Loaded) -> None:
        self.loaded = loaded
        self.cfg: TrainerConfig = loaded.service
        self.run_dir = Path(loaded.run.dir)
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.step = 0
        self.version = 0
        self.data_position = 0
        self.admission = Admission(self.cfg.max_groups_in_flight)
        self.buffer = GroupBuffer()
        self.ready = asyncio.Condition()
        self.evals: dict[int, EvalRound] = {}
        self.eval_history: list[tuple[int, float]] = []
        self.counters = {"trained": 0, "dropped": 0, "eval": 0, "duplicate": 0}
        self.staleness_sum = 0.0
        self.staleness_n = 0
        self.started = time.time()
        self.runs_kv: Any = None  # KV rlbus_runs, set in run() before any trajectory is handled
        # how weights leave (set in run()): a store publisher, or a direct transport's config + sender
        self.publisher: Any = None
        self.direct: Any = None
        self.sender: Any = None

    # --- set-up ---------------------------------------------------------------------------------

    def _load(self) -> None:
        from services.tasks import get_task
        from services.tasks.models import resolve_model
        from services.trainer.learner import Learner

        self.task = get_task(self.cfg.task, **self.cfg.task_options)
        model_dir = resolve_model(self.cfg.model, self.cfg.cache_dir or None, seed=self.loaded.run.seed)
        ckpt = Learner.latest_checkpoint(self.ckpt_dir)
        self.learner = Learner(self.cfg, ckpt or model_dir)
        self.resumed_from = ckpt
        if ckpt is not None:
            state = self.learner.load_optimizer(ckpt)
            self.step = state["step"]
            self.version = state["version"]
            self.data_position = state["data_position"]
            self.admission.restore({k: int(v) for k, v in state["in_flight"].items()})
            self.eval_history = [tuple(x) for x in state.get("eval_history", [])]
            self.counters.update(state.get("counters", {}))
        self.tokenizer = self.learner.tokenizer
        self.train_stream = self.task.train_prompts(self.loaded.run.seed, start=self.data_position)
        evals = self.task.eval_prompts()
        self.eval_set = evals[: self.cfg.eval_prompts] if self.cfg.eval_prompts else evals
        self.sampling = Sampling(max_new_tokens=self.cfg.max_new_tokens or self.task.max_new_tokens,
                                 temperature=self.cfg.temperature, top_p=self.cfg.top_p, stop=list(self.task.stop))

    def _trainer_state(self) -> dict[str, Any]:
        return {"step": self.step, "version": self.version, "data_position": self.data_position,
                "in_flight": self.admission.state(), "eval_history": self.eval_history,
                "counters": self.counters, "run_id": self.loaded.run.id}

    # --- bus I/O ----------------------------------------------------------------------------------

    async def _ticket(self, ctx: ServiceContext, prompt: Any, group_id: str, group_size: int, is_eval: bool,
                      sampling: Sampling) -> None:
        ticket = PromptTicket(
            run_id=ctx.run_id, task=self.cfg.task, group_id=group_id, prompt_id=prompt.id,
            prompt_ids=self.task.format_prompt(self.tokenizer, prompt), prompt_text=prompt.text,
            group_size=group_size, policy_version=self.version, sampling=sampling,
            metadata=dict(prompt.metadata), is_eval=is_eval)
        # deterministic msg id: a retried publish (or a resumed trainer) is de-duplicated by JetStream
        ticket.msg_id = f"{ctx.run_id}-{group_id}"
        await ctx.publish(ctx.subject("prompts"), ticket)

    async def _top_up(self, ctx: ServiceContext) -> None:
        """Admit prompt groups while there is room (the staleness-derived bound)."""
        while self.admission.room() > 0:
            prompt = next(self.train_stream)
            group_id = f"g{self.data_position:08d}"
            self.admission.admit(group_id, self.version)
            self.data_position += 1
            await self._ticket(ctx, prompt, group_id, self.cfg.group_size, False, self.sampling)

    async def _start_eval(self, ctx: ServiceContext) -> None:
        if self.version in self.evals or any(v == self.version for v, _ in self.eval_history):
            return
        self.evals[self.version] = EvalRound(self.version, self.step, len(self.eval_set) * self.cfg.eval_samples)
        sampling = msgspec.structs.replace(self.sampling, temperature=self.cfg.eval_temperature)
        for i, prompt in enumerate(self.eval_set):
            await self._ticket(ctx, prompt, f"eval-v{self.version:06d}-{i:04d}", self.cfg.eval_samples, True, sampling)

    async def _outcome(self, ctx: ServiceContext, s: Sample, outcome: str, reason: str = "") -> None:
        t: ScoredTrajectory = s.item
        self.counters[outcome] = self.counters.get(outcome, 0) + 1
        msg = TrajectoryOutcome(run_id=ctx.run_id, trajectory_id=t.msg_id, group_id=s.group_id, outcome=outcome,
                                reason=reason, step=self.step, version=self.version, sample_version=s.version)
        msg.msg_id = f"{t.msg_id}-outcome"  # one outcome per trajectory, even across trainer restarts
        try:
            await ctx.publish(ctx.subject("outcomes"), msg)
        except Exception as e:
            log.warning("could not record the outcome of %s: %s", t.msg_id, e)

    def _resolve(self, samples: list[Sample]) -> None:
        for s in samples:
            if s.token is not None and not s.token.done():
                s.token.set_result(None)

    async def _drop(self, ctx: ServiceContext, samples: list[Sample], reason: str) -> None:
        await asyncio.gather(*(self._outcome(ctx, s, "dropped", reason) for s in samples))
        # the freed admission slots are durable before the acks: a restarted trainer must not
        # wait for groups whose trajectories were already taken off the stream
        await self._save_state(self.runs_kv)
        self._resolve(samples)

    # --- the trajectory handler -------------------------------------------------------------------

    async def handle(self, ctx: ServiceContext, traj: ScoredTrajectory, d: Delivery[ScoredTrajectory]) -> None:
        r = traj.rollout
        sample = Sample(key=traj.msg_id, group_id=r.group_id, sample_index=r.sample_index,
                        version=r.min_version(), item=traj)
        if r.is_eval:
            rnd = self.evals.get(r.policy_version)
            if rnd is not None:
                rnd.rewards[f"{r.group_id}/{r.sample_index}"] = traj.reward
                if len(rnd.rewards) >= rnd.expected:
                    await self._finish_eval(ctx, rnd)
            await self._outcome(ctx, sample, "eval")
            return
        if r.group_id in self.buffer.dropped_groups:
            await self._drop(ctx, [sample], "group already dropped for staleness")
            return
        if is_stale(sample.version, self.version, self.cfg.max_staleness):
            reason = (f"stale: oldest token from version {sample.version}, trainer at {self.version}, "
                      f"max_staleness {self.cfg.max_staleness}")
            dropped = self.buffer.drop_group(r.group_id)
            self.admission.finish(r.group_id)
            await self._drop(ctx, [sample, *dropped], reason)
            async with self.ready:
                self.ready.notify_all()  # a slot is free: admit more
            return
        sample.token = asyncio.get_running_loop().create_future()
        displaced = self.buffer.add(sample, r.group_size)
        if displaced is not None:  # a redelivery of a sample we already hold
            self.counters["duplicate"] += 1
            self._resolve([displaced])
        async with self.ready:
            self.ready.notify_all()
        await sample.token  # acked by the consume loop once the step using it is durable

    async def _finish_eval(self, ctx: ServiceContext, rnd: EvalRound) -> None:
        self.evals.pop(rnd.version, None)
        reward = sum(rnd.rewards.values()) / max(len(rnd.rewards), 1)
        self.eval_history.append((rnd.version, reward))
        log.info("eval at version %d (step %d): reward %.3f over %d samples", rnd.version, rnd.step, reward,
                 len(rnd.rewards))
        await self._metrics(ctx, {"eval/reward": reward, "eval/version": float(rnd.version)}, step=rnd.step)
        async with self.ready:
            self.ready.notify_all()

    async def _metrics(self, ctx: ServiceContext, values: dict[str, float], step: int) -> None:
        rec = {"step": step, "time": time.time(), "elapsed_s": time.time() - self.started, **values}
        with open(self.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")
        await ctx.report(values, step=step)

    # --- main loop --------------------------------------------------------------------------------

    async def run(self, ctx: ServiceContext) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(self._load)
        self.started = time.time()
        await self._open_weights(ctx)
        runs_kv = self.runs_kv = await bus.ensure_kv(ctx.js, catalog.RUNS)
        await self._resume_from_bus(ctx, runs_kv)
        await self._save_state(runs_kv)
        consumer = asyncio.create_task(
            ctx.consume(catalog.TRAINER_TRAJECTORIES, ScoredTrajectory, lambda t, d: self.handle(ctx, t, d),
                        concurrency=self.cfg.max_groups_in_flight * self.cfg.group_size + 2 * len(self.eval_set) + 64),
            name="trainer-consume")
        try:
            await self._train(ctx, runs_kv)
        finally:
            ctx.stop.set()
            await consumer
            await self._close_sender()

    async def _open_weights(self, ctx: ServiceContext) -> None:
        """The way versions reach engines (``transport``): a store publisher, or a direct sender."""
        from services.lib.weights.config import EncodingConfig, InprocConfig, StoreTransportConfig
        from services.lib.weights.transport import store_publisher

        t = self.cfg.transport or StoreTransportConfig(
            store=self.cfg.store,
            encoding=EncodingConfig(anchor_every=self.cfg.weights.anchor_every, dtype=self.cfg.weights.dtype))
        if isinstance(t, StoreTransportConfig):
            self.publisher = store_publisher(t, ctx.nc, ctx.run_id)
            await self.publisher.ensure()
            return
        if isinstance(t, InprocConfig) and not t.snapshot:
            # the learner changes its tensors in place on the next step: hand the engine a copy
            t = msgspec.structs.replace(t, snapshot=True)
        self.direct = t
        log.info("weights go to engines by %s (no store: a restarted trainer resumes from its checkpoint)",
                 "inproc" if isinstance(t, InprocConfig) else "broadcast")

    async def _close_sender(self) -> None:
        sender, self.sender = self.sender, None
        if sender is not None:
            try:
                await sender.close()
            except Exception as e:
                log.debug("closing the weight sender: %s", e)

    async def _resume_from_bus(self, ctx: ServiceContext, runs_kv: Any) -> None:
        """Continue from the newest durable state: published weights + the KV run state."""
        from services.lib.weights.client import WeightSubscriber

        try:
            entry = await runs_kv.get(f"{ctx.run_id}.state")
            state = codec.decode(entry.value, RunState, max_bytes=None)
        except Exception:
            state = None
        if self.publisher is None:  # a direct transport keeps no weights on the bus: the checkpoint is the state
            if state is not None and state.version >= self.version:
                self.version = state.version + 1  # engines may hold newer numbers from a lost timeline
            await self._publish_version(ctx)
            return
        announced = await self.publisher.index.latest()
        if state is not None and state.state == "running" and state.step > self.step and announced is not None \
                and announced.manifest.version == state.version:
            try:
                sub = WeightSubscriber(ctx.nc, ctx.run_id, self.publisher.store, scope=self.publisher.index.scope)
                weights = await sub.fetch(announced.manifest)
                self.learner.model.load_state_dict(weights, strict=False)
                self.step, self.version, self.data_position = state.step, state.version, state.data_position
                self.admission.restore(state.in_flight)
                self.counters.update(state.counters)
                self.eval_history = [tuple(x) for x in state.eval_history]
                self.train_stream = self.task.train_prompts(self.loaded.run.seed, start=self.data_position)
                log.info("resumed at step %d from published version %d (optimiser from %s)", self.step,
                         self.version, self.resumed_from or "scratch")
                return
            except Exception as e:
                log.warning("could not resume from published version %d (%s); using the checkpoint",
                            state.version, e)
        if announced is not None and announced.manifest.version >= self.version:
            # versions published after the last checkpoint belong to a lost timeline: the
            # checkpoint's weights go out under a newer number so every engine takes them
            self.version = announced.manifest.version + 1
        if self.resumed_from is not None:
            log.info("resumed from %s: step %d, now version %d", self.resumed_from, self.step, self.version)
        await self._publish_version(ctx)

    async def _save_state(self, runs_kv: Any, state: str = "running", final_model: str = "") -> None:
        await runs_kv.put(f"{self.loaded.run.id}.state", codec.encode(RunState(
            state=state, step=self.step, version=self.version, data_position=self.data_position,
            in_flight=self.admission.state(), counters=self.counters, eval_history=self.eval_history,
            final_model=final_model)))

    async def _expire(self, ctx: ServiceContext) -> None:
        """Drop groups that went stale while waiting, and free slots of groups that never came back."""
        cfg = self.cfg
        for gid in self.buffer.stale_groups(self.version, cfg.max_staleness):
            samples = self.buffer.drop_group(gid)
            self.admission.finish(gid)
            await self._drop(ctx, samples, f"stale: waited past max_staleness {cfg.max_staleness} "
                                           f"(trainer at version {self.version})")
        for gid in self.admission.overdue(cfg.group_timeout_s):
            samples = self.buffer.drop_group(gid)
            self.admission.finish(gid)
            log.warning("group %s did not complete within %.0fs; its slot is freed", gid, cfg.group_timeout_s)
            await self._drop(ctx, samples, f"stale: group incomplete after {cfg.group_timeout_s:.0f}s")

    async def _publish_version(self, ctx: ServiceContext) -> None:
        """Store and announce the current weights; retried while the bus is away (the version is the key)."""
        from services.lib.weights.blobs import WeightIntegrityError

        t0 = time.perf_counter()
        if self.publisher is None:
            await self._send_direct(ctx)
            self.last_publish_s = time.perf_counter() - t0
            return
        delay = 0.5
        while True:
            try:
                await self.publisher.publish(self.learner.state_dict(), self.version)
                break
            except (WeightIntegrityError, ValueError):
                raise
            except Exception as e:
                if time.perf_counter() - t0 > 300:
                    raise
                log.warning("publishing version %d failed (%s); retrying in %.1fs", self.version, e, delay)
                await asyncio.sleep(delay)  # the server is restarting
                delay = min(delay * 2, 10.0)
        self.last_publish_s = time.perf_counter() - t0

    async def _send_direct(self, ctx: ServiceContext) -> None:
        """Send the current weights over the direct transport; a failed broadcast re-forms the group
        (engines that died are replaced by their restarts) and sends again, for up to 10 minutes."""
        from services.lib.weights.broadcast import BroadcastError
        from services.lib.weights.transport import make_sender

        t0 = time.perf_counter()
        while True:
            try:
                if self.sender is None:
                    sender = make_sender(self.direct, ctx.nc, ctx.run_id)
                    await sender.start()  # a broadcast waits (bounded) for every engine to join
                    self.sender = sender
                await self.sender.send(self.learner.state_dict(), self.version)
                return
            except BroadcastError as e:
                await self._close_sender()
                if time.perf_counter() - t0 > 600 or ctx.stop.is_set():
                    raise
                log.warning("sending version %d failed (%s); re-forming the broadcast group", self.version, e)
                await asyncio.sleep(1.0)

    async def _train(self, ctx: ServiceContext, runs_kv: Any) -> None:
        cfg = self.cfg
        await self._start_eval(ctx)
        while self.step < cfg.total_steps and not ctx.stop.is_set():
            if cfg.max_wall_s and time.time() - self.started > cfg.max_wall_s:
                log.info("wall-clock budget of %.0fs reached at step %d", cfg.max_wall_s, self.step)
                break
            # top up admission, drop what went stale or never came back, until a batch is complete
            while not ctx.stop.is_set():
                await self._top_up(ctx)
                await self._expire(ctx)
                if len(self.buffer.complete_groups()) >= cfg.groups_per_step:
                    break
                async with self.ready:
                    try:
                        await asyncio.wait_for(self.ready.wait_for(
                            lambda: len(self.buffer.complete_groups()) >= cfg.groups_per_step
                            or self.admission.room() > 0 or ctx.stop.is_set()), timeout=5.0)
                    except TimeoutError:
                        pass  # re-check staleness and group timeouts
            if ctx.stop.is_set():
                break
            groups = self.buffer.take(cfg.groups_per_step)
            samples = [s for g in groups for s in g]
            # a rollout that failed (sandbox died, engine error) says nothing about the policy:
            # it is accounted as dropped with its error, never trained on as a zero reward
            failed = [s for s in samples if s.item.rollout.error]
            if failed:
                samples = [s for s in samples if not s.item.rollout.error]
                await asyncio.gather(*(self._outcome(ctx, s, "dropped", f"rollout failed: {s.item.rollout.error[:300]}")
                                       for s in failed))
                self._resolve(failed)
            if not samples:
                for g in groups:
                    self.admission.finish(g[0].group_id)
                await self._save_state(runs_kv)
                continue
            staleness = [self.version - s.version for s in samples]
            metrics = await asyncio.to_thread(self.learner.step, [s.item for s in samples])
            self.step += 1
            self.version += 1
            await self._publish_version(ctx)  # durable before anything is acked
            await self._save_state(runs_kv)
            # one JetStream round trip for the whole batch instead of one per trajectory
            await asyncio.gather(*(self._outcome(ctx, s, "trained") for s in samples))
            for g in groups:
                self.admission.finish(g[0].group_id)
            self._resolve(samples)
            if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0:
                await asyncio.to_thread(self.learner.save_checkpoint, self.ckpt_dir, self.step, self._trainer_state())
            metrics.update({
                "trainer/version": float(self.version),
                "trainer/staleness_mean": sum(staleness) / len(staleness),
                "trainer/staleness_max": float(max(staleness)),
                "trainer/trained_total": float(self.counters["trained"]),
                "trainer/dropped_total": float(self.counters["dropped"]),
                "trainer/in_flight_groups": float(len(self.admission.in_flight)),
                "trainer/in_flight_peak": float(self.admission.peak),
                "time/publish_s": self.last_publish_s,
            })
            await self._metrics(ctx, metrics, step=self.step)
            if cfg.eval_every and self.step % cfg.eval_every == 0:
                await self._start_eval(ctx)
        await self._finish(ctx, runs_kv)

    async def _finish(self, ctx: ServiceContext, runs_kv: Any) -> None:
        if ctx.stop.is_set():
            return  # stopped from outside: the checkpoint is where a restart resumes
        await self._start_eval(ctx)
        async with self.ready:  # wait for the final evaluation to come back
            await self.ready.wait_for(lambda: not self.evals or ctx.stop.is_set())
        final = self.run_dir / "final_model"
        from services.lib.model_io import save_policy

        await asyncio.to_thread(save_policy, self.learner.model, self.tokenizer, final)
        await asyncio.to_thread(self.learner.save_checkpoint, self.ckpt_dir, self.step, self._trainer_state())
        summary = {"step": self.step, "version": self.version, "eval_history": self.eval_history,
                   "counters": self.counters, "wall_s": time.time() - self.started, "final_model": str(final)}
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        await self._save_state(runs_kv, "finished", str(final))
        log.info("finished: %d steps, final model in %s", self.step, final)


def build(loaded: Loaded) -> TrainerService:
    return TrainerService(loaded)
