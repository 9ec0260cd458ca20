"""What ``rlbus simulate`` takes and gives: the rates of each part (:class:`Rates`), the run's shape
(:class:`Shape`) and a simulated run's figures (:class:`Result`); a plan file's ``[rates]`` and ``[shape]``
are these structs. The model itself is :mod:`services.launcher.simulate`."""

from __future__ import annotations

from typing import Annotated

import msgspec

#: most values a shape's length_quantiles holds (a plan file stays small)
MAX_QUANTILES = 65


class Rates(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How long each part takes (uncontended seconds)."""

    #: learner time per step independent of the batch
    learn_fixed_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    #: learner time per trained token (prompt + completion) in the batch
    learn_per_token_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    #: publishing one weight version (trainer side)
    publish_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    #: after the publish: recording outcomes, saving state, acking (trainer side)
    commit_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    #: from publish to the version being at an engine (transport)
    transfer_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    #: loading a version into an engine (generation paused)
    apply_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    #: one decode iteration's fixed cost
    iter_fixed_s: Annotated[float, msgspec.Meta(gt=0)] = 0.01
    #: one decode iteration's cost per running sequence
    iter_per_seq_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    #: rollout work per finished sample (building and publishing its message)
    rollout_per_sample_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    #: judge work per sample (reward, grader, message handling)
    judge_per_sample_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    #: trainer work per arriving sample (decode, staleness filter, buffer)
    trainer_per_sample_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    #: message broker (nats-server) CPU per sample on a shared machine
    bus_per_sample_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    #: pure delay from a group's last sample to the trainer having it
    pipeline_latency_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    #: one sandbox call of an agent turn
    sandbox_exec_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0


class Shape(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The run: batch, staleness, fleet."""

    groups_per_step: Annotated[int, msgspec.Meta(ge=1)] = 16
    group_size: Annotated[int, msgspec.Meta(ge=1)] = 8
    #: mean completion tokens per sequence (the learner's batch; without length_quantiles, lengths are drawn
    #: around it from a Gaussian, 1..max_new_tokens)
    completion_tokens: Annotated[float, msgspec.Meta(gt=0)] = 32.0
    #: the run's completion lengths at evenly spaced quantiles, shortest first and longest last (a fit takes
    #: 33 from the run's traces); lengths are drawn between them with the seeded rng, so a heavy tail keeps
    #: its weight; empty: the Gaussian around completion_tokens
    length_quantiles: Annotated[list[Annotated[float, msgspec.Meta(ge=0)]], msgspec.Meta(max_length=MAX_QUANTILES)] = []
    max_new_tokens: Annotated[int, msgspec.Meta(ge=1)] = 64
    prompt_tokens: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    max_staleness: Annotated[int, msgspec.Meta(ge=0)] = 1
    #: admission bound in groups; 0 = (max_staleness + 1) * groups_per_step
    max_in_flight: Annotated[int, msgspec.Meta(ge=0)] = 0
    engines: Annotated[int, msgspec.Meta(ge=1)] = 1
    max_tickets: Annotated[int, msgspec.Meta(ge=1)] = 64
    max_batch: Annotated[int, msgspec.Meta(ge=1)] = 256
    judges: Annotated[int, msgspec.Meta(ge=1)] = 1
    #: agent turns per sequence (1 = single-turn, no sandbox)
    turns: Annotated[int, msgspec.Meta(ge=1)] = 1
    sandboxes_per_engine: Annotated[int, msgspec.Meta(ge=1)] = 64
    #: tokens one simulated decode iteration stands for (1 = exact; larger = faster planning of long runs)
    decode_chunk: Annotated[int, msgspec.Meta(ge=1)] = 1
    #: cores shared by every part (0 = each part on its own device)
    cores: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    #: of those cores, the trainer's own pool (its [placement] CPUs, disjoint from every other service's): the
    #: trainer process shares these, every other part the other cores - trainer_cores; 0 = one pool
    trainer_cores: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    #: cores that other tenants of a shared machine want all along (they share it with the run)
    background: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    #: the other tenants run at a lower priority than the run (``nice -n 19``): they take only the cores it
    #: leaves idle; false: they share every core fairly with it
    background_yields: bool = False
    #: cores each busy part wants on a shared machine
    engine_threads: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    trainer_threads: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    #: the learner's serial fraction ``s`` (Amdahl): on ``n`` threads with their cores, a step takes ``s + (1 - s)
    #: / n`` of its one-thread time, so 2 threads are ``2 / (1 + s)`` times as fast as one; 0 = perfect scaling.
    #: A changed ``trainer_threads`` rescales the learner's rate by it; a learner given fewer cores than its
    #: threads still slows in proportion (its threads are time-sliced). The default: the SmolLM2 learner of
    #: 2 torch threads ran ~1.5x one thread here (BENCHMARKS.md, issue 30 item 7); bench/simulate_check.py
    #: --fit A,B fits it from two runs of different thread counts
    learner_serial_fraction: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.3
    #: the trainer sends a version and commits its batch beside the next learner step (its
    #: ``overlap_publish``, on by default); false: between steps
    overlap_publish: bool = True

    def __post_init__(self) -> None:
        if self.trainer_cores and not 0 < self.trainer_cores < self.cores:
            raise ValueError(f"trainer_cores = {self.trainer_cores} needs cores > trainer_cores (cores = "
                             f"{self.cores}): the trainer's pool is part of a shared machine's cores, and the "
                             "other parts need the rest")
        q = self.length_quantiles
        if any(b < a for a, b in zip(q, q[1:], strict=False)):
            raise ValueError(f"length_quantiles must not decrease (shortest first): {q}")


class Result(msgspec.Struct, kw_only=True):
    steps: int
    sim_s: float
    steps_per_s: float
    #: trained groups by staleness (versions behind the trainer at the step)
    staleness: dict[int, int]
    staleness_mean: float
    dropped_groups: int
    #: fraction of time each part had nothing to do
    idle: dict[str, float]
    #: durations as a run's records would show them (used to fit rates): the mean learner step, the median
    #: group generation (a run's median: its warm-up and tail groups do not move it)
    learner_s: float
    generate_group_s: float
    tokens_per_s: float
    #: cores the other tenants got (``background`` at its share of the machine)
    background_cores: float
