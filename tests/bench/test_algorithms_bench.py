"""bench/algorithms.py: the A/B of the algorithm options against the default example.

The quick run is the real script (nats-server, every service a process, offline evaluation): the default side and
dynamic sampling each train, and dynamic sampling's own figure (the fraction of groups it filtered) is read from
its run and only from its run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.algorithms import DEFAULT_VARIANTS, main, summarise

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "algorithms.py"


def test_quick_run_trains_both_sides_and_reads_each_options_figures(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--work-dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["bench"] == "algorithms" and out["seeds"] == [0]
    seed = out["per_seed"][0]
    assert set(seed["sides"]) == {"default", "dynamic"}
    for side in seed["sides"].values():
        assert side["steps"] == 8  # the same sample budget on both sides
        assert 0.0 <= side["final_reward"] <= 1.0
    filtered = out["mean"]["mean_trainer_filtered_frac"]
    assert filtered["default"] is None  # the default run never filters: no figure, not a zero made up
    assert 0.0 <= filtered["dynamic"] <= 1.0
    vs = seed["vs_default"]["dynamic"]
    assert vs["target"] <= max(seed["final_reward"].values())


def test_default_variants_load_on_the_example_and_bad_ones_are_refused() -> None:
    assert len(DEFAULT_VARIANTS) >= 7
    assert main(["--quick", "--variant", "default:dynamic_sampling=true"]) == 2  # the baseline's own name
    assert main(["--quick", "--variant", "x:loss.type=ppo"]) == 2  # not a loss type
    assert main(["--quick", "--variant", "x:no_such_key=1"]) == 2


def test_summary_means_over_seeds_and_none_when_a_seed_missed() -> None:
    def seed(steps: int | None, default_steps: int, frac: float) -> dict:
        return {"vs_default": {"v": {"steps_ratio": None if steps is None else steps / default_steps,
                                     "time_ratio": 1.0, "steps": steps, "default_steps": default_steps}},
                "final_reward": {"default": 0.5, "v": 0.4}, "eval_reward_mean": {"default": 0.4, "v": 0.3},
                "sides": {"default": {"s_per_step": 0.3}, "v": {"s_per_step": 0.5, "trainer/filtered_frac": frac}}}

    both = summarise([seed(20, 40, 0.2), seed(60, 40, 0.4)], ["default", "v"])
    assert both["steps_ratio"]["v"] == 1.0  # (0.5 + 1.5) / 2
    assert both["steps_ratio_of_means"]["v"] == 1.0  # 40 / 40
    assert both["mean_trainer_filtered_frac"] == {"default": None, "v": 0.3}
    assert both["s_per_step"] == {"default": 0.3, "v": 0.5}
    missed = summarise([seed(20, 40, 0.2), seed(None, 40, 0.4)], ["default", "v"])
    assert missed["steps_ratio"]["v"] is None
