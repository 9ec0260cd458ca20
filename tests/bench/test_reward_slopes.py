"""bench/reward_slopes.py: pooled slopes of the reward's rise, against hand-computed values, and the script's
errors on bad input."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from bench.reward_slopes import figures, rises, slope

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "reward_slopes.py"


def result(seed: int, sync: list[list[float]], asynch: list[list[float]]) -> dict:
    return {"seed": seed, "sides": {"sync-pooled": {"curve": sync}, "async-pooled": {"curve": asynch}}}


def test_a_slope_through_the_origin_by_hand():
    # points (1, 1), (2, 3): b = (1 + 6) / (1 + 4) = 1.4; residuals -0.4, 0.2: var = 0.2 / 1; se = sqrt(0.2 / 5)
    b, se = slope([(1.0, 1.0), (2.0, 3.0)])
    assert b == pytest.approx(1.4) and se == pytest.approx(math.sqrt(0.2 / 5))


def test_rises_are_over_each_seeds_own_start():
    curves = [[[0, 0.0, 0.1], [5, 100.0, 0.2]], [[0, 0.0, 0.3], [5, 90.0, 0.35]]]
    assert [v for p in rises(curves, 0) for v in p] == pytest.approx([5, 0.1, 5, 0.05])
    assert [v for p in rises(curves, 1) for v in p] == pytest.approx([100.0, 0.1, 90.0, 0.05])
    with pytest.raises(ValueError, match="step 0"):
        rises([[[5, 1.0, 0.2]]], 0)


def test_async_twice_as_fast_in_time_with_the_same_steps_gives_2_and_1():
    # both gain 0.01 a step; the async side's steps take half the time
    sync = [[0, 0.0, 0.1], [5, 100.0, 0.15], [10, 200.0, 0.2]]
    asynch = [[0, 0.0, 0.1], [5, 50.0, 0.15], [10, 100.0, 0.2]]
    out = figures([result(1, sync, asynch), result(2, sync, asynch)], "sync-pooled", "async-pooled")
    assert out["time_ratio"] == pytest.approx(2.0) and out["time_ratio_se"] == pytest.approx(0.0)
    assert out["steps_ratio"] == pytest.approx(1.0)
    assert out["sync-pooled"]["reward_per_step"] == pytest.approx(0.01) and out["sync-pooled"]["points"] == 4
    assert out["async-pooled"]["reward_per_100s"] == pytest.approx(0.1)


def test_a_side_that_does_not_rise_has_no_ratio_and_a_missing_side_is_named():
    flat = [[0, 0.0, 0.1], [5, 100.0, 0.08], [10, 200.0, 0.09]]
    rising = [[0, 0.0, 0.1], [5, 100.0, 0.15], [10, 200.0, 0.2]]
    out = figures([result(1, flat, rising)], "sync-pooled", "async-pooled")
    assert out["time_ratio"] is None and out["steps_ratio"] is not None
    with pytest.raises(ValueError, match="no side 'async-shared'"):
        figures([result(1, flat, rising)], "sync-pooled", "async-shared")


def test_the_script_reads_the_last_json_line_of_each_log_and_refuses_bad_ones(tmp_path):
    sync = [[0, 0.0, 0.1], [5, 100.0, 0.15], [10, 200.0, 0.2]]
    asynch = [[0, 0.0, 0.1], [5, 80.0, 0.14], [10, 160.0, 0.2]]
    logs = []
    for seed in (1, 2):
        f = tmp_path / f"s{seed}.log"
        f.write_text("progress line\n" + json.dumps(result(seed, sync, asynch)) + "\n")
        logs.append(str(f))
    r = subprocess.run([sys.executable, str(SCRIPT), *logs], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["seeds"] == [1, 2] and out["time_ratio"] > 1.0
    bad = tmp_path / "bad.log"
    bad.write_text("no json here\n")
    r = subprocess.run([sys.executable, str(SCRIPT), str(bad)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "no JSON line" in r.stderr
