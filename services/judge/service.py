"""The judge service: finished rollouts in, scored trajectories out (a queue group).

Each task's graders (``[services.judge.graders.<task>]``, see ``config.py``; default: the task's reward
function) score a rollout concurrently; the reward is their weighted mean and every grader's score and
explanation travel with the trajectory, so ``rlbus tap trajectories`` shows why a rollout got its reward.
A rollout that failed upstream is scored 0 with the error recorded (it still reaches the trainer's accounting).

**Sandbox ownership.** An agent rollout arrives with its sandbox handed over (paused, lease extended): the
judge forks it for hidden tests and, once the trajectory is published, destroys it. Publishing first means a
judge that dies mid-way leaves the sandbox for the redelivered rollout; the lease reclaims it otherwise.
"""

from __future__ import annotations

import logging
from typing import Any

from proto import catalog
from proto.rollouts import Rollout
from proto.trajectories import GraderScore, ScoredTrajectory
from services.judge.config import JudgeConfig
from services.lib.sandbox_client import SandboxClient, SandboxClientError
from services.runtime.config import Loaded
from services.runtime.consume import Delivery, Poison
from services.runtime.service import ServiceContext
from services.tasks import UnknownTaskError, get_task
from services.tasks.graders import GraderFactory, grade_all
from services.tasks.judge_backends import JudgeCache

log = logging.getLogger("rlbus.judge")


class JudgeService:
    def __init__(self, loaded: Loaded) -> None:

        self.cfg: JudgeConfig = loaded.service
        self.seed = loaded.run.seed
        self.tasks: dict[str, Any] = {}
        self.graders: dict[str, list[Any]] = {}
        self.cache = JudgeCache(self.cfg.judge_cache_entries)
        self.factory = GraderFactory(None, self.cache, seed=self.seed)
        self.sandboxes: Any = None

    def attach(self, sandboxes: Any) -> None:
        """Use ``sandboxes`` (a SandboxClient) for sandbox graders and for destroying handed-over sandboxes."""
        self.sandboxes = sandboxes
        self.factory.sandboxes = sandboxes

    def task(self, name: str) -> Any:

        if name not in self.tasks:
            try:
                self.tasks[name] = get_task(name, **self.cfg.task_options.get(name, {}))
            except UnknownTaskError as e:
                raise Poison(str(e)) from e
        return self.tasks[name]

    def graders_for(self, task: str) -> list[Any]:
        if task not in self.graders:
            self.graders[task] = self.factory.build(task, self.cfg.graders.get(task, []))
        return self.graders[task]

    async def score(self, rollout: Rollout) -> tuple[float, list[GraderScore]]:

        if rollout.error is not None:
            return 0.0, [GraderScore(grader="rollout", score=0.0, error=rollout.error,
                                     explanation=f"the rollout failed before finishing ({rollout.finish_reason})")]
        task = self.task(rollout.task)
        return await grade_all(self.graders_for(rollout.task), rollout, task)

    async def handle(self, ctx: ServiceContext, rollout: Rollout, d: Delivery[Rollout]) -> None:
        reward, scores = await self.score(rollout)
        traj = ScoredTrajectory(run_id=ctx.run_id, rollout=rollout, reward=reward, scores=scores, judge=ctx.instance,
                                msg_id=f"{rollout.msg_id}-scored")
        await ctx.publish(catalog.TRAJECTORIES, traj)
        if rollout.sandbox_id is not None and self.cfg.destroy_sandboxes and self.sandboxes is not None:
            await self._destroy(rollout.sandbox_id)
        ctx.gauges["judge/llm_cache_hits"] = float(self.cache.hits)
        ctx.gauges["judge/llm_cache_misses"] = float(self.cache.misses)

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


def build(loaded: Loaded) -> JudgeService:
    return JudgeService(loaded)
