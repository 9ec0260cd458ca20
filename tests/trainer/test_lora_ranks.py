"""LoRA on a trainer of 2 real ranks (FSDP2 over gloo, processes started by the trainer's own RankGroup):
the adapters are sharded with the model and update as on 1 rank; the adapter version, the adapter directory
and the merged final model are gathered onto rank 0; a 2-rank adapter checkpoint resumes in 1 rank with its
AdamW moments, and an adapter version given to rank 0 reaches every shard."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from services.lib.weights import lora_merge

REPO = Path(__file__).resolve().parents[2]
LORA = {"r": 4, "alpha": 8.0}


def _run(tmp_path: Path, name: str, model_dir: Path, world_size: int, steps: list[int], **spec) -> Path:
    out = tmp_path / name
    config = {"devices": {"world_size": world_size, "num_threads": 1, "device": "cpu"},
              "optim": {"micro_batch_size": 4, "lr": 1e-2}, "lora": LORA}
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"model_dir": str(model_dir), "config": config, "steps": steps, "out": str(out),
                                **spec}))
    r = subprocess.run([sys.executable, "-m", "tests.trainer.lora_rank_script", str(path)], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    logs = "".join(p.read_text()[-2000:] for p in sorted((out / "ranks").glob("*.log"))) if out.exists() else ""
    assert r.returncode == 0, r.stderr[-3000:] + logs
    return out


def _adapters(out: Path) -> dict[str, torch.Tensor]:
    wire = torch.load(out / "weights.pt")
    assert lora_merge.is_adapter(wire)
    return {k: v for k, v in wire.items() if k != lora_merge.ADAPTER_KEY}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys() and a
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def test_two_rank_lora_updates_as_one_rank_and_gathers_its_final_forms(tmp_path, loop_model_dir):
    one = _run(tmp_path, "one", loop_model_dir, 1, [1, 2])
    two = _run(tmp_path, "two", loop_model_dir, 2, [1, 2], final=True)
    log = (two / "ranks" / "rank-1.log").read_text()
    assert "rank 1 of 2 ready" in log and "rank 1 stopped" in log
    moved = max(v.abs().max().item() for k, v in _adapters(one).items() if k.endswith(".lora_B"))
    assert moved > 1e-3  # B left zero: the steps trained the adapters
    assert _max_diff(_adapters(one), _adapters(two)) < moved / 50

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(two / "final_model", local_files_only=True)
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(loop_model_dir), two / "final_adapter")
    ids = torch.tensor([[1, 5, 9, 3, 4]])
    with torch.no_grad():
        assert torch.allclose(merged(input_ids=ids).logits, adapted(input_ids=ids).logits, atol=1e-5)


def test_a_two_rank_adapter_checkpoint_resumes_in_one_rank_with_its_moments(tmp_path, loop_model_dir):
    two = _run(tmp_path, "two", loop_model_dir, 2, [1, 2], checkpoint=True)
    ckpt = two / "checkpoints" / (two / "checkpoints" / "latest").read_text().strip()
    assert sorted(p.name for p in (ckpt / "dcp").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert (ckpt / "adapter" / "adapter_config.json").is_file() and not (ckpt / "model.safetensors").exists()
    straight = _run(tmp_path, "straight", loop_model_dir, 1, [1, 2, 3])
    resumed = _run(tmp_path, "resumed", loop_model_dir, 1, [3], resume_from=str(ckpt))
    fresh = _run(tmp_path, "fresh", loop_model_dir, 1, [3], load_weights=str(two / "weights.pt"))  # no moments
    resumed_gap = _max_diff(_adapters(straight), _adapters(resumed))
    fresh_gap = _max_diff(_adapters(straight), _adapters(fresh))
    assert resumed_gap < fresh_gap / 20, (resumed_gap, fresh_gap)


def test_an_adapter_version_given_to_rank_0_reaches_every_shard(tmp_path, loop_model_dir):
    one = _run(tmp_path, "one", loop_model_dir, 1, [1, 2])
    loaded = _run(tmp_path, "loaded", loop_model_dir, 2, [], load_weights=str(one / "weights.pt"))
    assert _max_diff(_adapters(one), _adapters(loaded)) == 0.0
