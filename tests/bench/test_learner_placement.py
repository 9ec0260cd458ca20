"""bench/learner_placement.py --quick, run as the real script (a nats-server, a spawned learner process): every
placement gets positive step times, the ratios are the ones its figures give, and the event loop handled
messages in both busy placements. No timing thresholds: the figures are the bench's to report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "learner_placement.py"


def test_quick_run_reports_every_placement_and_the_ratios():
    r = subprocess.run([sys.executable, str(SCRIPT), "--quick"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    figures = json.loads(r.stdout.strip().splitlines()[-1])
    pl = figures["placements"]
    assert set(pl) == {"thread-idle", "thread-busy", "process-busy"}
    for p in pl.values():
        assert p["steps"] == 3 and p["step_s_median"] > 0 and p["step_s_mean"] > 0 and p["learner_s_median"] > 0
        assert p["weights_s_median"] > 0 and p["step_with_weights_s_median"] >= p["step_s_median"]
    for busy in ("thread-busy", "process-busy"):
        assert pl[busy]["msgs_per_s"] > 0
    assert "msgs_per_s" not in pl["thread-idle"]
    ratios = figures["ratios"]
    assert ratios["thread_busy_over_idle"] == pytest.approx(
        pl["thread-busy"]["step_s_median"] / pl["thread-idle"]["step_s_median"], rel=1e-3)
    assert ratios["process_over_thread_busy"] == pytest.approx(
        pl["process-busy"]["step_s_median"] / pl["thread-busy"]["step_s_median"], rel=1e-3)
    assert ratios["process_over_thread_busy_with_weights"] == pytest.approx(
        pl["process-busy"]["step_with_weights_s_median"] / pl["thread-busy"]["step_with_weights_s_median"], rel=1e-3)
