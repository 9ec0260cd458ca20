"""One rank of a 2-rank gloo group that loads a learner the large-model way and compares it with per-rank loading
(run as a script by tests/distributed/test_sharded_load.py, once per rank).

    python -m tests.distributed.load_script SPEC.json RANK

SPEC: ``{"model_dir", "init_method", "lora": bool, "out": dir}``. The learner's rank 0 reads the checkpoint and
the other rank builds on the meta device and receives its shards; the reference (``kl_coef > 0``, no LoRA) is
sharded the same way. Then this rank loads the whole model itself, as every rank used to, shards it the same way,
and writes ``out/rank-<r>.json``: per tensor whether its local shard (and every buffer) is equal, and on rank 0
whether the bf16 gather equals the checkpoint cast to bf16.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import msgspec
import torch

from services.lib.model_io import load_policy
from services.trainer import devices
from services.trainer.config import TrainerConfig
from services.trainer.learner import Learner
from services.trainer.sharding import shard


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def main(spec: dict, rank: int) -> None:
    lora = spec["lora"]
    config = {"devices": {"world_size": 2, "device": "cpu", "num_threads": 1}, "loss": {"kl_coef": 0.1}}
    if lora:
        config["lora"] = {"r": 4, "alpha": 8.0}
    cfg = msgspec.convert(config, TrainerConfig)
    model_dir = Path(spec["model_dir"])
    learner = Learner(cfg, model_dir, devices.resolve(cfg, rank, "bfloat16"), rank=rank,
                      init_method=spec["init_method"])
    # per-rank load: the whole float32 model on this rank, LoRA applied, sharded like the learner's
    whole, _ = load_policy(model_dir, dtype="float32")
    if lora:
        from services.trainer.lora import apply_lora

        whole = apply_lora(whole, cfg.lora)
    shard(whole, bf16=True)
    ours, theirs = learner.model.state_dict(), whole.state_dict()
    report: dict = {"keys_equal": ours.keys() == theirs.keys(), "unequal": [], "buffers_unequal": []}
    for k in theirs:
        if not torch.equal(local(ours[k]), local(theirs[k])):
            report["unequal"].append(k)
    for (name, a), (_, b) in zip(learner.model.named_buffers(), whole.named_buffers(), strict=True):
        if not torch.equal(a, b):
            report["buffers_unequal"].append(name)
    report["shard_sizes"] = {k: local(v).numel() for k, v in ours.items()}
    report["ref_sharded"] = learner.ref_sharded
    if learner.ref_model is not None:
        ref_sd = learner.ref_model.state_dict()
        base, _ = load_policy(model_dir, dtype="bfloat16")
        shard(base, bf16=False)
        report["ref_unequal"] = [k for k, v in base.state_dict().items() if not torch.equal(local(ref_sd[k]), local(v))]
        report["ref_dtype"] = str(local(next(iter(ref_sd.values()))).dtype)
    published = learner.state_dict()  # a collective: every rank takes part
    if rank == 0:
        plain, _ = load_policy(model_dir, dtype="float32")
        want = {k: v.to(torch.bfloat16) for k, v in plain.state_dict().items()}
        if lora:
            report["published_keys"] = sorted(published)
        else:
            report["published_unequal"] = [k for k in want if not torch.equal(published[k], want[k])]
            report["published_dtypes"] = sorted({str(v.dtype) for v in published.values()})
            report["published_keys_equal"] = published.keys() == want.keys()
    torch.distributed.destroy_process_group()
    Path(spec["out"], f"rank-{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(json.loads(Path(sys.argv[1]).read_text()), int(sys.argv[2]))
