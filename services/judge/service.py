"""The judge service: finished rollouts in, scored trajectories out (a queue group).

The reward comes from the task's reward function(s); every grader's score and
explanation travel with the trajectory, so ``rlbus tap trajectories`` shows why a
rollout got its reward. A rollout that failed upstream is scored 0 with the error
recorded (it still reaches the trainer's accounting).
"""

from __future__ import annotations

import logging
from typing import Any

from proto import catalog
from proto.rollouts import Rollout
from proto.trajectories import GraderScore, ScoredTrajectory
from services.judge.config import JudgeConfig
from services.runtime.config import Loaded
from services.runtime.consume import Delivery, Poison
from services.runtime.service import ServiceContext

log = logging.getLogger("rlbus.judge")


class JudgeService:
    def __init__(self, loaded: Loaded) -> None:
        self.cfg: JudgeConfig = loaded.service
        self.tasks: dict[str, Any] = {}

    def task(self, name: str) -> Any:
        from services.tasks import UnknownTaskError, get_task

        if name not in self.tasks:
            try:
                self.tasks[name] = get_task(name, **self.cfg.task_options.get(name, {}))
            except UnknownTaskError as e:
                raise Poison(str(e)) from e
        return self.tasks[name]

    def score(self, rollout: Rollout) -> tuple[float, list[GraderScore]]:
        from services.tasks.base import Prompt

        if rollout.error is not None:
            return 0.0, [GraderScore(grader="rollout", score=0.0, error=rollout.error,
                                     explanation="the rollout failed before finishing")]
        task = self.task(rollout.task)
        prompt = Prompt(id=rollout.prompt_id, metadata=dict(rollout.metadata))
        r = task.reward(prompt, rollout.text())
        return float(r.value), [GraderScore(grader=f"{rollout.task}.reward", score=float(r.value),
                                            explanation=r.explanation)]

    async def handle(self, ctx: ServiceContext, rollout: Rollout, d: Delivery[Rollout]) -> None:
        reward, scores = self.score(rollout)
        traj = ScoredTrajectory(run_id=ctx.run_id, rollout=rollout, reward=reward, scores=scores, judge=ctx.instance,
                                msg_id=f"{rollout.msg_id}-scored")
        await ctx.publish(ctx.subject("trajectories"), traj)

    async def run(self, ctx: ServiceContext) -> None:
        await ctx.consume(catalog.JUDGE_ROLLOUTS, Rollout, lambda r, d: self.handle(ctx, r, d),
                          concurrency=self.cfg.concurrency)


def build(loaded: Loaded) -> JudgeService:
    return JudgeService(loaded)
