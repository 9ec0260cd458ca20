"""A LoRA learner of ``world_size`` real ranks, driven without the bus (run as a script by the tests).

    python -m tests.trainer.lora_rank_script SPEC.json

SPEC: ``{"model_dir", "config": {TrainerConfig keys, lora included}, "steps": [batch seed, ...], "out": dir,
"resume_from": a checkpoint dir (adapters and moments onto the base ``model_dir``), "load_weights": an adapter
version (.pt) for rank 0, "checkpoint": bool, "final": bool}``. Rank 0 is this process; the other ranks are
started by :class:`services.trainer.ranks.RankGroup` as the trainer service starts them. Writes
``out/weights.pt`` (the adapter version after the steps), ``out/metrics.json``, with ``checkpoint`` a checkpoint
under ``out/checkpoints``, with ``final`` ``out/final_model`` (merged) and ``out/final_adapter``.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import msgspec
import torch

from services.trainer import devices
from services.trainer.config import TrainerConfig
from services.trainer.learner import Learner
from services.trainer.ranks import RankGroup
from tests.distributed.rank_script import batch


async def run(spec: dict) -> None:
    cfg = msgspec.convert(spec["config"], TrainerConfig)
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    dtype = spec.get("dtype", "float32")  # the run's [model] dtype
    group = RankGroup.start(cfg, out) if cfg.devices.world_size > 1 else None
    try:
        model_dir = Path(spec["model_dir"])
        if group is not None:
            group.init(model_dir, dtype=dtype)
        learner = Learner(cfg, model_dir, devices.resolve(cfg, dtype=dtype), init_method=group.init_method if group else "",
                          group=group)
        if spec.get("resume_from"):
            learner.load_optimizer(Path(spec["resume_from"]))
        if spec.get("load_weights"):
            learner.load_weights(torch.load(spec["load_weights"]))
        metrics = [learner.step(batch(seed)) for seed in spec["steps"]]
        torch.save(learner.state_dict(), out / "weights.pt")
        if spec.get("checkpoint"):
            learner.save_checkpoint(out / "checkpoints", len(spec["steps"]), {"step": len(spec["steps"])})
        if spec.get("final"):
            learner.save_pretrained(out / "final_model")
            learner.save_adapter(out / "final_adapter")
        (out / "metrics.json").write_text(json.dumps(metrics))
    finally:
        if group is not None:
            group.close()


if __name__ == "__main__":
    asyncio.run(run(json.loads(Path(sys.argv[1]).read_text())))
