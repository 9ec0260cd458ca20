"""A trainer learner of ``world_size`` real ranks, driven without the bus (run as a script by the tests).

    python -m tests.distributed.rank_script SPEC.json

SPEC: ``{"model_dir", "config": {TrainerConfig keys}, "dtype": [model] dtype, "steps": [batch seed, ...], "out": dir,
"resume_from" or "model_dir_only": checkpoint dir, "load_weights": a weights.pt, "checkpoint": bool}``. Rank 0 is this process; the other
ranks are started by :class:`services.trainer.ranks.RankGroup` exactly as the trainer service
starts them. Writes ``out/weights.pt`` (the full weights after the steps), ``out/metrics.json`` and,
with ``checkpoint``, a checkpoint under ``out/checkpoints``.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
from pathlib import Path

import msgspec
import torch

from proto.rollouts import Rollout, Turn
from proto.trajectories import ScoredTrajectory
from services.trainer import devices
from services.trainer.config import TrainerConfig
from services.trainer.learner import Learner
from services.trainer.ranks import RankGroup


def batch(seed: int, groups: int = 3, group_size: int = 4, vocab: int = 16) -> list[ScoredTrajectory]:
    """Made-up scored trajectories of uneven lengths (the same for every caller of one seed)."""
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = [1] + [rng.randrange(3, vocab) for _ in range(rng.randrange(2, 9))]
        for i in range(group_size):
            n = rng.randrange(1, 12)
            turn = Turn(role="assistant", token_ids=[rng.randrange(3, vocab) for _ in range(n)],
                        logprobs=[-rng.uniform(0.5, 4.0) for _ in range(n)], versions=[0] * n, text="x")
            rollout = Rollout(run_id="r", task="t", group_id=f"g{seed}-{g}", prompt_id=f"p{g}", sample_index=i,
                              group_size=group_size, prompt_ids=prompt, turns=[turn], finish_reason="eos",
                              policy_version=0)
            out.append(ScoredTrajectory(run_id="r", rollout=rollout, reward=rng.random()))
    return out


async def run(spec: dict) -> None:
    cfg = msgspec.convert(spec["config"], TrainerConfig)
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    dtype = spec.get("dtype", "float32")  # the run's [model] dtype
    group = RankGroup.start(cfg, out) if cfg.devices.world_size > 1 else None
    try:
        # resume_from: model and optimiser from a checkpoint; model_dir_only: a checkpoint's weights only
        model_dir = Path(spec.get("resume_from") or spec.get("model_dir_only") or spec["model_dir"])
        if group is not None:
            group.init(model_dir, dtype=dtype)
        learner = Learner(cfg, model_dir, devices.resolve(cfg, dtype=dtype), init_method=group.init_method if group else "",
                          group=group)
        if spec.get("resume_from"):
            learner.load_optimizer(model_dir)
        if spec.get("load_weights"):  # full weights on rank 0, as a kept version comes back on resume
            learner.load_weights(torch.load(spec["load_weights"]))
        metrics = [learner.step(batch(seed)) for seed in spec["steps"]]
        torch.save(learner.state_dict(), out / "weights.pt")
        if spec.get("checkpoint"):
            learner.save_checkpoint(out / "checkpoints", len(spec["steps"]), {"step": len(spec["steps"])})
        (out / "metrics.json").write_text(json.dumps(metrics))
    finally:
        if group is not None:
            group.close()


if __name__ == "__main__":
    asyncio.run(run(json.loads(Path(sys.argv[1]).read_text())))
