"""bench/longtail.py: the time split and length distribution read from hand-built spans (pure), and ``--quick`` run
as the real script (four rlbus runs of the tiny addition example: sync and async, everything shared and disjoint
pools), whose figures are read back. No timing thresholds: the figures are the bench's to report."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench._offline_eval import run_task
from bench._time_split import (
    completion_lengths,
    ideal_speedup,
    length_figures,
    percentile,
    step_split,
    tool_figures,
)
from bench.longtail import WORKLOAD_KEYS, WORKLOADS, check_keys, parse_args, side_overrides, trainer_restarts
from services.launcher.cli import resolve_target
from services.launcher.runfile import RunFile
from services.lib.engine.config import AutoEngineConfig
from services.tasks.models import model_params

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "longtail.py"
S = 1_000_000_000  # ns per second


def span(name: str, start: float, end: float, span_id: str, parent: str | None = None, **attrs) -> dict:
    return {"name": name, "span_id": span_id, "parent_id": parent, "start_ns": int(start * S), "end_ns": int(end * S),
            "attributes": attrs}


def sync_run_spans() -> list[dict]:
    """Two synchronous steps: groups at version 0 over [0, 4] s, step 1 learns [5, 7], version 1 applied at 8;
    groups at version 1 over [8, 11], step 2 learns [12, 15], version 2 applied at 17 (and by a second
    engine at 18); an evaluation group that must not count."""
    return [
        span("generate group", 0, 3, "g1", group_id="a", version=0, completion_tokens=[5, 40]),
        span("generate group", 1, 4, "g2", group_id="b", version=0, completion_tokens=[7, 9]),
        span("train step", 5, 7.5, "s1", step=1), span("learner step", 5, 7, "l1", parent="s1"),
        span("apply weights", 7.5, 8, "a1", version=1),
        span("generate group", 8, 11, "g3", group_id="c", version=1, completion_tokens=[3, 512]),
        span("generate group", 8, 60, "e1", group_id="eval-1", version=1, completion_tokens=[999]),
        span("train step", 12, 15.5, "s2", step=2), span("learner step", 12, 15, "l2", parent="s2"),
        span("apply weights", 16, 17, "a2", version=2), span("apply weights", 16, 18, "a3", version=2),
        span("generate group", 18, 30, "g4", group_id="d", version=2, completion_tokens=[1]),  # never trained
    ]


def test_the_split_reads_generation_training_and_weight_sync_per_step():
    split = step_split(sync_run_spans())
    # g: version 0's window 4 s, version 1's 3 s (version 2's trained by no step); t: 2 s and 3 s;
    # w: 8 - 7 = 1 s and 17 - 15 = 2 s (the first engine to apply it)
    assert (split["g_s"], split["t_s"], split["w_s"]) == (3.5, 2.5, 1.5)
    assert split["steps_seen"] == {"g": 2, "t": 2, "w": 2}
    assert ideal_speedup(3.5, 2.5, 1.5) == round(7.5 / 3.5, 3)
    assert ideal_speedup(0, 0, 1) is None
    with pytest.raises(ValueError, match="OTEL_TRACES_SAMPLER=always_on"):
        step_split([s for s in sync_run_spans() if s["name"] != "learner step"])


def test_lengths_leave_out_evaluation_groups_and_show_the_tail():
    lengths = completion_lengths(sync_run_spans())
    assert sorted(lengths) == [1, 3, 5, 7, 9, 40, 512]
    f = length_figures(lengths, limit=512)
    assert (f["count"], f["max"], f["p50"], f["at_limit_frac"]) == (7, 512, 7.0, round(1 / 7, 4))
    assert f["p50"] <= f["p90"] <= f["p99"] <= f["max"] and f["max_over_p50"] == round(512 / 7, 2)
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([7], 99) == 7
    assert length_figures([]) == {"count": 0}


def test_tool_time_is_the_rollouts_sandbox_calls_over_its_episodes():
    def on(service: str, d: dict) -> dict:
        return {**d, "service": service}
    spans = [
        on("rollout", span("episode", 0, 10, "e1")), on("rollout", span("episode", 2, 8, "e2")),
        on("rollout", span("sandbox.create", 0, 0.5, "c1", parent="e1")),
        on("rollout", span("sandbox.exec", 4, 5.5, "x1", parent="e1")),
        on("rollout", span("sandbox.exec", 3, 3.5, "x2", parent="e2")),
        on("judge", span("sandbox.fork", 11, 14, "f1")),  # the judge's calls are not the episode's
    ]
    f = tool_figures(spans)
    # episodes 10 + 6 = 16 s; the rollout's calls 0.5 + 1.5 + 0.5 = 2.5 s
    assert (f["episodes"], f["calls_per_episode"], f["episode_s_mean"]) == (2, 1.5, 8.0)
    assert (f["tool_s_per_episode"], f["tool_share"]) == (1.25, round(2.5 / 16, 4))
    assert f["p50_ms_by_call"] == {"create": 500.0, "exec": 1000.0}
    assert tool_figures([on("judge", span("sandbox.exec", 0, 1, "x"))]) == {"episodes": 0}


def test_the_coding_workload_gets_a_batch_whose_episodes_overlap_and_no_offline_eval():
    args = parse_args(["--workload", "coding"])
    assert args.example.name == "coding.toml" and args.eval_every == 0
    keys = side_overrides(args, RunFile.load(args.example, env={}), "async", "shared")
    assert {k: keys[k] for k in WORKLOAD_KEYS["coding"]} == WORKLOAD_KEYS["coding"]
    assert keys["services.trainer.checkpoint_every"] == 0  # nothing kept for an evaluation that does not run
    with pytest.raises(SystemExit):
        parse_args(["--workload", "coding", "--eval-every", "3"])  # its hidden tests need the run's sandboxes
    quick = parse_args(["--quick", "--workload", "coding"])  # the tiny addition example: not the coding batch
    assert "services.trainer.groups_per_step" not in side_overrides(quick, RunFile.load(quick.example, env={}),
                                                                    "sync", "shared")


def test_a_layout_without_evaluation_gives_throughput_beside_the_ideal_and_no_same_reward_figures(tmp_path):
    from bench._rlbus_runs import RunResult
    from bench.longtail import layout_figures

    split = {"g_s": 20.0, "t_s": 25.0, "w_s": 2.0, "period_s": 50.0}
    sync = RunResult("sync", tmp_path, [], {"last_step_s": 1000.0}, 1.0)
    async_ = RunResult("async", tmp_path, [], {"last_step_s": 625.0}, 1.0)
    f = layout_figures({"split": split}, {}, sync, async_, None)
    assert f == {"ideal_speedup": 1.88, "measured_speedup": 1.6, "measured_over_ideal": round(1.6 / 1.88, 3),
                 "ideal_speedup_of_period": 2.0}


def test_the_longtail_example_asks_for_reasoning_up_to_512_tokens_on_vllm():
    path = WORKLOADS["longtail"]
    assert Path(resolve_target("longtail")) == path  # `rlbus run longtail` finds it
    runfile = RunFile.load(path, env={})
    runfile.check()
    cfg, engine = runfile.services.trainer, runfile.services.rollout.engine
    assert (runfile.model.name, runfile.task.name, cfg.sampling.max_new_tokens) == ("smollm2", "word_problems", 512)
    assert isinstance(engine, AutoEngineConfig) and engine.picks_vllm(model_params(runfile.model.name))
    prompt = run_task(runfile).eval_prompts()[0]
    assert "step by step" in prompt.messages[-1]["content"] and cfg.eval.prompts <= len(run_task(runfile).eval_prompts())


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the pooled layout needs two CPUs")
@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_every_side_of_each_workload_passes_the_start_up_checks(workload):
    args = parse_args(["--workload", workload])
    runfile = RunFile.load(args.example, env={})
    for mode in ("sync", "async"):
        for layout in ("shared", "pooled"):
            keys = side_overrides(args, runfile, mode, layout)
            check_keys(args.example, keys)  # the placement and its thread rule hold (the example's 2 threads set to 0)
            assert keys["services.trainer.max_staleness"] == (0 if mode == "sync" else 1)
            assert ("placement.trainer.cpus" in keys) == (layout == "pooled")


def test_a_restarted_trainer_is_counted_from_its_clock_going_back():
    steps = [{"step": i, "elapsed_s": t, "trainer/version": i} for i, t in [(1, 10.0), (2, 20.0), (2, 3.0), (3, 9.0)]]
    evals = [{"step": 0, "elapsed_s": 1.0, "eval/reward": 0.1}]  # not a step line
    assert trainer_restarts(evals + steps) == 1 and trainer_restarts(steps[:2]) == 0


def test_arguments_name_what_is_wrong():
    args = parse_args(["--quick"])
    assert args.example.name == "addition.toml" and (args.steps, args.eval_every, args.eval_prompts) == (6, 3, 20)
    assert parse_args(["--workload", "agentic"]).example.name == "tool_use.toml"
    assert parse_args([]).example.name == "longtail.toml"
    assert parse_args(["--modes", "async,sync", "--layouts", "pooled"]).modes == ["sync", "async"]
    sets = parse_args(["--set", "services.trainer.optim.varlen_attention=false", "--set", "run.id=x y"]).sets
    assert sets == {"services.trainer.optim.varlen_attention": False, "run.id": "x y"}
    with_set = parse_args(["--quick", "--set", "services.trainer.optim.lr=0.5"])
    assert side_overrides(with_set, RunFile.load(with_set.example, env={}), "sync", "shared")[
        "services.trainer.optim.lr"] == 0.5
    for bad in (["--modes", "fast"], ["--layouts", ""], ["--steps", "0"], ["--eval-every", "-1"], ["--set", "=1"],
                ["--phase", "evaluate"],  # nothing to read the runs from
                ["--phase", "run", "--eval-every", "0", "--work-dir", "/tmp/x"],  # no versions: nothing to split
                ["--eval-engine", "tgi"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_a_run_phase_then_an_evaluate_phase_give_one_invocations_figures(tmp_path):
    """``--phase run`` runs the sides and keeps their versions (no curve yet); ``--phase evaluate`` with the
    same arguments reads those runs back, evaluates them and prints every figure, the same throughput too."""
    common = [sys.executable, str(SCRIPT), "--quick", "--modes", "sync,async", "--layouts", "shared",
              "--work-dir", str(tmp_path)]
    ran = subprocess.run([*common, "--phase", "run"], capture_output=True, text=True, timeout=900, cwd=REPO)
    assert ran.returncode == 0, ran.stderr[-3000:]
    first = json.loads(ran.stdout.strip().splitlines()[-1])
    assert first["phase"] == "run" and first["eval_engine"] is None
    assert all(side["curve"] == [] for side in first["sides"].values())
    assert "time_ratio" not in first["layouts"]["shared"] and first["layouts"]["shared"]["measured_speedup"] > 0
    for name in ("sync-shared", "async-shared"):  # the versions and their write times stay for the second phase
        kept = tmp_path / name / "bench_versions"
        assert (kept / "step-000003" / "config.json").is_file() and (kept / "write_s.json").is_file()
        assert not (tmp_path / name / "checkpoints").exists() and not (tmp_path / name / "nats").exists()
    evaluated = subprocess.run([*common, "--phase", "evaluate"], capture_output=True, text=True, timeout=900, cwd=REPO)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    second = json.loads(evaluated.stdout.strip().splitlines()[-1])
    assert second["phase"] == "evaluate" and second["eval_engine"] == "hf"
    for name, side in second["sides"].items():
        assert [p[0] for p in side["curve"]] == [0, 3, 6], name  # the initial model and the kept versions
        assert side["last_step_s"] == first["sides"][name]["last_step_s"]  # the same runs, read back
        assert side["checkpoint_write_s_mean"] is not None, name
    shared = second["layouts"]["shared"]
    assert shared["measured_speedup"] == first["layouts"]["shared"]["measured_speedup"]
    assert "time_ratio" in shared and 0 <= shared["target"] <= 1


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the pooled layout needs two CPUs")
def test_quick_runs_every_side_and_reports_the_split_lengths_and_ratios(tmp_path):
    r = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--work-dir", str(tmp_path)], capture_output=True,
                       text=True, timeout=900, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["bench"] == "longtail" and out["example"] == "examples/addition.toml"
    assert set(out["sides"]) == {"sync-shared", "async-shared", "sync-pooled", "async-pooled"}
    for name, side in out["sides"].items():
        assert side["steps"] == out["steps"] == 6 and side["trainer_restarts"] == 0, name
        lengths = side["lengths"]
        assert lengths["count"] >= out["sample_budget"], name  # every generated sample's length was traced
        assert 1 <= lengths["p50"] <= lengths["p90"] <= lengths["p99"] <= lengths["max"] <= out["max_new_tokens"]
        assert [p[0] for p in side["curve"]][0] == 0 and side["curve"][-1][0] == 6  # evaluated offline
    for layout in ("shared", "pooled"):
        split = out["sides"][f"sync-{layout}"]["split"]
        assert split["g_s"] > 0 and split["t_s"] > 0 and split["w_s"] > 0
        assert split["steps_seen"]["t"] == split["steps_seen"]["g"] == 6
        f = out["layouts"][layout]
        assert f["ideal_speedup"] >= 1 and f["ideal_speedup_of_period"] >= 1 and math.isfinite(f["measured_over_ideal"]) and f["measured_over_ideal"] > 0
    assert set(out["pooled_vs_shared"]) == {"sync", "async"}
    # the pooled sides ran pinned: the trainer on one core, the rest on the other, torch threads following it
    trainer_cpu, rollout_cpu = out["pool_cpus"]
    resolved = json.loads((tmp_path / "async-pooled" / "config.resolved.json").read_text())
    assert resolved["placement"]["trainer"]["cpus"] == str(trainer_cpu)
    assert {resolved["placement"][n]["cpus"] for n in ("rollout", "judge", "weightsync")} == {str(rollout_cpu)}
    assert resolved["services"]["trainer"]["devices"]["num_threads"] == 0
    assert "placement" not in json.loads((tmp_path / "async-shared" / "config.resolved.json").read_text()) or not \
        json.loads((tmp_path / "async-shared" / "config.resolved.json").read_text())["placement"]


def test_pruning_a_run_frees_its_checkpoints_and_store_but_keeps_what_the_figures_read(tmp_path):
    from bench._rlbus_runs import prune_run_files

    run = tmp_path / "run"
    ckpt, kept = run / "checkpoints" / "step-000005", run / "bench_versions" / "step-000005"
    (ckpt / "dcp").mkdir(parents=True)
    kept.mkdir(parents=True)
    (ckpt / "dcp" / "__0_0.distcp").write_bytes(b"o" * 3000)  # optimiser state: only here
    (ckpt / "model.safetensors").write_bytes(b"w" * 1000)
    os.link(ckpt / "model.safetensors", kept / "model.safetensors")  # as the version keeper keeps it
    (run / "nats" / "jetstream").mkdir(parents=True)
    (run / "nats" / "jetstream" / "blk").write_bytes(b"n" * 500)
    (run / "metrics.jsonl").write_text("{}\n")
    assert prune_run_files(run) == 3500  # the kept version's bytes are not freed: its link stays
    assert not (run / "checkpoints").exists() and not (run / "nats").exists()
    assert (kept / "model.safetensors").read_bytes() == b"w" * 1000 and (run / "metrics.jsonl").is_file()
    assert prune_run_files(run) == 0  # nothing left to remove: not an error
