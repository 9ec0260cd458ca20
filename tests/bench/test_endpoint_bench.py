"""bench/endpoint.py --quick, run as the real script (the torch engine, the endpoint on a real port, the openai
client in a child process, native episodes on the same engine): both sides time every call of every session,
report positive figures, the ratios are the ones the figures give, both sides decoded in batches, and the seeded
calls sampled the same sequences on both sides. No timing thresholds: the figures are the bench's to report."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "endpoint.py"


def test_quick_run_reports_both_sides_and_their_ratios():
    r = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--profile"], capture_output=True, text=True,
                       timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    figures = json.loads(r.stdout.strip().splitlines()[-1])
    assert figures["sessions"] == [4] and figures["turns"] == 2 and figures["rounds"] == 1
    level = figures["levels"]["4"]
    for side in ("native", "endpoint"):
        f = level[side]
        assert f["calls"] == 4 * 2 and f["tokens"] > 0 and f["decode_steps"] > 0, side
        for key in ("tokens_per_s", "latency_ms_p50", "latency_ms_p99", "latency_ms_mean"):
            assert math.isfinite(f[key]) and f[key] > 0, (side, key)
        assert f["latency_ms_p99"] >= f["latency_ms_p50"]
        assert 1 <= f["rows_per_step"] <= 4
        assert len(f["rounds_tokens_per_s"]) == 1 and f["worker_cpu_us_per_token"] > 0
    assert level["endpoint"]["client_cpu_ms_per_call"] > 0
    ratio = level["endpoint_over_native"]
    assert ratio["tokens_per_s"] == pytest.approx(level["endpoint"]["tokens_per_s"] / level["native"]["tokens_per_s"],
                                                  rel=1e-3)
    assert ratio["latency_p50"] == pytest.approx(
        level["endpoint"]["latency_ms_p50"] / level["native"]["latency_ms_p50"], rel=1e-3)
    assert ratio["tokens_per_s_median_of_rounds"] == pytest.approx(ratio["tokens_per_s"], rel=1e-2)
    assert ratio["worker_cpu_per_token"] > 0
    assert 0 <= level["same_sequences"] <= 1 and figures["endpoint_errors"] == 0
    profile = figures["profile"]
    assert profile["busy_s"] > 0 and sum(profile["parts"].values()) == pytest.approx(1, abs=0.02)
    assert "endpoint/native" in r.stdout  # the table before the JSON line
