"""bench/gpu_check_trainer.py (the trainer part of the GPU check) runs on CPU too: briefly, here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "gpu_check_trainer.py"


def test_the_gpu_check_runs_on_cpu_and_reports_step_time_and_tokens_per_s(tmp_path):
    r = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--models", "tiny", "--steps", "1",
                        "--warmup", "0", "--groups", "2", "--group-size", "4", "--prompt-len", "16",
                        "--completion-len", "24", "--threads", "1", "--dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    tiny = result["models"]["tiny"]
    for dtype, sent in (("bfloat16", "bfloat16"), ("float32", "float32")):
        assert tiny[dtype]["step_s_median"] > 0 and tiny[dtype]["train_tokens_per_s"] > 0
        assert tiny[dtype]["loss_finite"] and tiny[dtype]["sent_dtype"] == sent
    assert tiny["bf16_vs_fp32_step"] > 0


def test_the_smollm2_sized_model_has_smollm2s_parameter_count():
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(REPO))
    from bench.gpu_check_trainer import MODELS

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**MODELS["smollm2"], tie_word_embeddings=True))
    assert 134_000_000 < sum(p.numel() for p in model.parameters()) < 135_000_000  # SmolLM2-135M: 134.5 M


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for hosts without CUDA")
def test_the_gpu_check_refuses_cuda_on_a_host_without_it():
    r = subprocess.run([sys.executable, str(SCRIPT), "--device", "cuda"], capture_output=True, text=True,
                       timeout=120, cwd=REPO)
    assert r.returncode != 0 and "no CUDA device here" in r.stderr
