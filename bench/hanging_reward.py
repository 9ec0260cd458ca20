"""What a reward that hangs on 1 % of prompts costs a run's step rate, at the default settings.

A run's pipeline, emulated around the judge's real parts: the trainer keeps ``(max_staleness + 1) x
groups_per_step`` groups in flight (32 by default); each slot generates a group (sleeps ``--gen-s``, the
rollout's time for one group: latency-bound, the pessimistic case for a slot a hung group holds), then the
judge scores its ``group_size`` (8) samples concurrently, as its handler does, with the real runner
(:class:`services.judge.user_code.ProcessUserCode`, default ``[services.judge.user_code]``, real worker
processes) and graders (``grade_all`` over the task's reward), and the slot takes the next group. A group
whose samples all scored counts toward a step (a failed sample is dropped by the trainer); the step rate
is trained groups / ``groups_per_step`` per second.

The reward is ``rare-hang-addition`` (``tests/judge/flaky_task.py``): it hangs on one prompt in 100,
spinning on a CPU (``--hang spin``) or blocked (``--hang sleep``). Modes, each run for ``--duration`` s:

* ``none``: it never hangs (the reference rate);
* ``hang``: 1 % of prompts hang, with the runner as it is (the pool grows on demand; a group's first
  timeout fails its other samples at once);
* ``hang_before``: the same with the runner as it was (no growth: ``max_workers = workers``; every sample
  of a hung group waits out its own timeout, in series on the workers).

Figures: ``steps_per_s_<mode>``, ``ratio_hang_vs_none`` (the goal: >= 0.9), ``ratio_hang_before_vs_none``,
groups that hung, workers the pool grew, calls failed at once. Whatever the judge does, a hung group
holds its in-flight slot until ``timeout_s`` (then it is failed, and the trainer drops it), so the best
ratio is about ``0.99 / (1 + timeout_s / (100 x gen_s))``: 0.885 at the default ``--gen-s 0.84`` (a
2.4 steps/s run), 0.943 at 2 s. Measured on 2 cores (a loaded machine), 60 s per mode: at 0.84 s,
before 0.067, after 0.873 (spin) / 0.863 (sleep); at 2 s, after 0.947 (spin).

Usage: ``python bench/hanging_reward.py [--duration 60] [--gen-s 0.84] [--hang spin|sleep]
[--modes none,hang,hang_before]``; the last stdout line is a JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from proto.rollouts import Rollout, Turn  # noqa: E402
from services.judge.config import UserCodeConfig  # noqa: E402
from services.judge.user_code import ProcessUserCode  # noqa: E402
from services.tasks import get_task  # noqa: E402
from services.tasks.grader_specs import RewardGraderSpec  # noqa: E402
from services.tasks.graders import GraderFactory, grade_all  # noqa: E402
from services.tasks.judge_backends import JudgeCache  # noqa: E402
from services.trainer.config import TrainerConfig  # noqa: E402
from tests.judge import flaky_task  # noqa: E402,F401  (registers rare-hang-addition)

TASK = "rare-hang-addition"


class _Unscoped:
    """The runner without the group probe (calls carry no scope): the runner as it was."""

    def __init__(self, pool: ProcessUserCode) -> None:
        self.pool = pool

    async def call(self, task_name: str, task: Any, method: str, *args: Any, scope: str | None = None) -> Any:
        return await self.pool.call(task_name, task, method, *args)


def _group(k: int, size: int) -> list[Rollout]:
    return [Rollout(run_id="bench", task=TASK, group_id=f"g{k}", prompt_id=f"bench/train/0/{k}", sample_index=j,
                    group_size=size, prompt_ids=[1, 2],
                    turns=[Turn(role="assistant", token_ids=[3], logprobs=[-0.1], versions=[0], text="47")],
                    finish_reason="eos", policy_version=0, metadata={"answer": "47"}, prompt_text="12+35=")
            for j in range(size)]


async def _mode(mode: str, args: argparse.Namespace, trainer: TrainerConfig) -> dict[str, float]:
    options = {"hang_every": 0 if mode == "none" else 100, "hang": args.hang}
    cfg = UserCodeConfig() if mode != "hang_before" else UserCodeConfig(max_workers=UserCodeConfig().workers)
    pool = ProcessUserCode(cfg, {TASK: options})
    runner: Any = pool if mode != "hang_before" else _Unscoped(pool)
    task = get_task(TASK, **options)
    graders = GraderFactory(None, JudgeCache(), user_code=runner).build(TASK, [RewardGraderSpec()])
    await asyncio.gather(*(pool.call(TASK, task, "reward", *_probe(task)) for _ in range(cfg.workers)))
    counter = itertools.count()
    trained = failed = hung = 0
    t0 = time.monotonic()
    end = t0 + args.duration

    async def slot() -> None:
        nonlocal trained, failed, hung
        while time.monotonic() < end:
            k = next(counter)
            hung += options["hang_every"] > 0 and k % 100 == 50
            await asyncio.sleep(args.gen_s)
            gradings = await asyncio.gather(*(grade_all(graders, r, task) for r in _group(k, trainer.group_size)))
            if time.monotonic() > end:
                break
            if all(g.failure is None for g in gradings):
                trained += 1
            else:
                failed += 1

    slots = [asyncio.create_task(slot()) for _ in range(trainer.max_groups_in_flight)]
    await asyncio.sleep(args.duration)
    for s in slots:
        s.cancel()
    await asyncio.gather(*slots, return_exceptions=True)
    elapsed = time.monotonic() - t0
    await pool.close()
    return {"steps_per_s": round(trained / trainer.groups_per_step / elapsed, 3), "groups_trained": trained,
            "groups_failed": failed, "groups_hung": hung, "workers_started": cfg.workers + pool.grown,
            "grown": pool.grown, "failed_at_once": pool.group_failed, "loadavg_1m": round(os.getloadavg()[0], 2)}


def _probe(task: Any) -> tuple[Any, str]:
    from services.tasks.graders import prompt_of

    return prompt_of(_group(0, 1)[0]), "47"


async def main() -> dict[str, Any]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--gen-s", type=float, default=0.84, help="seconds to generate one group (0.84: 2.4 steps/s)")
    ap.add_argument("--hang", choices=("spin", "sleep"), default="spin")
    ap.add_argument("--modes", default="none,hang,hang_before")
    args = ap.parse_args()
    trainer = TrainerConfig()
    out: dict[str, Any] = {"duration_s": args.duration, "gen_s": args.gen_s, "hang": args.hang,
                           "groups_in_flight": trainer.max_groups_in_flight, "group_size": trainer.group_size,
                           "groups_per_step": trainer.groups_per_step, "timeout_s": UserCodeConfig().timeout_s,
                           "workers": UserCodeConfig().workers, "max_workers": UserCodeConfig().max_workers,
                           "cpus": os.cpu_count()}
    for mode in args.modes.split(","):
        for k, v in (await _mode(mode, args, trainer)).items():
            out[f"{k}_{mode}"] = v
        print(f"{mode}: {out[f'steps_per_s_{mode}']} steps/s", file=sys.stderr, flush=True)
    for mode in ("hang", "hang_before"):
        if f"steps_per_s_{mode}" in out and out.get("steps_per_s_none"):
            out[f"ratio_{mode}_vs_none"] = round(out[f"steps_per_s_{mode}"] / out["steps_per_s_none"], 3)
    return out


if __name__ == "__main__":
    result = asyncio.run(main())
    for k, v in result.items():
        print(f"{k:>30}: {v}")
    print(json.dumps(result))
