"""The simulator's rates, taken from a run directory (``rlbus simulate RUN_DIR``).

A finished (or stopped) run directory holds what the model needs: ``config.resolved.json`` (the batch,
staleness and fleet), ``metrics.jsonl`` (each step's learner and publish time, completion lengths,
steps/s) and ``traces/*.jsonl`` (generation spans per prompt group, weight applies, the bus hops of
each sample). What a run records is contended time: on a shared machine a learner step is slower while
the engine generates. So the rates are *fitted*: the run itself is simulated, and the uncontended rates
are scaled until the simulation shows the recorded learner time, group generation time and steps/s.
The judge's CPU per sample, which no record shows directly, is the free figure that matches steps/s.
Then the fitted rates predict other settings (``--set max_staleness=0``, ``--set engines=2``).

The completion lengths are the run's own (``Shape.length_quantiles`` from the traces' ``generate group``
spans), so a heavy tail keeps its weight in the predictions. How an engine's iteration cost grows with its
batch shows only where lengths differ (a group's batch drains while its longest sequence runs):
:func:`services.launcher.simulate_traces.iteration_costs` takes the ratio of its per-sequence to its fixed
part from the group times; where the traces cannot tell them apart (equal lengths), ``iter_per_seq_s`` is
kept at 0 and only the iteration's total cost is fitted. The learner's cost per trained token shows the same
way: with heavy-tailed lengths each step's batch holds a different number of tokens, and the steps' times
against them (:func:`learner_per_token`) split the learner into a fixed and a per-token part; where they do
not show one clearly (equal lengths), the learner is one fixed time per step. Then a prediction with other
lengths (``--set completion_tokens``/``length_quantiles``, or another run's: :func:`lengths_of`) changes the
learner's work too. What one run cannot show: how the learner scales with its threads
(``Shape.learner_serial_fraction``); :func:`serial_fraction` takes it from two runs of different thread
counts. A plan file (``rlbus simulate --plan``) gives every curve explicitly.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import Any

import msgspec

from services.launcher import simulate_traces as traces
from services.launcher.simulate import Simulation
from services.launcher.simulate_model import Rates, Result, Shape

#: steps skipped at the start of a run (model load, first compiles, cold caches)
WARMUP_FRACTION = 0.2


class FitError(ValueError):
    """The run directory lacks what the fit needs; the message says what."""


class Measured(msgspec.Struct, kw_only=True):
    """What the run recorded (after warm-up)."""

    steps: int
    steps_per_s: float
    learner_s: float
    publish_s: float
    commit_s: float
    completion_tokens: float
    staleness_mean: float
    generate_group_s: float
    apply_s: float
    transfer_s: float
    pipeline_latency_s: float
    #: CPU seconds per trained sample over the same window (usage.jsonl; 0 without it)
    judge_cpu_per_sample: float
    nats_cpu_per_sample: float
    trainer_cpu_per_sample: float
    #: cores other tenants of the machine kept busy over the window (0 without usage.jsonl)
    background_cores: float
    #: the training samples' completion lengths at FIT_QUANTILES evenly spaced quantiles (the ``generate group``
    #: spans' ``completion_tokens``; [] when the traces have none)
    length_quantiles: list[float] = []
    #: a decode iteration's cost, fixed and per running sequence, from the groups' durations against their
    #: lengths (simulate_traces.iteration_costs; 0, 0 where the traces cannot tell them apart)
    iter_fixed_s: float = 0.0
    iter_per_seq_s: float = 0.0
    #: the learner's seconds per trained completion token, from the steps' times against their batches' tokens
    #: (:func:`learner_per_token`; 0 where the steps do not show one clearly)
    learner_per_token_s: float = 0.0


def shape_of(run_dir: Path, cores: float | None = None) -> Shape:
    """The run's batch, staleness, fleet and core pools, from ``config.resolved.json`` (every key, defaults
    included): ``trainer_cores`` is the trainer's ``[placement]`` CPU count where every other service of the
    run is pinned to other CPUs; thread counts left at 0 follow the placement. ``cores``: the machine's
    (default: this one's)."""
    from services.launcher.runfile import RunFile
    from services.runtime.config import ConfigError

    path = run_dir / "config.resolved.json"
    if not path.is_file():
        raise FitError(f"{run_dir} has no config.resolved.json: not a run directory (rlbus run writes one)")
    try:
        rf = RunFile.from_tree(json.loads(path.read_text()))
    except (ConfigError, ValueError) as e:
        raise FitError(f"{path} does not load in this rlbus (written by an older one?): {e}") from None
    trainer, rollout, services = rf.services.trainer, rf.services.rollout, rf.launcher.services
    engine = rollout.engine
    cores = float(os.cpu_count() or 1) if cores is None else cores
    own = _trainer_pool(rf)
    if own and cores and own >= cores:
        raise FitError(f"the run's trainer had {own} CPUs of its own ([placement] trainer.cpus) but the machine "
                       f"is given {cores:g} cores: pass the run's machine's cores with --cores")
    return Shape(
        groups_per_step=trainer.groups_per_step, group_size=trainer.group_size,
        max_new_tokens=trainer.sampling.max_new_tokens or _task_budget(rf), max_staleness=trainer.max_staleness,
        engines=max(1, services.get("rollout", 1)), judges=max(1, services.get("judge", 1)),
        max_tickets=rollout.max_tickets,
        max_batch=getattr(engine, "max_batch_size", None) or getattr(engine, "max_num_seqs", None) or 128,
        engine_threads=_threads(getattr(engine, "num_threads", 1), rf, "rollout"),
        trainer_threads=_threads(trainer.devices.num_threads, rf, "trainer"),
        overlap_publish=trainer.overlap_publish, cores=cores, trainer_cores=float(own) if cores else 0.0)


def _placed_cpus(rf: Any, name: str) -> list[int]:
    """The CPUs ``[placement.<name>]`` pins service ``name``'s instances to ([]: not pinned)."""
    entry = rf.placement.get(name)
    return entry.cpu_list(f"placement.{name}") if entry is not None else []


def _trainer_pool(rf: Any) -> int:
    """How many CPUs the trainer has to itself: its placement's, when every other service of the run is
    pinned to other CPUs (0: the trainer shares the machine; an unpinned service may run anywhere)."""
    own = set(_placed_cpus(rf, "trainer"))
    if not own or "trainer" not in rf.launcher.services:
        return 0
    for name, count in rf.launcher.services.items():
        if name == "trainer" or (count < 1 and name not in rf.launcher.autoscale):
            continue
        cpus = set(_placed_cpus(rf, name))
        if not cpus or cpus & own:
            return 0
    return len(own)


def _threads(explicit: int | None, rf: Any, name: str) -> float:
    """Cores a busy part of service ``name`` wants: its explicit torch thread count, else (0: torch follows
    the placement) its placement's thread count or CPUs, else 1."""
    entry = rf.placement.get(name)
    if explicit or entry is None:
        return float(explicit or 1)
    per_instance = entry.cpus_per_instance or len(_placed_cpus(rf, name)) // max(1, rf.launcher.services.get(name, 1))
    return float(entry.threads or per_instance or 1)


def _task_budget(rf: Any) -> int:
    """The task's own completion budget (``[services.trainer] sampling.max_new_tokens = 0``; a mixture: the
    largest of its environments'); 64 when a task cannot be built here."""
    from services.tasks import get_task

    try:
        return max(int(get_task(e.name, **e.options).max_new_tokens) for e in rf.task.entries())
    except Exception:  # a task of another package, or options pointing at data not on this machine
        return 64


def measure(run_dir: Path) -> Measured:
    """The recorded figures, warm-up steps left out."""
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    steps = [r for r in rows if "time/step_s" in r]
    if len(steps) < 5:
        raise FitError(f"{path} has {len(steps)} training steps; the fit needs at least 5 (run longer)")
    kept = steps[int(len(steps) * WARMUP_FRACTION):]
    span = kept[-1]["elapsed_s"] - kept[0]["elapsed_s"]
    spans = traces.read_spans(run_dir / "traces")
    gen = traces.groups(spans)
    if not gen:
        raise FitError(f"{run_dir / 'traces'} has no 'generate group' spans: the fit needs the run's traces "
                       "(tracing on, the default)")
    return Measured(
        steps=len(kept), steps_per_s=(len(kept) - 1) / span if span > 0 else 0.0,
        learner_s=_avg(r["time/step_s"] for r in kept), publish_s=_avg(r.get("time/publish_s", 0.0) for r in kept),
        commit_s=_avg(r.get("time/commit_s", 0.0) for r in kept),
        completion_tokens=_avg(r.get("train/completion_tokens_mean", 1.0) for r in kept),
        staleness_mean=_avg(r.get("trainer/staleness_mean", 0.0) for r in kept),
        generate_group_s=statistics.median(traces.duration(s) for s in gen),
        apply_s=_avg(traces.duration(s) for s in spans if s["name"] == "apply weights"),
        transfer_s=traces.transfer_s(spans), pipeline_latency_s=traces.latency_s(spans),
        length_quantiles=traces.quantiles([n for s in gen for n in traces.lengths(s)]),
        learner_per_token_s=learner_per_token(
            [(r["train/sequences"] * r["train/completion_tokens_mean"], r["time/step_s"]) for r in kept
             if "train/sequences" in r and "train/completion_tokens_mean" in r]),
        **dict(zip(("iter_fixed_s", "iter_per_seq_s"), traces.iteration_costs(spans) or (0.0, 0.0), strict=True)),
        **_cpu_per_sample(run_dir / "usage.jsonl", kept))


def fit(shape: Shape, measured: Measured, iter_per_seq_s: float | None = None,
        steps: int = 60) -> tuple[Shape, Rates, Result]:
    """Rates whose simulation of ``shape`` shows the recorded times; returns the run's shape as fitted
    (completion lengths, and on a shared machine, ``shape.cores``, the other tenants' demand that got them
    the cores they took), the rates and that simulation. The engine's iteration cost keeps the ratio of its
    per-sequence to its fixed part that the traces show (``iter_per_seq_s`` None) or grows by
    ``iter_per_seq_s`` per sequence; its level is fitted to the recorded group times either way. The learner keeps
    the ratio of its per-token to its fixed part that the steps show (``measured.learner_per_token_s``)."""
    shape = msgspec.structs.replace(shape, completion_tokens=measured.completion_tokens,
                                    length_quantiles=measured.length_quantiles or shape.length_quantiles,
                                    background=measured.background_cores if shape.cores else 0.0)
    per_token = min(measured.learner_per_token_s, measured.learner_s / _batch_tokens(shape))
    judge, bus = measured.judge_cpu_per_sample, measured.nats_cpu_per_sample
    if iter_per_seq_s is None and measured.iter_fixed_s > 0:
        iter_fixed_s, iter_per_seq_s = measured.iter_fixed_s, measured.iter_per_seq_s
    else:
        iter_per_seq_s = iter_per_seq_s or 0.0
        iter_fixed_s = measured.generate_group_s / _expected_iterations(shape) - iter_per_seq_s * shape.group_size
    base = Rates(learn_fixed_s=measured.learner_s - per_token * _batch_tokens(shape), learn_per_token_s=per_token,
                 publish_s=measured.publish_s, commit_s=measured.commit_s,
                 apply_s=measured.apply_s, transfer_s=measured.transfer_s, iter_per_seq_s=iter_per_seq_s,
                 iter_fixed_s=max(iter_fixed_s, 1e-6),
                 judge_per_sample_s=judge, bus_per_sample_s=bus,
                 pipeline_latency_s=max(measured.pipeline_latency_s - shape.group_size * (judge + bus), 0.0))

    def matched(trainer_s: float) -> tuple[Rates, Result]:
        """With the trainer's event loop spending ``trainer_s`` per sample: learner and engine rates
        scaled until the simulation shows their recorded times."""
        nonlocal shape
        rates = msgspec.structs.replace(base, trainer_per_sample_s=trainer_s)
        result = Simulation(shape, rates).run(steps)
        for _ in range(6):  # uncontended = recorded x (recorded / simulated), until they agree
            k_learn = measured.learner_s / result.learner_s if result.learner_s else 1.0
            k_gen = measured.generate_group_s / result.generate_group_s if result.generate_group_s else 1.0
            k_bg = measured.background_cores / result.background_cores if result.background_cores else 1.0
            if abs(k_learn - 1) < 0.02 and abs(k_gen - 1) < 0.02 and abs(k_bg - 1) < 0.05:
                break
            rates = msgspec.structs.replace(rates, learn_fixed_s=rates.learn_fixed_s * k_learn,
                                            learn_per_token_s=rates.learn_per_token_s * k_learn,
                                            iter_fixed_s=rates.iter_fixed_s * k_gen,
                                            iter_per_seq_s=rates.iter_per_seq_s * k_gen)
            shape = msgspec.structs.replace(shape, background=min(shape.background * k_bg, 64.0))
            result = Simulation(shape, rates).run(steps)
        return rates, result

    # the trainer's per-message work (decode, filter, buffer, acks between steps) shows in no record of its
    # own: it is the value whose simulation runs at the recorded steps/s, at most all of the trainer's CPU
    lo = 0.0
    hi = measured.trainer_cpu_per_sample or measured.learner_s / (shape.groups_per_step * shape.group_size)
    best = matched(lo)
    if best[1].steps_per_s <= measured.steps_per_s:
        return shape, best[0], best[1]
    for _ in range(10):
        mid = (lo + hi) / 2
        best = matched(mid)
        if best[1].steps_per_s > measured.steps_per_s:
            lo = mid
        else:
            hi = mid
    return shape, best[0], best[1]


def predict(shape: Shape, rates: Rates, changes: dict[str, Any], steps: int = 60,
            background_cores: float | None = None) -> Result:
    """The fitted run with ``changes`` (Shape fields) applied; on a shared machine whose other tenants
    took ``background_cores`` (default: as in the fitted run) while it ran. A changed thread count scales
    its part's work: :func:`rescaled`."""
    changed = changed_shape(shape, changes)
    rates = rescaled(rates, shape, changed)
    result = Simulation(changed, rates).run(steps)
    if background_cores is None or not changed.cores:
        return result
    changed = msgspec.structs.replace(changed, background=background_cores)
    for _ in range(6):  # the tenants' demand that gets them what they took, beside this run
        result = Simulation(changed, rates).run(steps)
        if not result.background_cores or abs(background_cores / result.background_cores - 1) < 0.05:
            break
        changed = msgspec.structs.replace(
            changed, background=min(changed.background * background_cores / result.background_cores, 64.0))
    return result


def learner_time(threads: float, serial_fraction: float) -> float:
    """A learner step on ``threads`` threads (with their cores), as a fraction of its one-thread time (Amdahl:
    ``Shape.learner_serial_fraction``)."""
    return serial_fraction + (1 - serial_fraction) / threads


def rescaled(rates: Rates, fitted: Shape, changed: Shape) -> Rates:
    """``rates`` (uncontended seconds at ``fitted``'s thread counts) for ``changed``'s thread counts: the
    learner's times by :func:`learner_time` after / before (``changed.learner_serial_fraction``: a learner of
    2 torch threads on 2 cores is rarely twice one thread's speed), the engine's iteration and apply times by
    engine_threads before / after (perfect scaling: the gain of more engine threads is an upper bound)."""
    serial = changed.learner_serial_fraction
    k_learn = learner_time(changed.trainer_threads, serial) / learner_time(fitted.trainer_threads, serial)
    k_engine = fitted.engine_threads / changed.engine_threads
    if k_learn == 1 and k_engine == 1:
        return rates
    return msgspec.structs.replace(
        rates, learn_fixed_s=rates.learn_fixed_s * k_learn, learn_per_token_s=rates.learn_per_token_s * k_learn,
        iter_fixed_s=rates.iter_fixed_s * k_engine, iter_per_seq_s=rates.iter_per_seq_s * k_engine,
        apply_s=rates.apply_s * k_engine)


def serial_fraction(a: tuple[Shape, Rates], b: tuple[Shape, Rates]) -> float:
    """The learner's serial fraction (``Shape.learner_serial_fraction``) that two fits of runs with different
    ``trainer_threads`` show: each fit's learner rate is uncontended seconds at its own thread count, so their
    ratio at the same batch (``a``'s tokens) is ``learner_time(n_b) / learner_time(n_a)``, solved for the
    fraction (kept within 0..1: a ratio beyond perfect scaling gives 0, one of no gain 1)."""
    (shape_a, rates_a), (shape_b, rates_b) = a, b
    n_a, n_b = shape_a.trainer_threads, shape_b.trainer_threads
    if n_a == n_b:
        raise FitError(f"both runs' learners had {n_a:g} threads: the scaling with threads needs two runs of "
                       "different trainer thread counts")
    tokens = _batch_tokens(shape_a)
    step_a = rates_a.learn_fixed_s + rates_a.learn_per_token_s * tokens
    step_b = rates_b.learn_fixed_s + rates_b.learn_per_token_s * tokens
    if step_a <= 0 or step_b <= 0:
        raise FitError("a fit's learner takes no time: the runs' metrics.jsonl show no time/step_s")
    # ratio = (s + (1 - s) / n_b) / (s + (1 - s) / n_a), linear in s
    ratio = step_b / step_a
    denominator = ratio * (1 - 1 / n_a) - (1 - 1 / n_b)
    if denominator == 0:  # more threads slower by exactly as much as their count: no gain at all
        return 1.0
    return min(max((1 / n_b - ratio / n_a) / denominator, 0.0), 1.0)


def lengths_of(measured: Measured) -> dict[str, Any]:
    """Shape changes that draw completion lengths as in ``measured``'s run (its traces' distribution and its
    batches' mean): to predict a run with another run's lengths."""
    if not measured.length_quantiles:
        raise FitError("the run's traces have no completion lengths (generate group spans with "
                       "completion_tokens)")
    return {"completion_tokens": measured.completion_tokens, "length_quantiles": measured.length_quantiles}


def learner_per_token(rows: list[tuple[float, float]]) -> float:
    """The learner's seconds per trained token from steps of (batch tokens, learner seconds): the slope of
    their least squares line; 0 where it is not clearly above its noise (less than three standard errors:
    equal batches, or times that follow something else) or with fewer than 5 steps. A line through a
    negative fixed part gives the slope through zero (all of it per token)."""
    if len(rows) < 5:
        return 0.0
    mx, my = statistics.fmean(r[0] for r in rows), statistics.fmean(r[1] for r in rows)
    sxx = sum((r[0] - mx) ** 2 for r in rows)
    if sxx <= 1e-9 * max(mx * mx, 1e-9) * len(rows):
        return 0.0
    slope = sum((r[0] - mx) * (r[1] - my) for r in rows) / sxx
    residual = sum((r[1] - my - slope * (r[0] - mx)) ** 2 for r in rows) / (len(rows) - 2)
    if slope <= 3 * (residual / sxx) ** 0.5:
        return 0.0
    if my - slope * mx < 0:
        return sum(r[0] * r[1] for r in rows) / sum(r[0] * r[0] for r in rows)
    return slope


def _batch_tokens(shape: Shape) -> float:
    """Trained tokens in a step's batch, as the simulation's learner counts them."""
    return shape.groups_per_step * shape.group_size * (shape.prompt_tokens + shape.completion_tokens)


def changed_shape(shape: Shape, changes: dict[str, Any]) -> Shape:
    """``shape`` with ``changes`` (Shape fields; a new ``max_staleness`` brings its own admission bound);
    FitError naming the setting when the result is not a valid shape."""
    if "max_staleness" in changes and "max_in_flight" not in changes:
        changes = {**changes, "max_in_flight": 0}
    try:
        return msgspec.convert({**msgspec.to_builtins(shape), **changes}, Shape)
    except msgspec.ValidationError as e:
        raise FitError(f"--set: {e} (settable: {', '.join(Shape.__struct_fields__)})") from e


def _expected_iterations(shape: Shape, draws: int = 4000) -> float:
    """Median over groups of the longest sequence (a group is done when its longest one is; the median, as the
    group times it is set against)."""
    sim = Simulation(shape, Rates())
    groups = [max(sim.seq_length() for _ in range(shape.group_size)) for _ in range(draws // shape.group_size + 1)]
    return statistics.median(groups)


def _avg(xs: Any) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else 0.0


def _cpu_per_sample(path: Path, kept: list[dict[str, Any]]) -> dict[str, float]:
    """Judge, broker and trainer CPU seconds per trained sample between the usage lines inside the window."""
    lines = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    inside = [u for u in lines if kept[0]["time"] <= u["time"] <= kept[-1]["time"]]
    out = {"judge_cpu_per_sample": 0.0, "nats_cpu_per_sample": 0.0, "trainer_cpu_per_sample": 0.0,
           "background_cores": 0.0}
    if len(inside) < 2:
        return out
    first, last = inside[0], inside[-1]
    trained = [r["trainer/trained_total"] for r in kept if first["time"] <= r["time"] <= last["time"]
               and "trainer/trained_total" in r]
    samples = trained[-1] - trained[0] if len(trained) >= 2 else 0.0
    if samples <= 0:
        return out

    def cpu(prefix: str) -> float:
        return sum(last["cpu_s"][k] - first["cpu_s"].get(k, 0.0) for k in last["cpu_s"]
                   if k.split("-")[0] == prefix and k in first["cpu_s"])

    ours = sum(last["cpu_s"][k] - first["cpu_s"][k] for k in last["cpu_s"] if k in first["cpu_s"])
    machine = (last.get("machine_busy_s") or 0.0) - (first.get("machine_busy_s") or 0.0)
    background = max(machine - ours, 0.0) / (last["time"] - first["time"]) if machine > 0 else 0.0
    return {"judge_cpu_per_sample": cpu("judge") / samples, "nats_cpu_per_sample": cpu("nats") / samples,
            "trainer_cpu_per_sample": cpu("trainer") / samples, "background_cores": background}
