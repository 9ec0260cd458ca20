"""bench/learner.py --quick, run as the real script (the tiny model, the trainer's own Learner): a peak GEMM
rate per dtype, every side timed with its FLOPs and its fraction of the peak as the figures give it, packed
rows computing fewer tokens and exactly the completion tokens' logits, the layouts agreeing on the logprobs, and
the profile's shares adding up. No timing thresholds: the figures are the bench's to report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "learner.py"


def test_quick_run_reports_every_side_against_the_peak():
    r = subprocess.run([sys.executable, str(SCRIPT), "--quick"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    figures = json.loads(r.stdout.strip().splitlines()[-1])
    batch = figures["batch"]
    assert batch["completion_max"] == 24 and len(batch["completion_tokens"]) == 4
    peaks = {dtype: figures["peak"][dtype]["peak_gflops"] for dtype in ("bfloat16", "float32")}
    assert all(p > 0 for p in peaks.values())
    sides = figures["sides"]
    assert set(sides) == {f"bfloat16/{s}" for s in ("padded", "packed-all-logits", "packed-plain-logsoftmax",
                                                      "packed-masked-attention", "packed")} | {"float32/packed"}
    for side in sides.values():
        assert side["step_s_median"] > 0 and side["useful_tflop"] > 0
        assert side["executed_tflop"] >= side["useful_tflop"]
        assert side["peak_gflops_around_steps"] > 0
        assert side["fraction_of_peak"] == pytest.approx(side["achieved_gflops"] / side["peak_gflops_around_steps"],
                                                         rel=1e-2)
        assert side["phases"]["forward_s"] > 0 and side["phases"]["optimiser_s"] > 0
    packed, padded = sides["bfloat16/packed"]["layout"], sides["bfloat16/padded"]["layout"]
    assert packed["tokens"] < padded["tokens"] and packed["rows"] < padded["rows"]
    assert packed["logits"] == sum(batch["completion_tokens"]) < padded["logits"]
    errors = {s: sides[f"bfloat16/{s}"]["logprob_error_vs_fp32"] for s in ("padded", "packed")}
    assert all(0 <= e["mean"] <= e["max"] < 0.5 for e in errors.values())  # bf16 rounding, no more
    profile = sides["bfloat16/packed"]["profile"]
    assert sum(profile["share"].values()) == pytest.approx(1.0, abs=0.01) and profile["share"]["gemm"] > 0
    goal = figures["goal"]
    assert goal["bf16_fraction_of_peak"] == sides[f"bfloat16/{goal['bf16_best_side']}"]["fraction_of_peak"]
    assert set(figures["ratios"]) == {"bf16_packed_speedup_over_padded", "bf16_completion_logits_speedup",
                                      "bf16_chunked_logsoftmax_speedup", "bf16_varlen_attention_speedup",
                                      "bf16_over_fp32_step_packed"} | {
        f"{k}_load_normalised" for k in ("bf16_packed_speedup_over_padded", "bf16_completion_logits_speedup",
                                         "bf16_chunked_logsoftmax_speedup", "bf16_varlen_attention_speedup")}
    # attention once per packed sequence executes less than the whole rows under a mask, for the same values
    masked = sides["bfloat16/packed-masked-attention"]
    assert masked["layout"]["tokens"] == packed["tokens"]
    assert masked["layout"]["attention"] == "whole rows, masked"
    # the tiny model's short rows: one masked call pays better than a call per sequence (the same work counted)
    assert packed["attention"] == "whole rows, masked" and masked["layout"]["attention_sq"] == packed["attention_sq"]
    assert figures["ratios"]["bf16_packed_speedup_over_padded"] == pytest.approx(
        sides["bfloat16/padded"]["step_s_median"] / sides["bfloat16/packed"]["step_s_median"], rel=1e-2)


def test_an_unknown_side_is_refused_by_name():
    r = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--sides", "packed,padded-twice"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "--sides: unknown ['padded-twice']" in r.stderr
