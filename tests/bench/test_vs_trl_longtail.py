"""bench/vs_trl.py on the long-tail workload (issue 30 item 4): TRL against rlbus synchronous and asynchronous on
disjoint pools, so the gain splits into overlap's part and the rest. The pure parts (settings, the rlbus runs'
keys, the split's arithmetic), and ``--quick`` run as the real script on the tiny model with both modes pooled
(TRL's GRPOTrainer and two rlbus runs); no timing thresholds, the figures are the bench's to report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from itertools import islice
from pathlib import Path

import pytest

from bench._offline_eval import run_task
from bench.vs_trl import apply_defaults, attribution, example_config, parse_args, rlbus_runs

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "vs_trl.py"
two_cpus = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the pooled layout needs two CPUs")


def test_the_longtail_comparison_takes_the_example_and_its_instruction():
    args = parse_args(["--model", "longtail"])
    comp = apply_defaults(args)
    assert comp.example == REPO / "examples" / "longtail.toml"
    runfile = example_config(comp.example, comp)
    assert runfile.services.trainer.sampling.max_new_tokens == 512
    # TRL's prompts are the task's with the example's step-by-step instruction, in rlbus's order
    prompt = next(islice(run_task(runfile).train_prompts(0), 1))
    assert "step by step" in prompt.messages[-1]["content"]
    assert (args.rlbus_modes, args.rlbus_layout, args.steps, args.eval_every) == (("sync", "async"), "pooled", 40, 5)


@two_cpus
def test_the_rlbus_runs_are_sync_and_async_on_disjoint_pools():
    args = parse_args(["--model", "longtail"])
    comp = apply_defaults(args)
    runs = rlbus_runs(args, example_config(comp.example, comp))
    assert list(runs) == ["rlbus_sync", "rlbus_async"]
    assert runs["rlbus_sync"]["services.trainer.max_staleness"] == 0
    assert runs["rlbus_async"]["services.trainer.max_staleness"] == 1  # the example's
    for keys in runs.values():
        assert keys["placement.trainer.cpus"] != keys["placement.rollout.cpus"] == keys["placement.judge.cpus"]
        assert keys["services.trainer.devices.num_threads"] == 0
    # the other comparisons keep one run of their example as shipped, unless told
    tiny = parse_args([])
    apply_defaults(tiny)
    assert rlbus_runs(tiny, example_config()) == {"rlbus": {}}
    one = parse_args(["--rlbus-modes", "sync", "--rlbus-layout", "shared"])
    apply_defaults(one)
    assert rlbus_runs(one, example_config()) == {"rlbus_sync": {"services.trainer.max_staleness": 0}}
    for bad in (["--rlbus-modes", "fast"], ["--rlbus-modes", ","], ["--rlbus-layout", "split"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_the_gain_splits_into_overlap_and_the_rest():
    figures = {"trl_s": 300.0, "rlbus_sync_s": 120.0, "rlbus_async_s": 80.0}
    sides = {"trl": {"last_step_s": 1000.0}, "rlbus_sync": {"last_step_s": 400.0}, "rlbus_async": {"last_step_s": 250.0}}
    a = attribution(figures, sides)
    assert a["to_reward"] == {"not_overlap": 2.5, "overlap": 1.5, "whole": 3.75}
    assert a["budget"] == {"not_overlap": 2.5, "overlap": 1.6, "whole": 4.0}
    # a side that never reached the target has no time: its parts are None, the others stand
    assert attribution({"trl_s": None, "rlbus_sync_s": 120.0, "rlbus_async_s": 80.0}, sides)["to_reward"] == {
        "not_overlap": None, "overlap": 1.5, "whole": None}


@two_cpus
def test_quick_runs_trl_and_rlbus_sync_and_async_pooled(tmp_path):
    import trl  # noqa: F401 - the bench extra is in the test environment (`.[all]`): missing, the test fails
    r = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--steps", "4", "--eval-every", "2",
                        "--eval-prompts", "20", "--rlbus-modes", "sync,async", "--rlbus-layout", "pooled",
                        "--work-dir", str(tmp_path)], capture_output=True, text=True, timeout=1200, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert (out["rlbus_modes"], out["rlbus_layout"], out["rlbus_headline"]) == (["sync", "async"], "pooled", "rlbus_async")
    for name in ("trl", "rlbus_sync", "rlbus_async"):
        assert out[name]["steps"] == 4 and out[name]["last_step_s"] > 0, name
    assert out["attribution"]["to_reward"] is None  # --quick: too short to learn, as "ratio"
    budget = out["attribution"]["budget"]
    assert budget["whole"] == out["budget_time_ratio"]
    assert budget["whole"] == pytest.approx(budget["not_overlap"] * budget["overlap"], rel=0.01)
    assert out["rlbus_final_reward"] == out["rlbus_async"]["final_reward"]
    for name, staleness in (("rlbus_sync", 0), ("rlbus_async", 1)):
        resolved = json.loads((tmp_path / name / "config.resolved.json").read_text())
        assert resolved["services"]["trainer"]["max_staleness"] == staleness
        assert resolved["placement"]["trainer"]["cpus"] != resolved["placement"]["rollout"]["cpus"]


def test_a_vllm_evaluation_is_after_the_runs_so_it_needs_rlbus_evaluated_offline():
    args = parse_args(["--model", "longtail", "--eval-engine", "vllm"])
    apply_defaults(args)
    assert (args.eval_engine, args.rlbus_eval) == ("vllm", "offline")
    with pytest.raises(ValueError, match="--rlbus-eval offline"):
        apply_defaults(parse_args(["--model", "longtail", "--eval-engine", "vllm", "--rlbus-eval", "inloop"]))
    with pytest.raises(SystemExit):
        parse_args(["--eval-engine", "tgi"])
