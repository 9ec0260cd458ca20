"""bench/episode_overhead.py with tiny settings, run as the real script (tool worker processes, threads): every
kind and the single-turn comparison report their figures, positive and finite. No timing thresholds: the figures
are the bench's to report."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "episode_overhead.py"
KINDS = {"bare", "none", "async", "worker", "thread"}


def test_tiny_run_reports_every_kind_and_the_single_turn_ratio():
    r = subprocess.run([sys.executable, str(SCRIPT), "--episodes", "2", "--turns", "2", "--gen-s", "0.001",
                        "--tool-s", "0.001", "--rounds", "1"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    figures = json.loads(r.stdout.strip().splitlines()[-1])
    assert figures["episodes"] == 2 and figures["turns"] == 2 and figures["tool_workers"] == 2
    assert set(figures["kinds"]) == KINDS
    for kind, f in figures["kinds"].items():
        assert f["turns"] == 2 * 2, kind
        for key in ("overhead_ms_p50", "overhead_ms_p99", "overhead_ms_mean", "cpu_ms_per_turn"):
            assert math.isfinite(f[key]) and f[key] > 0, (kind, key, f[key])
        assert f["overhead_ms_p99"] >= f["overhead_ms_p50"]
        assert math.isfinite(f["over_bare_ms_mean"])  # a difference: noise may make it negative
    assert figures["kinds"]["bare"]["over_bare_ms_mean"] == 0.0
    st = figures["single_turn"]
    assert st["calls"] == 2 * 2
    for key in ("bare_ms_mean", "loop_ms_mean", "ratio_loop_over_bare", "cpu_us_bare", "cpu_us_loop",
                "cpu_ratio_loop_over_bare"):
        assert math.isfinite(st[key]) and st[key] > 0, (key, st[key])
    assert math.isfinite(st["overhead_us_mean"])
    assert "single turn" in r.stdout and "worker" in r.stdout  # the table before the JSON line
