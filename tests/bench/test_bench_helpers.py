"""The pure helpers behind the RL benchmarks (bench/_rlbus_runs.py): no processes started."""

from __future__ import annotations

import json
import shutil
import tomllib
from pathlib import Path

import pytest

from bench._rlbus_runs import (
    KEPT_DIR,
    BenchRunError,
    EvalPoint,
    VersionKeeper,
    checkpoint_cost,
    compare,
    default_target,
    eval_curve,
    final_reward,
    kept_versions,
    offline_curve,
    ratio,
    read_metrics,
    reward_at,
    run_stats,
    set_args,
    smooth_curve,
    step_to_reward,
    time_to_reward,
    toml_value,
)


def step_line(step: int, elapsed: float, staleness: float = 0.0, dropped: float = 0.0) -> dict:
    return {"step": step, "elapsed_s": elapsed, "trainer/version": float(step), "time/step_s": 0.5,
            "time/publish_s": 0.1, "trainer/staleness_mean": staleness, "trainer/staleness_max": staleness,
            "trainer/dropped_total": dropped, "trainer/trained_total": 128.0 * step, "trainer/in_flight_peak": 32.0}


def eval_line(step: int, elapsed: float, reward: float) -> dict:
    return {"step": step, "elapsed_s": elapsed, "eval/reward": reward, "eval/version": float(step)}


METRICS = [
    eval_line(0, 1.5, 0.20),
    step_line(1, 3.0),
    step_line(2, 4.0, staleness=1.0),
    eval_line(2, 6.5, 0.30),  # reported 2.5 s after version 2 existed
    step_line(3, 5.0, staleness=1.0, dropped=8.0),
    step_line(4, 6.0, staleness=1.0, dropped=8.0),
    eval_line(4, 9.0, 0.25),
]


def test_eval_curve_places_each_eval_when_its_version_existed() -> None:
    curve = eval_curve(METRICS)
    assert [(p.version, p.t, p.reported_s, p.reward) for p in curve] == [
        (0, 0.0, 1.5, 0.20), (2, 4.0, 6.5, 0.30), (4, 6.0, 9.0, 0.25)]


def test_eval_curve_sorts_by_version_and_falls_back_to_report_time() -> None:
    records = [eval_line(5, 12.0, 0.5), eval_line(0, 1.0, 0.1), step_line(1, 2.0)]
    curve = eval_curve(records)
    assert [p.version for p in curve] == [0, 5]
    assert curve[1].t == 12.0  # no step line names version 5


def test_time_to_reward_is_the_first_crossing_not_the_best() -> None:
    curve = eval_curve(METRICS)
    assert time_to_reward(curve, 0.25) == 4.0
    assert step_to_reward(curve, 0.25) == 2
    assert time_to_reward(curve, 0.2) == 0.0
    assert time_to_reward(curve, 0.31) is None
    assert step_to_reward(curve, 0.31) is None


def test_time_to_reward_tolerates_float_noise_at_the_target() -> None:
    curve = [EvalPoint(version=1, step=1, reward=0.1 + 0.2, t=3.0, reported_s=3.0)]
    assert time_to_reward(curve, 0.3) == 3.0


def test_reward_at_takes_the_newest_version_that_existed() -> None:
    curve = eval_curve(METRICS)
    assert reward_at(curve, -1.0) is None
    assert reward_at(curve, 3.9) == 0.20
    assert reward_at(curve, 4.0) == 0.30
    assert reward_at(curve, 100.0) == 0.25


def test_default_target_is_the_lower_final_reward_and_both_reach_it() -> None:
    a = eval_curve(METRICS)  # final 0.25
    b = [EvalPoint(0, 0, 0.2, 0.0, 1.0), EvalPoint(10, 10, 0.4, 20.0, 21.0)]
    target = default_target(a, b)
    assert target == 0.25
    figures = compare({"a": a, "b": b}, target)
    assert figures["a_s"] == 4.0 and figures["b_s"] == 20.0
    assert "equal_time_s" not in figures


def test_compare_reports_rewards_at_equal_time_when_one_side_misses() -> None:
    fast = [EvalPoint(0, 0, 0.2, 0.0, 0.0), EvalPoint(10, 10, 0.5, 10.0, 10.0), EvalPoint(20, 20, 0.6, 20.0, 20.0)]
    slow = [EvalPoint(0, 0, 0.2, 0.0, 0.0), EvalPoint(10, 10, 0.3, 15.0, 15.0)]
    figures = compare({"fast": fast, "slow": slow}, 0.55)
    assert figures["fast_s"] == 20.0 and figures["slow_s"] is None
    assert figures["equal_time_s"] == 15.0
    assert figures["fast_reward_at_equal_time"] == 0.5
    assert figures["slow_reward_at_equal_time"] == 0.3


def test_compare_flags_a_target_every_run_met_at_the_start() -> None:
    a = [EvalPoint(0, 0, 0.3, 0.0, 0.0), EvalPoint(4, 4, 0.25, 2.0, 2.0)]
    b = [EvalPoint(0, 0, 0.28, 0.0, 0.0), EvalPoint(4, 4, 0.26, 3.0, 3.0)]
    trivial = compare({"a": a, "b": b}, default_target(a, b))
    assert trivial["target_trivial"] is True and trivial["a_s"] == 0.0 and trivial["b_s"] == 0.0
    assert compare({"a": a, "b": b}, 0.29)["target_trivial"] is False


def test_smooth_curve_is_a_trailing_mean_that_keeps_times() -> None:
    curve = eval_curve(METRICS)  # rewards 0.20, 0.30, 0.25
    smoothed = smooth_curve(curve, 2)
    assert [round(p.reward, 6) for p in smoothed] == [0.2, 0.25, 0.275]
    assert [p.t for p in smoothed] == [p.t for p in curve]
    assert smooth_curve(curve, 1) == curve
    with pytest.raises(ValueError):
        smooth_curve(curve, 0)


def test_ratio() -> None:
    assert ratio(30.0, 10.0) == 3.0
    assert ratio(None, 10.0) is None
    assert ratio(10.0, None) is None
    assert ratio(0.0, 0.0) == 1.0  # both start at the target


def test_final_reward_of_an_empty_curve_says_what_to_check() -> None:
    with pytest.raises(BenchRunError, match="no evaluation"):
        final_reward([])


def test_run_stats_from_step_lines() -> None:
    stats = run_stats(METRICS)
    assert stats["steps"] == 4
    assert stats["s_per_step"] == 1.0
    assert stats["staleness_mean"] == 0.75
    assert stats["staleness_max"] == 1.0
    assert stats["dropped"] == 8.0
    assert stats["trained"] == 512.0
    assert run_stats([eval_line(0, 1.0, 0.2)]) == {"steps": 0}


def test_set_args_parse_back_as_toml() -> None:
    values = {"run.dir": '/tmp/a "quoted" dir', "services.trainer.total_steps": 300,
              "services.trainer.max_wall_s": 0.0, "services.trainer.loss.normalize_std": True}
    args = set_args(values)
    assert args[0::2] == ["--set"] * len(values)
    for arg, (key, value) in zip(args[1::2], values.items(), strict=True):
        k, _, v = arg.partition("=")
        assert k == key
        assert tomllib.loads(f"x = {v}")["x"] == value
    with pytest.raises(TypeError):
        toml_value([1, 2])


def test_read_metrics_skips_a_torn_last_line(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in METRICS) + '\n{"step": 5, "elaps')
    assert read_metrics(path) == METRICS


# --- offline evaluation: kept versions --------------------------------------------------------------


def test_offline_curve_places_each_kept_version_when_its_step_ended() -> None:
    # evaluated after the run: step 0 is the initial model at 0 s, the others at their step line's time,
    # reported the moment they existed (evaluating cost the run nothing); in-loop eval lines are ignored
    curve = offline_curve(METRICS, {4: 0.35, 0: 0.20, 2: 0.30})
    assert [(p.version, p.step, p.t, p.reported_s, p.reward) for p in curve] == [
        (0, 0, 0.0, 0.0, 0.20), (2, 2, 4.0, 4.0, 0.30), (4, 4, 6.0, 6.0, 0.35)]
    # the curve is an ordinary one: the comparison helpers take it unchanged
    assert time_to_reward(curve, 0.3) == 4.0 and step_to_reward(curve, 0.3) == 2
    trl = [EvalPoint(0, 0, 0.2, 0.0, 0.0), EvalPoint(2, 2, 0.3, 8.0, 8.0)]
    assert compare({"trl": trl, "rlbus": curve}, 0.3)["rlbus_s"] == 4.0
    assert ratio(8.0, 4.0) == 2.0


def test_offline_curve_takes_the_version_a_step_made_and_rejects_unknown_steps() -> None:
    resumed = [{"step": 3, "elapsed_s": 2.5, "trainer/version": 5.0}]  # a resumed run numbers versions on
    assert [(p.version, p.step, p.t) for p in offline_curve(resumed, {3: 0.4})] == [(5, 3, 2.5)]
    with pytest.raises(BenchRunError, match="step 7"):
        offline_curve(METRICS, {7: 0.5})


def test_checkpoint_cost_is_the_extra_gap_after_checkpointed_steps() -> None:
    times = {1: 1.0, 2: 2.0, 3: 3.5, 4: 4.5, 5: 6.0, 6: 7.0}  # checkpoints after steps 2 and 4: +0.5 s each
    cost = checkpoint_cost([step_line(s, t) for s, t in times.items()], every=2)
    assert cost == {"checkpoint_extra_s_per_write": 0.5, "checkpoint_writes_on_clock": 2, "checkpoint_cost_s": 1.0}
    assert checkpoint_cost([step_line(1, 1.0)], every=2) == {}


def write_checkpoint(root: Path, step: int) -> Path:
    ckpt = root / f"step-{step:06d}"
    (ckpt / "dcp").mkdir(parents=True)
    (ckpt / "config.json").write_text("{}")
    (ckpt / "model.safetensors").write_bytes(b"w" * step)
    (ckpt / "dcp" / "__0_0.distcp").write_bytes(b"optimiser")
    return ckpt


def test_version_keeper_keeps_each_checkpoint_as_a_model_dir_after_it_is_pruned(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    keeper = VersionKeeper(tmp_path)
    write_checkpoint(root, 10)
    (root / ".tmp-step-000020").mkdir()  # being written: not yet a checkpoint
    (root / "latest").write_text("step-000010")
    keeper.sweep()
    write_checkpoint(root, 20)
    shutil.rmtree(root / "step-000010")  # the trainer keeps the two newest only
    keeper.sweep()
    kept = kept_versions(tmp_path / KEPT_DIR)
    assert list(kept) == [10, 20]
    assert (kept[10] / "model.safetensors").read_bytes() == b"w" * 10
    assert not (kept[10] / "dcp").exists()  # the optimiser shards are not needed to evaluate
    assert set(keeper.write_s) == {10, 20}
    assert kept_versions(tmp_path / "nothing") == {}


def test_vs_trl_offline_mode_evaluates_nothing_in_the_loop_and_keeps_every_eval_version() -> None:
    from bench.vs_trl import apply_defaults, parse_args, rlbus_eval_overrides

    args = parse_args(["--quick"])
    apply_defaults(args)
    assert args.rlbus_eval == "offline"
    assert rlbus_eval_overrides(args) == {
        "services.trainer.eval.every": 0, "services.trainer.eval.prompts": 1, "services.trainer.eval.samples": 1,
        "services.trainer.checkpoint_every": args.eval_every}
    inloop = parse_args(["--rlbus-eval", "inloop"])
    apply_defaults(inloop)
    assert rlbus_eval_overrides(inloop) == {}


def test_async_vs_sync_evaluates_every_side_offline_by_default() -> None:
    from bench._offline_eval import offline_overrides
    from bench.async_vs_sync import overrides, parse_args

    args = parse_args(["--eval-every", "7"])
    assert args.eval == "offline" and parse_args(["--eval", "inloop"]).eval == "inloop"
    args.steps, args.eval_prompts = 50, 20
    # what a side runs with offline: its own keys, then no evaluation in the loop and a checkpoint every 7 steps
    keys = {**overrides(args, 1, 1, 0), **offline_overrides(args.eval_every)}
    assert keys["services.trainer.eval.every"] == 0 and keys["services.trainer.checkpoint_every"] == 7
    assert keys["services.trainer.max_staleness"] == 1 and keys["services.trainer.total_steps"] == 50


def test_async_vs_sync_set_finds_each_bare_trainer_key_in_its_group() -> None:
    from bench.async_vs_sync import parse_set, parse_variant, trainer_key

    assert trainer_key("total_steps") == "services.trainer.total_steps"
    assert trainer_key("ppo_epochs") == "services.trainer.optim.ppo_epochs"
    assert trainer_key("is_mode") == "services.trainer.loss.is_mode"
    assert trainer_key("num_threads") == "services.trainer.devices.num_threads"
    assert trainer_key("loss.kl_coef") == "services.trainer.loss.kl_coef"  # by group
    assert trainer_key("services.rollout.max_tickets") == "services.rollout.max_tickets"  # a full key as given
    assert trainer_key("run.seed") == "run.seed"
    with pytest.raises(ValueError, match="sampling and eval"):
        trainer_key("temperature")  # two groups have it: the caller names one
    assert parse_set("sampling.temperature=0.7") == ("services.trainer.sampling.temperature", 0.7)
    assert parse_variant("decoupled:ppo_epochs=2,minibatches=2,is_mode=decoupled") == ("decoupled", {
        "services.trainer.optim.ppo_epochs": 2, "services.trainer.optim.minibatches": 2,
        "services.trainer.loss.is_mode": "decoupled"})


def test_async_vs_sync_checks_every_key_on_the_example_before_running() -> None:
    from bench.async_vs_sync import check_keys, main, overrides, parse_args
    from services.runtime.config import ConfigError

    args = parse_args(["--set", "ppo_epochs=2"])
    args.steps, args.eval_every, args.eval_prompts = 8, 4, 50
    check_keys(overrides(args, 0, 1, 0))  # the shipped keys and the engine's threads all load
    with pytest.raises(ConfigError, match="services.trainer.eval.every"):
        check_keys({"services.trainer.eval_every": 3})  # a moved key names its new place
    with pytest.raises(ConfigError, match="optim.lr"):
        check_keys({"services.trainer.optim.lr": "fast"})
    # main refuses such a key before any run starts (exit 2, nothing launched)
    assert main(["--quick", "--set", "eval_every=3"]) == 2
    assert main(["--quick", "--variant", "x:temperature=0.5"]) == 2


def test_the_example_and_a_resolved_run_file_read_alike(tmp_path: Path) -> None:
    from bench._rlbus_runs import EXAMPLE, example_run_file, resolved_run_file

    runfile = example_run_file(EXAMPLE, ["services.trainer.groups_per_step=4"])
    assert (runfile.model.name, runfile.task.name) == ("tiny-addition", "addition")
    assert runfile.services.trainer.groups_per_step == 4 and runfile.services.trainer.optim.lr == 1e-4
    assert resolved_run_file(tmp_path) is None  # not a run directory
    # what the launcher writes (every key, defaults included) reads back as the same run file
    (tmp_path / "config.resolved.json").write_text(json.dumps(runfile.resolved()))
    assert resolved_run_file(tmp_path) == runfile
    (tmp_path / "config.resolved.json").write_text(json.dumps({"services": {"trainer": {"eval_every": 3}}}))
    assert resolved_run_file(tmp_path) is None  # written by an older rlbus: no figures from it
