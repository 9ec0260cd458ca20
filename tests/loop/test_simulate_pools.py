"""``rlbus simulate`` on the long-tail and pooled workloads (issue 30 item 7): disjoint core pools, the run's
own completion-length distribution, the engine's iteration cost read from group times, and
bench/simulate_check.py's check of existing run directories.

The model cases are hand-computed (a learner alone on its pool runs at its uncontended speed; a pool left
idle is lost to the part pinned beside it); the fit cases read run directories written here by hand, in
the files and fields a real run writes (config.resolved.json, metrics.jsonl, traces/*.jsonl).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from services.launcher.simulate import Simulation
from services.launcher.simulate_fit import FitError, fit, measure, predict, shape_of
from services.launcher.simulate_model import Rates, Shape
from services.launcher.simulate_traces import iteration_costs, quantiles

REPO = Path(__file__).resolve().parents[2]
replace = msgspec.structs.replace


# --- disjoint pools ------------------------------------------------------------------------------

def test_a_trainer_with_its_own_core_learns_at_full_speed_beside_busy_generation():
    # asynchronous, two cores, the learner (1 s a step) and the engine each want one core; the judge's work
    # (0.03 s a sample) comes on top. Shared, the three take turns on two cores and the learner slows;
    # pooled, the judge and the engine share the other core and the learner runs as on a device of its own
    shape = Shape(groups_per_step=4, group_size=4, max_new_tokens=16, completion_tokens=8, max_staleness=1, cores=2)
    rates = Rates(learn_fixed_s=1.0, iter_fixed_s=0.02, judge_per_sample_s=0.03)
    shared = Simulation(shape, rates).run(30)
    pooled = Simulation(replace(shape, trainer_cores=1), rates).run(30)
    own_devices = Simulation(replace(shape, cores=0), rates).run(30)
    assert shared.learner_s > 1.03 and pooled.learner_s == pytest.approx(1.0)
    assert pooled.steps_per_s > shared.steps_per_s * 1.03
    assert pooled.steps_per_s == pytest.approx(own_devices.steps_per_s, rel=0.02)


def test_with_one_side_idle_a_pool_gives_nothing_and_an_idle_pool_is_lost():
    # synchronous: generation and learning take turns. Each wanting one core, each gets one either way
    shape = Shape(groups_per_step=4, group_size=4, max_new_tokens=16, completion_tokens=8, max_staleness=0, cores=2)
    rates = Rates(learn_fixed_s=1.0, iter_fixed_s=0.02)
    shared = Simulation(shape, rates).run(20)
    pooled = Simulation(replace(shape, trainer_cores=1), rates).run(20)
    assert pooled.steps_per_s == pytest.approx(shared.steps_per_s) and pooled.sim_s == pytest.approx(shared.sim_s)
    # a learner that wants both cores has both while the engine idles, shared; pinned to one, it takes twice
    # as long (the engine's idle core is lost to it)
    wide = replace(shape, trainer_threads=2)
    shared, pooled = Simulation(wide, rates).run(20), Simulation(replace(wide, trainer_cores=1), rates).run(20)
    assert shared.learner_s == pytest.approx(1.0) and pooled.learner_s == pytest.approx(2.0)
    assert pooled.steps_per_s < shared.steps_per_s


def test_tenants_of_lower_priority_take_only_the_idle_cores():
    # two cores, other tenants wanting both. Sharing fairly, a one-thread learner gets 2/3 of a core (1.5 s
    # for 1 s of work); tenants at nice 19 leave it its core and take the other (and its pool's idle time)
    shape = Shape(groups_per_step=2, group_size=2, max_new_tokens=4, completion_tokens=2, max_staleness=0, cores=2,
                  background=2)
    rates = Rates(learn_fixed_s=1.0, iter_fixed_s=0.01)
    fair, yielding = Simulation(shape, rates).run(10), Simulation(replace(shape, background_yields=True), rates).run(10)
    assert fair.learner_s == pytest.approx(1.5) and yielding.learner_s == pytest.approx(1.0)
    assert yielding.background_cores == pytest.approx(1.0, abs=0.01)  # one part busy at a time: one core idle
    pooled = Simulation(replace(shape, background_yields=True, trainer_cores=1), rates).run(10)
    assert pooled.learner_s == pytest.approx(1.0) and pooled.background_cores == pytest.approx(1.0, abs=0.01)


def test_a_trainer_pool_must_leave_cores_for_the_rest():
    with pytest.raises(ValueError, match="trainer_cores = 2 needs cores > trainer_cores"):
        Shape(cores=2, trainer_cores=2)
    with pytest.raises(msgspec.ValidationError, match="cores > trainer_cores"):
        msgspec.convert({"trainer_cores": 1}, Shape)  # cores 0: each part on its own device, no pools
    with pytest.raises(msgspec.ValidationError, match="must not decrease"):
        msgspec.convert({"length_quantiles": [4, 2]}, Shape)
    with pytest.raises(msgspec.ValidationError, match="length"):
        msgspec.convert({"length_quantiles": list(range(100))}, Shape)  # a plan file stays small


# --- completion lengths ----------------------------------------------------------------------------

#: most completions 16 tokens, one in 32 between 100 and 400: a tail
TAIL = [16.0] * 30 + [24.0, 100.0, 400.0]
TAIL_MEAN = sum((a + b) / 2 for a, b in zip(TAIL, TAIL[1:], strict=False)) / (len(TAIL) - 1)  # 24.875


def test_lengths_are_drawn_from_the_quantiles_within_the_budget():
    sim = Simulation(Shape(length_quantiles=TAIL, max_new_tokens=512), Rates())
    drawn = [sim.seq_length() for _ in range(20000)]
    assert sum(drawn) / len(drawn) == pytest.approx(TAIL_MEAN, rel=0.05)
    assert min(drawn) == 16 and max(drawn) <= 400 and max(drawn) > 300
    assert sum(n > 24 for n in drawn) / len(drawn) == pytest.approx(2 / 32, abs=0.01)
    capped = Simulation(Shape(length_quantiles=TAIL, max_new_tokens=64), Rates())
    assert max(capped.seq_length() for _ in range(2000)) == 64
    fixed = Simulation(Shape(length_quantiles=[7.0]), Rates())
    assert {fixed.seq_length() for _ in range(100)} == {7}


def test_a_tail_slows_a_synchronous_step_and_asynchronous_training_hides_it():
    # the same mean length; a synchronous step waits for its longest completion (32 a step: about one
    # from the tail), an asynchronous one trains on whichever groups are done while the long ones finish
    gauss = Shape(groups_per_step=4, group_size=8, max_new_tokens=512, completion_tokens=TAIL_MEAN, max_staleness=0)
    tail = replace(gauss, length_quantiles=TAIL)
    rates = Rates(learn_fixed_s=2.0, iter_fixed_s=0.01)
    sync_gauss, sync_tail = Simulation(gauss, rates).run(40), Simulation(tail, rates).run(40)
    assert sync_tail.steps_per_s < sync_gauss.steps_per_s * 0.75
    async_gauss = Simulation(replace(gauss, max_staleness=2), rates).run(40)
    async_tail = Simulation(replace(tail, max_staleness=2), rates).run(40)
    assert async_tail.steps_per_s == pytest.approx(async_gauss.steps_per_s, rel=0.03)
    assert async_tail.dropped_groups == 0 and max(async_tail.staleness) <= 2
    assert async_tail.steps_per_s / sync_tail.steps_per_s > 1.5 * async_gauss.steps_per_s / sync_gauss.steps_per_s


# --- what the fit reads from a run directory -----------------------------------------------------------

SERVICES = ["launcher.services={trainer=1,rollout=1,judge=1}", "services.trainer.groups_per_step=2",
            "services.trainer.group_size=4", "services.trainer.sampling.max_new_tokens=512"]
POOLED = ['placement.trainer.cpus="0-1"', 'placement.rollout.cpus="2"', 'placement.judge.cpus="3"',
          "services.trainer.devices.num_threads=0"]


def write_run(d: Path, overrides: list[str], groups: list[tuple[float, float, list[int]]], *, steps: int = 10,
              learner_s: float = 1.0, period_s: float = 2.0, staleness: float = 0.0) -> Path:
    """A run directory as ``rlbus run`` leaves one: the resolved run file, a metrics line per step and the
    rollout's ``generate group`` spans (start s, duration s, each sample's tokens; one eval group too)."""
    from services.launcher.runfile import RunFile

    d.mkdir(parents=True)
    resolved = RunFile.load(None, env={}, overrides=[*SERVICES, *overrides]).resolved()
    (d / "config.resolved.json").write_text(json.dumps(resolved))
    t0 = 1_800_000_000.0
    lengths = [n for _, _, ns in groups for n in ns]
    rows = [{"time": t0 + k * period_s, "elapsed_s": k * period_s, "time/step_s": learner_s,
             "train/completion_tokens_mean": sum(lengths) / len(lengths), "trainer/staleness_mean": staleness}
            for k in range(1, steps + 1)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    spans = [{"name": "generate group", "service": "rollout", "span_id": f"g{i}", "parent_id": None,
              "start_ns": int((t0 + start) * 1e9), "end_ns": int((t0 + start + dur) * 1e9),
              "attributes": {"group_id": f"g{i:08d}", "version": i, "completion_tokens": ns}}
             for i, (start, dur, ns) in enumerate(groups)]
    spans.append({"name": "generate group", "service": "rollout", "span_id": "e0", "parent_id": None,
                  "start_ns": int((t0 + 10_000) * 1e9), "end_ns": int((t0 + 10_001) * 1e9),
                  "attributes": {"group_id": "eval-v000000-0000", "version": 0, "completion_tokens": [999]}})
    (d / "traces").mkdir()
    (d / "traces" / "rollout-100.jsonl").write_text("".join(json.dumps(s) + "\n" for s in spans))
    return d


#: a decode iteration: 20 ms, plus 2 ms per running sequence
A, B = 0.02, 0.002


def alone(start: float, ns: list[int]) -> tuple[float, float, list[int]]:
    """A group with the engine to itself: its longest sequence's iterations, each costing A + B x the
    sequences still running (summed over the iterations, that is every token of the group)."""
    return start, A * max(ns) + B * sum(ns), ns


GROUPS = [alone(10.0 * i, ns) for i, ns in enumerate(
    [[16, 16, 16, 400], [10, 20, 30, 40], [16, 16, 16, 16], [5, 100, 100, 200], [50, 50, 60, 300],
     [16, 30, 16, 30], [8, 8, 8, 120], [40, 40, 40, 40], [3, 300, 5, 5], [16, 16, 24, 100]])]


def test_the_iteration_cost_per_sequence_is_read_from_groups_of_unequal_lengths(tmp_path):
    spans = [{"name": "generate group", "service": "rollout", "process": "rollout-1", "start_ns": int(s * 1e9),
              "end_ns": int((s + dur) * 1e9), "attributes": {"group_id": f"g{i}", "completion_tokens": ns}}
             for i, (s, dur, ns) in enumerate(GROUPS)]
    a, b = iteration_costs(spans, skip_fraction=0.0)
    assert a == pytest.approx(A, rel=1e-3) and b == pytest.approx(B, rel=1e-3)
    # a group slowed by something else (five times its time) is left out of the fit
    slowed = [*spans[:4], {**spans[4], "end_ns": spans[4]["start_ns"] + 5 * (spans[4]["end_ns"] - spans[4]["start_ns"])},
              *spans[5:]]
    a, b = iteration_costs(slowed, skip_fraction=0.0)
    assert a == pytest.approx(A, rel=1e-3) and b == pytest.approx(B, rel=1e-3)
    # times that follow the longest completion only: no cost per sequence to see
    longest = [{**s, "end_ns": s["start_ns"] + int(0.03 * max(s["attributes"]["completion_tokens"]) * 1e9)} for s in spans]
    assert iteration_costs(longest, skip_fraction=0.0) is None
    # equal lengths everywhere: the batch never drains, the two costs cannot be told apart
    flat = [{**s, "attributes": {**s["attributes"], "completion_tokens": [16] * 4}} for s in spans]
    assert iteration_costs(flat) is None
    assert iteration_costs(spans[:3]) is None  # too few groups


def test_a_fit_reads_the_pools_from_the_placement_and_the_lengths_from_the_traces(tmp_path):
    pooled = shape_of(write_run(tmp_path / "pooled", POOLED, GROUPS), cores=4)
    assert pooled.trainer_cores == 2 and pooled.cores == 4
    assert pooled.trainer_threads == 2  # torch follows the placement: its two CPUs
    shared = shape_of(write_run(tmp_path / "shared", ["services.trainer.devices.num_threads=2"], GROUPS), cores=4)
    assert shared.trainer_cores == 0 and shared.trainer_threads == 2
    # a service left unpinned may run on the trainer's CPUs, and so may one pinned beside it: one pool
    unpinned = write_run(tmp_path / "unpinned", POOLED[:2], GROUPS)
    overlap = write_run(tmp_path / "overlap", [*POOLED[:2], 'placement.judge.cpus="1"'], GROUPS)
    assert shape_of(unpinned, cores=4).trainer_cores == 0 and shape_of(overlap, cores=4).trainer_cores == 0
    with pytest.raises(FitError, match="--cores"):
        shape_of(tmp_path / "pooled", cores=2)  # a 2-CPU trainer pool on a 2-core machine

    measured = measure(tmp_path / "pooled")
    training = [n for _, _, ns in GROUPS for n in ns]  # the eval group's 999 is not among them
    assert measured.length_quantiles == quantiles(training)
    assert len(measured.length_quantiles) == 33
    assert measured.length_quantiles[0] == min(training) and measured.length_quantiles[-1] == max(training)
    # the first fifth of the groups (cold start) is not fitted; the rest still pin both costs
    assert measured.iter_fixed_s == pytest.approx(A, rel=1e-3) and measured.iter_per_seq_s == pytest.approx(B, rel=1e-3)
    fitted, rates, _ = fit(pooled, measured, steps=10)
    assert fitted.length_quantiles == measured.length_quantiles and fitted.trainer_cores == 2
    assert rates.iter_per_seq_s / rates.iter_fixed_s == pytest.approx(B / A, rel=1e-6)  # the ratio is kept
    # one thread instead of two: the learner's work takes 1 / (0.3 + 0.7 / 2) = 1.54 times as long (the default
    # serial fraction, 0.3; tests/loop/test_simulate_scaling.py has the scaling's cases)
    one = predict(fitted, rates, {"trainer_threads": 1, "max_staleness": 0}, steps=10)
    two = predict(fitted, rates, {"max_staleness": 0}, steps=10)
    assert one.learner_s > two.learner_s * 1.5


def test_simulate_check_fits_one_run_directory_and_predicts_the_others(tmp_path):
    runs = tmp_path / "runs"
    sync = ["services.trainer.max_staleness=0"]
    # a synchronous step: two groups of GROUPS' lengths in one batch (about 4.6 s), then the 1 s learner
    write_run(runs / "sync-pooled", [*POOLED, *sync], GROUPS, period_s=5.6)
    write_run(runs / "async-pooled", POOLED, GROUPS, period_s=4.0, staleness=0.9)
    write_run(runs / "sync-shared", ["services.trainer.devices.num_threads=2", *sync], GROUPS, learner_s=0.7,
              period_s=5.0)
    write_run(runs / "async-shared", ["services.trainer.devices.num_threads=2"], GROUPS, steps=3)  # still going
    out = subprocess.run([sys.executable, str(REPO / "bench" / "simulate_check.py"), "--runs", str(runs),
                          "--cores", "4", "--sim-steps", "10"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert figures["fitted_on"] == "sync-pooled"  # the first synchronous run by name
    assert abs(figures["fitted"]["error"]) < 0.1
    predicted = figures["predicted"]
    assert set(predicted) == {"async-pooled", "sync-shared"}
    assert "async-shared" in figures["skipped"] and "at least 5" in figures["skipped"]["async-shared"]
    assert predicted["async-pooled"]["changes"] == {"max_staleness": 1}
    assert predicted["sync-shared"]["changes"] == {"trainer_cores": 0.0}  # two threads in both
    # asynchronous overlaps the pooled run's generation with its learner: faster than the synchronous fit
    assert predicted["async-pooled"]["predicted_steps_per_s"] > figures["fitted"]["measured_steps_per_s"] * 1.2
    assert predicted["async-pooled"]["predicted_staleness"] > 0
    for row in predicted.values():
        assert row["error"] == pytest.approx(row["predicted_steps_per_s"] / row["measured_steps_per_s"] - 1, abs=1e-3)
    assert figures["within_15pct"] == (figures["max_abs_error"] <= 0.15)
    # a directory with one run is refused, saying why
    lone = tmp_path / "lone"
    write_run(lone / "sync-pooled", [*POOLED, *sync], GROUPS)
    out = subprocess.run([sys.executable, str(REPO / "bench" / "simulate_check.py"), "--runs", str(lone)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "holds 1 run directory" in out.stderr
