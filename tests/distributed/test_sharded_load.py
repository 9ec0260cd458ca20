"""Large-model loading on 2 real gloo ranks (separate processes): rank 0 reads the checkpoint, rank 1 builds on the
meta device and receives its shards, and every rank ends with exactly the shards (and buffers) it would have had by
loading the whole model itself; the KL reference is sharded the same way; the published weights are gathered in
bf16 (with LoRA: the adapters only)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from services.runtime.natsd import free_port

REPO = Path(__file__).resolve().parents[2]


def _run_two_ranks(tmp_path: Path, model_dir: Path, lora: bool) -> list[dict]:
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"model_dir": str(model_dir), "lora": lora, "out": str(tmp_path),
                                "init_method": f"tcp://127.0.0.1:{free_port('127.0.0.1')}"}))
    procs = [subprocess.Popen([sys.executable, "-m", "tests.distributed.load_script", str(spec), str(rank)],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in (0, 1)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    for p, text in zip(procs, outputs, strict=True):
        assert p.returncode == 0, text[-4000:]
    return [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.parametrize("lora", [False, True])
def test_rank_0_load_gives_every_rank_the_shards_of_a_per_rank_load(tmp_path, loop_model_dir, lora):
    reports = _run_two_ranks(tmp_path, loop_model_dir, lora)
    for rank, report in enumerate(reports):
        assert report["keys_equal"], rank
        assert report["unequal"] == [], (rank, report["unequal"])
        assert report["buffers_unequal"] == [], (rank, report["buffers_unequal"])  # rotary inv_freq: not in any state dict
    # each rank holds a shard, not the whole tensor
    sizes = [r["shard_sizes"] for r in reports]
    assert sum(sizes[0].values()) < sum(sizes[0][k] + sizes[1][k] for k in sizes[0])
    if lora:
        assert not reports[0]["ref_sharded"]  # the reference is the base with adapters disabled
        published = reports[0]["published_keys"]
        assert published and all("lora" in k or k.startswith("__") for k in published), published
    else:
        for rank, report in enumerate(reports):
            assert report["ref_sharded"] and report["ref_unequal"] == [], (rank, report)
            assert report["ref_dtype"] == "torch.bfloat16"
        assert reports[0]["published_keys_equal"] and reports[0]["published_unequal"] == []
        assert reports[0]["published_dtypes"] == ["torch.bfloat16"]
