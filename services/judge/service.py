"""The judge service: finished rollouts in, scored trajectories out (a queue group), a prompt group per message.

Each task's graders (``[services.judge.graders.<task>]``, see ``config.py``; default: the task's reward
function) score a rollout concurrently; the reward is their weighted mean and every grader's score and
explanation travel with the trajectory, so ``rlbus tap trajectories`` shows why a rollout got its reward.
A rollout that failed upstream is scored 0 with the error recorded (it still reaches the trainer's accounting).

**Turn rewards** (environments, ``services/tasks/env.py``): the reward of a rollout whose turns carry
rewards (``Turn.reward``) is ``sum(turn rewards) + the graders' weighted mean`` (no discounting); their sum
is listed as the grader ``turn_rewards`` with weight 0 (it is not part of the mean). A rollout that failed,
upstream or in grading, is scored 0 whatever its turn rewards.

**User code cannot stall the judge.** Reward functions run in worker processes with a per-call timeout
(``[services.judge.user_code]``, ``user_code.py``): the event loop, and so the heartbeats, never wait on them.
When the task's code raises, hangs (its worker is killed; the group's calls still to come fail at once, and
the pool grows so other groups do not wait behind the hang), dies, or returns NaN/inf or a value outside [0, 1],
the trajectory is published with ``rollout.error = "grading failed: <grader>: <reason>"`` so the trainer
records it as dropped with that reason, and the failure is counted (``judge/failed/<kind>``). A rollout that
came back more than ``poison_after_deliveries`` times without being settled (it killed or hung a judge each
time) is published the same way and dead-lettered, instead of crash-looping the fleet. So is a rollout whose
task this judge cannot build (unknown, or its ``[task.options]`` refused: a bad path, a bad option, a plugin that
raises): the reason is remembered per task, so the next rollouts of that task fail at once with it.

**Sandbox ownership.** An agent rollout arrives with its sandbox handed over (paused, lease extended): the
judge forks it for hidden tests and, once the trajectory is published, destroys it. Publishing first means a
judge that dies mid-way leaves the sandbox for the redelivered rollout; the lease reclaims it otherwise.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

import msgspec

from proto import catalog
from proto.rollouts import Rollout, RolloutGroup
from proto.trajectories import GraderScore, ScoredGroup, scored
from services.judge.config import JudgeConfig
from services.judge.teacher_client import TeacherUnavailable, teacher_logprobs
from services.judge.user_code import ProcessUserCode
from services.lib.sandbox_client import SandboxClient, SandboxClientError
from services.runtime.config import Loaded
from services.runtime.consume import Delivery, Poison
from services.runtime.service import ServiceContext
from services.tasks import get_task
from services.tasks.graders import GraderFactory, Grading, grade_all
from services.tasks.judge_backends import JudgeCache

log = logging.getLogger("rlbus.judge")


class TaskUnavailable(Exception):
    """This judge cannot build the rollout's task (the message says which and why); never retried."""


def with_turn_rewards(grading: Grading, rollout: Rollout) -> Grading:
    """``grading`` with the rollout's turn rewards added to its reward (a failed grading stays as it is)."""
    rewards = [t.reward for t in rollout.all_turns() if t.reward is not None]
    if not rewards or grading.failure is not None:
        return grading
    total = math.fsum(rewards)
    why = f"sum of {len(rewards)} turn rewards, added to the graders' score {grading.reward:g}"
    return Grading(grading.reward + total, [*grading.scores, GraderScore(
        grader="turn_rewards", score=total, weight=0.0, explanation=why)])


class JudgeService:
    def __init__(self, loaded: Loaded) -> None:

        self.cfg: JudgeConfig = loaded.service
        self.seed = loaded.run.seed
        #: on-policy distillation: the teacher's logprobs of every training sample go with its score
        self.distill = loaded.distill
        self.run_task = loaded.task
        self.tasks: dict[str, Any] = {}
        #: tasks this judge failed to build: name -> why (run-file options do not change while it runs)
        self.task_errors: dict[str, str] = {}
        self.graders: dict[str, list[Any]] = {}
        self.cache = JudgeCache(self.cfg.judge_cache_entries)
        self.user_code = ProcessUserCode(self.cfg.user_code, {e.name: dict(e.options) for e in loaded.task.entries()})
        self.factory = GraderFactory(None, self.cache, seed=self.seed, user_code=self.user_code)
        self.sandboxes: Any = None
        #: samples scored failed, by why (timeout, exception, crash, bad_value, out_of_range, poison, task)
        self.failed: dict[str, int] = {}

    def attach(self, sandboxes: Any) -> None:
        """Use ``sandboxes`` (a SandboxClient) for sandbox graders and for destroying handed-over sandboxes."""
        self.sandboxes = sandboxes
        self.factory.sandboxes = sandboxes

    def task(self, name: str) -> Any:
        """The task ``name`` built with this judge's options (once); :class:`TaskUnavailable` if it cannot be."""
        if name in self.task_errors:
            raise TaskUnavailable(self.task_errors[name])
        if name not in self.tasks:
            try:
                self.tasks[name] = get_task(name, **self.run_task.options_for(name))
            except Exception as e:  # unknown task, refused options, or a plugin's own error: none heal on retry
                self.task_errors[name] = (f"task {name!r} cannot be built from [task.options]:"
                                          f" {type(e).__name__}: {e}")
                log.error("%s", self.task_errors[name])
                raise TaskUnavailable(self.task_errors[name]) from e
        return self.tasks[name]

    def graders_for(self, task: str) -> list[Any]:
        if task not in self.graders:
            self.graders[task] = self.factory.build(task, self.cfg.graders.get(task, []))
        return self.graders[task]

    async def score(self, rollout: Rollout) -> Grading:

        if rollout.error is not None:
            return Grading(0.0, [GraderScore(grader="rollout", score=0.0, error=rollout.error,
                                             explanation=f"the rollout failed before finishing ({rollout.finish_reason})")])
        task = self.task(rollout.task)
        return with_turn_rewards(await grade_all(self.graders_for(rollout.task), rollout, task), rollout)

    async def handle(self, ctx: ServiceContext, msg: RolloutGroup, d: Delivery[Any]) -> None:
        """Score a group's rollouts concurrently and publish them as one scored group (one message in, one out)."""
        rollouts = msg.records()  # each with the ticket's fields, as graders read them
        if d.num_delivered > self.cfg.poison_after_deliveries:
            reason = (f"delivered {d.num_delivered} times without being settled (it killed or hung a judge each "
                      f"time; poison_after_deliveries = {self.cfg.poison_after_deliveries})")
            await self._publish(ctx, msg, [(Grading(0.0, [], reason, None), "poison") for _ in rollouts])
            raise Poison(f"rollouts {msg.msg_id} {reason}; published as failed")
        gradings = await asyncio.gather(*(self.score(r) for r in rollouts), return_exceptions=True)
        unavailable = next((g for g in gradings if isinstance(g, TaskUnavailable)), None)
        if unavailable is not None:  # the trainer drops the samples with the reason; the message is dead-lettered
            await self._publish(ctx, msg, [(Grading(0.0, [], str(unavailable), None), "task") for _ in rollouts])
            raise Poison(f"rollouts {msg.msg_id}: {unavailable}; published as failed") from unavailable
        for g in gradings:
            if isinstance(g, BaseException):  # not the task's verdict (e.g. a sandbox request failed): retried
                raise g
        teacher, teacher_failure = await self._teacher(ctx, msg, rollouts, gradings)
        await self._publish(ctx, msg, [(g, g.failure_kind) for g in gradings], teacher, teacher_failure)
        if self.cfg.destroy_sandboxes and self.sandboxes is not None:
            await asyncio.gather(*(self._destroy(r.sandbox_id) for r in rollouts if r.sandbox_id is not None))
        ctx.gauges["judge/llm_cache_hits"] = float(self.cache.hits)
        ctx.gauges["judge/llm_cache_misses"] = float(self.cache.misses)

    async def _teacher(self, ctx: ServiceContext, msg: RolloutGroup, rollouts: list[Any],
                       gradings: list[Any]) -> tuple[list[list[float] | None], str | None]:
        """Distillation: the teacher's logprobs of each training sample that did not fail (None for the others),
        or why the teacher gave none within ``distill.wait_s`` (every such sample then fails with it)."""
        teacher: list[list[float] | None] = [None] * len(rollouts)
        if not self.distill.enabled or msg.ticket.is_eval:
            return teacher, None
        asked = [i for i, (r, g) in enumerate(zip(rollouts, gradings, strict=True))
                 if r.error is None and g.failure is None]
        try:
            got = await teacher_logprobs(ctx.nc, ctx.run_id, [rollouts[i] for i in asked], self.distill, ctx.stop)
        except TeacherUnavailable as e:
            return teacher, f"teacher logprobs unavailable: {e}"
        for i, logprobs in zip(asked, got, strict=True):
            teacher[i] = logprobs
        return teacher, None

    async def _publish(self, ctx: ServiceContext, msg: RolloutGroup, graded: list[tuple[Grading, str | None]],
                       teacher: list[list[float] | None] | None = None, teacher_failure: str | None = None) -> None:
        """The scored group, the rollout group's ticket passed on once (``graded``: one grading per sample, in
        order; ``teacher``: the teacher's logprobs of each, distillation); a sample that could not be scored, or
        whose teacher logprobs are missing (``teacher_failure``), carries the reason as its error (the trainer
        records it as dropped with it) and is counted in ``judge/failed/<kind>``."""
        trajs = []
        teacher = teacher or [None] * len(graded)
        for sample, (grading, failure_kind), logprobs in zip(msg.rollouts, graded, teacher, strict=True):
            if grading.failure is not None:
                sample = msgspec.structs.replace(sample, error=f"grading failed: {grading.failure}")
                kind = failure_kind or "other"
                self.failed[kind] = self.failed.get(kind, 0) + 1
                log.warning("rollout %s scored failed: %s", sample.id, grading.failure)
            elif teacher_failure is not None and sample.error is None:
                sample = msgspec.structs.replace(sample, error=teacher_failure)
                self.failed["teacher"] = self.failed.get("teacher", 0) + 1
                log.warning("rollout %s: %s", sample.id, teacher_failure)
            trajs.append(scored(sample, grading.reward, grading.scores, ctx.instance, logprobs))
        await ctx.publish_parts(catalog.TRAJECTORIES, trajs, lambda part: ScoredGroup(
            run_id=ctx.run_id, ticket=msg.ticket, trajectories=part,
            msg_id=f"{msg.msg_id}-{part[0].sample_index}-scored"))
        if teacher_failure is not None or any(g.failure is not None for g, _ in graded):
            await ctx.report({"judge/failed_total": float(sum(self.failed.values())),
                              **{f"judge/failed/{k}": float(v) for k, v in self.failed.items()},
                              "judge/user_code_restarts": float(self.user_code.restarts),
                              "judge/user_code_workers": float(len(self.user_code.workers)),
                              "judge/user_code_group_failed": float(self.user_code.group_failed)})

    async def _destroy(self, sandbox_id: str) -> None:

        try:
            await self.sandboxes.destroy(sandbox_id)
        except SandboxClientError as e:  # already gone (failed rollout, expired lease, redelivery)
            log.debug("sandbox %s not destroyed: %s", sandbox_id, e)

    async def run(self, ctx: ServiceContext) -> None:

        self.attach(SandboxClient(ctx.nc, ctx.run_id, timeout_s=self.cfg.sandbox_timeout_s))
        try:
            await ctx.consume(catalog.ROLLOUTS, lambda r, d: self.handle(ctx, r, d),
                              concurrency=self.cfg.concurrency)
        finally:
            await self.factory.close()
            await self.user_code.close()


def build(loaded: Loaded) -> JudgeService:
    return JudgeService(loaded)
