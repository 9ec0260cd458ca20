"""A trainer of 2 real ranks (FSDP2 over gloo, separate processes started by the trainer's own
RankGroup) computes what 1 rank computes, and its sharded checkpoint loads into 1 rank."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, name: str, model_dir: Path, world_size: int, steps: list[int], **spec) -> Path:
    out = tmp_path / name
    config = {"devices": {"world_size": world_size, "num_threads": 1, "device": "cpu"},
              "optim": {"micro_batch_size": 4, "lr": 1e-3, **spec.pop("optim", {})}, "loss": spec.pop("loss", {})}
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"model_dir": str(model_dir), "config": config, "steps": steps, "out": str(out),
                                **spec}))
    r = subprocess.run([sys.executable, "-m", "tests.distributed.rank_script", str(path)], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    logs = "".join(p.read_text()[-2000:] for p in sorted((out / "ranks").glob("*.log"))) if out.exists() else ""
    assert r.returncode == 0, r.stderr[-3000:] + logs
    return out


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "weights.pt")


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys() and a
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def test_two_ranks_update_the_weights_as_one_rank_does(tmp_path, loop_model_dir):
    # token-budget micro-batches cut each rank's share unevenly: in step 1 rank 1 has a pass fewer and
    # joins the last one with an empty pass (FSDP needs every rank in every pass)
    budget = {"micro_batch_size": 3, "max_tokens_per_micro_batch": 30}  # optim keys
    from services.trainer import batching
    from services.trainer.config import TrainerConfig
    from services.trainer.learner import StepInput
    from tests.distributed.rank_script import batch

    plan = batching.plan(StepInput.of(batch(1), TrainerConfig()).lengths, 2, 3, 30)
    assert [] in plan[1] and [] not in plan[0]
    one = _run(tmp_path, "one", loop_model_dir, 1, [1, 2], optim=budget)
    two = _run(tmp_path, "two", loop_model_dir, 2, [1, 2], optim=budget)
    # both ranks really ran (rank 1's own process, its log says it trained and stopped cleanly)
    log = (two / "ranks" / "rank-1.log").read_text()
    assert "rank 1 of 2 ready" in log and "rank 1 stopped" in log
    from safetensors.torch import load_file

    initial = load_file(loop_model_dir / "model.safetensors")
    moved = _max_diff({k: v for k, v in _weights(one).items() if k in initial},
                      {k: v for k, v in initial.items() if k in _weights(one)})
    assert moved > 1e-4  # two AdamW steps at lr 1e-3 changed the weights ...
    assert _max_diff(_weights(one), _weights(two)) < moved / 50  # ... and 2 ranks changed them the same way
    m1, m2 = (json.loads((o / "metrics.json").read_text()) for o in (one, two))
    for a, b in zip(m1, m2, strict=True):  # the same loss and gradient norm over the whole batch
        assert abs(a["losses/total"] - b["losses/total"]) < 1e-5
        assert abs(a["optim/grad_norm"] - b["optim/grad_norm"]) < 1e-4 * max(1.0, a["optim/grad_norm"])


def test_two_ranks_with_a_sharded_kl_reference_update_as_one_rank_does(tmp_path, loop_model_dir):
    """The KL reference is sharded like the policy: its forward is a collective, joined by a rank's empty pass
    too (rank 1 has a pass fewer in step 1), and the update is still the one rank's."""
    budget = {"micro_batch_size": 3, "max_tokens_per_micro_batch": 30}
    one = _run(tmp_path, "one", loop_model_dir, 1, [1, 2], optim=budget, loss={"kl_coef": 0.5})
    two = _run(tmp_path, "two", loop_model_dir, 2, [1, 2], optim=budget, loss={"kl_coef": 0.5})
    m1, m2 = (json.loads((o / "metrics.json").read_text()) for o in (one, two))
    assert m1[1]["losses/kl"] > 0  # the second step moved away from the reference
    for a, b in zip(m1, m2, strict=True):
        assert abs(a["losses/kl"] - b["losses/kl"]) < 1e-5
        assert abs(a["losses/total"] - b["losses/total"]) < 1e-5
    from safetensors.torch import load_file

    initial = load_file(loop_model_dir / "model.safetensors")
    moved = _max_diff({k: v for k, v in _weights(one).items() if k in initial},
                      {k: v for k, v in initial.items() if k in _weights(one)})
    assert _max_diff(_weights(one), _weights(two)) < moved / 50


def test_a_two_rank_checkpoint_resumes_in_one_rank_with_its_optimiser_state(tmp_path, loop_model_dir):
    two = _run(tmp_path, "two", loop_model_dir, 2, [1, 2], checkpoint=True)
    ckpt = two / "checkpoints" / (two / "checkpoints" / "latest").read_text().strip()
    assert sorted(p.name for p in (ckpt / "dcp").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(ckpt, local_files_only=True)  # the readable model beside the shards
    straight = _run(tmp_path, "straight", loop_model_dir, 1, [1, 2, 3])  # no interruption, one rank
    resumed = _run(tmp_path, "resumed", loop_model_dir, 1, [3], resume_from=str(ckpt))
    fresh = _run(tmp_path, "fresh", loop_model_dir, 1, [3], model_dir_only=str(ckpt))
    resumed_gap = _max_diff(_weights(straight), _weights(resumed))
    fresh_gap = _max_diff(_weights(straight), _weights(fresh))
    # the AdamW moments came back from the 2-rank shards: without them step 3 goes elsewhere
    assert resumed_gap < fresh_gap / 20, (resumed_gap, fresh_gap)


def test_weights_given_to_rank_0_reach_every_shard(tmp_path, loop_model_dir):
    """What a resume from a kept weight version does: rank 0 has full tensors, every rank's shard takes them."""
    one = _run(tmp_path, "one", loop_model_dir, 1, [1, 2], dtype="bfloat16")  # bf16, as sent
    loaded = _run(tmp_path, "loaded", loop_model_dir, 2, [], load_weights=str(one / "weights.pt"))
    kept, back = _weights(one), _weights(loaded)
    assert _max_diff(kept, back) == 0.0  # bf16 -> float32 shards -> gathered float32: exact
    from safetensors.torch import load_file

    initial = load_file(loop_model_dir / "model.safetensors")
    assert _max_diff({k: kept[k] for k in initial}, initial) > 1e-4  # (so loading really changed the shards)
