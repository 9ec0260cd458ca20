"""``rlbus simulate`` across runs whose lengths or learner threads differ (issue 30 item 7): the learner's
scaling with threads (``Shape.learner_serial_fraction``, fitted from two runs), its cost per trained token
(read from the steps' times against their batches), and predictions with the target run's own completion
lengths (bench/simulate_check.py ``--target-lengths``).

The model cases are hand-computed (Amdahl's law on a learner of 1 s); the fit cases read run directories
written here by hand (tests/loop/test_simulate_pools.py's ``write_run``) with per-step learner times that
follow a line in the batch's tokens, so the fitted rates are known exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from bench.simulate_check import check_runs
from services.launcher.simulate import Simulation
from services.launcher.simulate_fit import (
    FitError,
    fit,
    learner_per_token,
    lengths_of,
    measure,
    predict,
    serial_fraction,
    shape_of,
)
from services.launcher.simulate_model import Rates, Shape
from tests.loop.test_simulate_pools import GROUPS, alone, write_run

replace = msgspec.structs.replace


# --- the learner's scaling with threads ------------------------------------------------------------------

def test_imperfect_scaling_makes_two_threads_less_than_twice_one():
    # on devices of its own (cores 0), a learner of 1 s on one thread; serial fraction 0.5: on two threads
    # it takes 0.5 + 0.5 / 2 = 0.75 s, where perfect scaling (0) says 0.5 s
    shape = Shape(groups_per_step=2, group_size=2, max_new_tokens=4, completion_tokens=2, max_staleness=0,
                  learner_serial_fraction=0.5)
    rates = Rates(learn_fixed_s=1.0, iter_fixed_s=0.01)
    assert Simulation(shape, rates).run(5).learner_s == pytest.approx(1.0)
    assert predict(shape, rates, {"trainer_threads": 2}, steps=5).learner_s == pytest.approx(0.75)
    perfect = replace(shape, learner_serial_fraction=0.0)
    assert predict(perfect, rates, {"trainer_threads": 2}, steps=5).learner_s == pytest.approx(0.5)
    # a --set of the fraction applies to the prediction it comes with
    assert predict(perfect, rates, {"trainer_threads": 2, "learner_serial_fraction": 0.5},
                   steps=5).learner_s == pytest.approx(0.75)


def test_a_shared_two_thread_fit_predicts_its_one_core_pool_by_the_scaling():
    # synchronous on 2 cores: a learner of 2 threads took 1 s with both cores (generation idle). Pinned to a
    # pool of one core with one thread it takes 1 / (0.5 + 0.5 / 2) = 4/3 s at serial fraction 0.5, where
    # perfect scaling says 2 s; and a learner of 2 threads left on the 1-core pool is time-sliced: 2 s
    shape = Shape(groups_per_step=2, group_size=2, max_new_tokens=4, completion_tokens=2, max_staleness=0, cores=2,
                  trainer_threads=2, learner_serial_fraction=0.5)
    rates = Rates(learn_fixed_s=1.0, iter_fixed_s=0.01)
    assert Simulation(shape, rates).run(5).learner_s == pytest.approx(1.0)
    pooled = {"trainer_cores": 1, "trainer_threads": 1}
    assert predict(shape, rates, pooled, steps=5).learner_s == pytest.approx(4 / 3)
    perfect = replace(shape, learner_serial_fraction=0.0)
    assert predict(perfect, rates, pooled, steps=5).learner_s == pytest.approx(2.0)
    assert predict(shape, rates, {"trainer_cores": 1}, steps=5).learner_s == pytest.approx(2.0)


def test_the_serial_fraction_from_two_learner_rates_stays_a_fraction():
    one, two = Shape(trainer_threads=1), Shape(trainer_threads=2)
    for two_thread_s, expected in ((0.75, 0.5), (0.5, 0.0), (0.4, 0.0), (1.0, 1.0), (1.2, 1.0)):
        # 0.4 s: faster than perfect scaling allows; 1.2 s: two threads slower than one (no gain)
        got = serial_fraction((one, Rates(learn_fixed_s=1.0)), (two, Rates(learn_fixed_s=two_thread_s)))
        assert got == pytest.approx(expected), two_thread_s
    four = Shape(trainer_threads=4)  # 2 -> 4 threads at serial 0.5: (0.5 + 0.125) / (0.5 + 0.25)
    assert serial_fraction((two, Rates(learn_fixed_s=0.75)), (four, Rates(learn_fixed_s=0.625))) == pytest.approx(0.5)
    with pytest.raises(FitError, match="no time"):
        serial_fraction((one, Rates()), (two, Rates(learn_fixed_s=1.0)))


def test_the_serial_fraction_must_be_a_fraction():
    with pytest.raises(msgspec.ValidationError, match="learner_serial_fraction"):
        msgspec.convert({"learner_serial_fraction": 1.5}, Shape)


# --- the learner's cost per token ------------------------------------------------------------------------

def test_the_learner_cost_per_token_is_the_slope_of_the_steps_times():
    line = [(t, 2.0 + 0.01 * t) for t in (800, 1200, 1000, 1600, 900, 1400)]
    assert learner_per_token(line) == pytest.approx(0.01)
    assert learner_per_token([(1000, 3.0 + 0.1 * k) for k in range(6)]) == 0.0  # equal batches: no slope
    noise = [(800, 12.0), (1200, 10.0), (1000, 13.0), (1600, 11.5), (900, 10.5), (1400, 12.0)]
    assert learner_per_token(noise) == 0.0  # a slope within its noise is not taken
    assert learner_per_token(line[:4]) == 0.0  # too few steps
    # a line through a negative fixed part: all of it per token, through zero
    steep = [(t, 0.01 * t - 1.0) for t in (800, 1200, 1000, 1600, 900, 1400)]
    slope = learner_per_token(steep)
    assert slope == pytest.approx(sum(t * y for t, y in steep) / sum(t * t for t, _ in steep))


#: a step's batch (2 groups of 4) at these mean completion tokens, and the learner's one-thread time for a
#: batch of T tokens: FIXED + PER_TOKEN * T
TOKENS = [100.0, 150.0, 80.0, 200.0, 120.0, 160.0, 90.0, 180.0, 110.0, 140.0]
FIXED, PER_TOKEN = 2.0, 0.002


def write_steps(d: Path, tokens: list[float], learner_s: list[float], period_s: float = 1.0) -> None:
    """Replace ``d``'s metrics.jsonl by one row per step with these mean completion tokens and learner times."""
    t0 = 1_800_000_000.0
    rows = [{"time": t0 + (k + 1) * period_s, "elapsed_s": (k + 1) * period_s, "time/step_s": s,
             "train/completion_tokens_mean": n, "train/sequences": 8.0, "trainer/staleness_mean": 0.0}
            for k, (n, s) in enumerate(zip(tokens, learner_s, strict=True))]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def one_thread_s(tokens: list[float]) -> list[float]:
    return [FIXED + PER_TOKEN * 8 * n for n in tokens]


def test_two_runs_of_different_thread_counts_give_the_learners_scaling(tmp_path):
    # each part on its own device (cores 0) and the runs' steps/s above what the model can reach, so the fit
    # adds nothing to the learner: its rates are the recorded line. The 2-thread run's learner follows serial
    # fraction 0.4 (0.7 of the one-thread time) on batches of other lengths
    runs = tmp_path / "runs"
    one = write_run(runs / "sync-a", ["services.trainer.max_staleness=0", "services.trainer.devices.num_threads=1"],
                    GROUPS)
    two = write_run(runs / "sync-b", ["services.trainer.max_staleness=0", "services.trainer.devices.num_threads=2"],
                    GROUPS)
    write_steps(one, TOKENS, one_thread_s(TOKENS))
    longer = [n + 60 for n in TOKENS]
    write_steps(two, longer, [0.7 * s for s in one_thread_s(longer)])
    fits = {name: fit(shape_of(d, cores=0), measure(d), steps=8)[:2] for name, d in (("a", one), ("b", two))}
    assert fits["a"][1].learn_per_token_s == pytest.approx(PER_TOKEN, rel=1e-6)
    assert fits["a"][1].learn_fixed_s == pytest.approx(FIXED, rel=1e-6)
    assert fits["b"][1].learn_per_token_s == pytest.approx(0.7 * PER_TOKEN, rel=1e-6)
    assert serial_fraction(fits["a"], fits["b"]) == pytest.approx(0.4, abs=1e-6)
    assert serial_fraction(fits["b"], fits["a"]) == pytest.approx(0.4, abs=1e-6)
    with pytest.raises(FitError, match="different trainer thread counts"):
        serial_fraction(fits["a"], fits["a"])

    figures = check_runs(runs, "sync-a,sync-b", cores=0, sim_steps=8)
    assert figures["scaling_from"] == ["sync-a", "sync-b"]
    assert figures["fitted"]["learner_serial_fraction"] == pytest.approx(0.4, abs=1e-4)
    assert figures["predicted"]["sync-b"]["changes"] == {"trainer_threads": 2.0}
    with pytest.raises(FitError, match="one run, or two different runs"):
        check_runs(runs, "sync-a,sync-a", cores=0, sim_steps=8)
    with pytest.raises(FitError, match="'sync-c' is not a run directory"):
        check_runs(runs, "sync-a,sync-c", cores=0, sim_steps=8)


# --- predictions with the target run's lengths ---------------------------------------------------------------

def test_a_prediction_with_the_target_runs_lengths_draws_them(tmp_path):
    # two synchronous runs of one run file; the target's completions are twice as long (its groups take
    # longer too). The plain prediction draws the fitted run's lengths and reproduces the fitted run; with
    # the target's own, generation and the learner's batch grow and the prediction slows
    runs = tmp_path / "runs"
    sync = ["services.trainer.max_staleness=0"]
    short = write_run(runs / "sync-a", sync, GROUPS)
    doubled = [alone(start, [2 * n for n in ns]) for start, _, ns in GROUPS]
    long = write_run(runs / "sync-b", sync, doubled)
    write_steps(short, TOKENS, one_thread_s(TOKENS), period_s=8.0)
    write_steps(long, [2 * n for n in TOKENS], one_thread_s([2 * n for n in TOKENS]), period_s=14.0)

    shape, rates, reproduced = fit(shape_of(short, cores=0), measure(short), steps=8)
    target = measure(long)
    own = lengths_of(target)
    assert own["length_quantiles"] == target.length_quantiles and own["length_quantiles"] != shape.length_quantiles
    assert own["completion_tokens"] == pytest.approx(2 * shape.completion_tokens)
    plain, with_own = predict(shape, rates, {}, steps=8), predict(shape, rates, own, steps=8)
    assert plain.learner_s == pytest.approx(reproduced.learner_s)
    assert with_own.learner_s == pytest.approx(FIXED + PER_TOKEN * 8 * own["completion_tokens"], rel=1e-6)
    assert with_own.generate_group_s > plain.generate_group_s * 1.5
    assert with_own.steps_per_s < plain.steps_per_s * 0.8

    figures = check_runs(runs, "sync-a", cores=0, sim_steps=8, target_lengths=True)
    row = figures["predicted"]["sync-b"]
    assert row["changes"] == {}
    assert row["predicted_steps_per_s"] == pytest.approx(plain.steps_per_s, rel=1e-3)
    assert row["target_lengths"]["predicted_steps_per_s"] == pytest.approx(with_own.steps_per_s, rel=1e-3)
    assert row["target_lengths"]["error"] == pytest.approx(with_own.steps_per_s / target.steps_per_s - 1, abs=1e-3)
    assert figures["max_abs_error_target_lengths"] == abs(row["target_lengths"]["error"])
    assert "target_lengths" not in check_runs(runs, "sync-a", cores=0, sim_steps=8)["predicted"]["sync-b"]


def test_rlbus_simulate_predicts_with_another_runs_lengths(tmp_path, capsys):
    import argparse

    from services.launcher import simulate_cmd
    from services.runtime.config import ConfigError

    sync = ["services.trainer.max_staleness=0"]
    short = write_run(tmp_path / "short", sync, GROUPS)
    long = write_run(tmp_path / "long", sync, [alone(start, [2 * n for n in ns]) for start, _, ns in GROUPS])
    write_steps(short, TOKENS, one_thread_s(TOKENS), period_s=8.0)
    write_steps(long, [2 * n for n in TOKENS], one_thread_s([2 * n for n in TOKENS]), period_s=14.0)
    parser = argparse.ArgumentParser()
    simulate_cmd.add_parser(parser.add_subparsers())

    def rows(*extra: str) -> list[dict]:
        args = parser.parse_args(["simulate", str(short), "--cores", "0", "--steps", "8", "--set", "max_staleness=0",
                                  *extra])
        assert simulate_cmd.main(args) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["predicted"]

    plain, drawn = rows(), rows("--lengths-from", str(long))
    assert "lengths_from" not in plain[0] and drawn[0]["lengths_from"] == str(long)
    assert drawn[0]["steps_per_s"] < plain[0]["steps_per_s"] * 0.8
    with pytest.raises(ConfigError, match="--lengths-from goes with a RUN_DIR"):
        simulate_cmd.main(parser.parse_args(["simulate", "--plan", "plan.toml", "--lengths-from", str(long)]))
