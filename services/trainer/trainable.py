"""Which samples of a collected batch a step trains on, and which it drops with their reason.

The collector hands the loop complete prompt groups (:meth:`~services.trainer.collect.Collector.collect`); before
the learner sees them, two kinds of sample are split off, never trained on:

* a **failed rollout** (the sandbox died, an engine error): dropped with its error, never trained as reward 0;
* with on-policy distillation (``[distill] enabled``), a sample whose **teacher logprobs are missing or do not
  fit its tokens**: marked as a failed rollout with the reason (:func:`~services.trainer.distill.fail_missing_teacher`),
  so it is dropped the same way.

The groups stay whole in the batch: their outcomes and acks are settled together with the step (or, when
nothing is left to train, by :meth:`~services.trainer.collect.Collector.fail_groups`).
"""

from __future__ import annotations

from dataclasses import dataclass

from proto.trajectories import ScoredTrajectory
from services.runtime.config import DistillSection
from services.trainer.admission import Sample
from services.trainer.distill import fail_missing_teacher


@dataclass
class Batch:
    """One step's collected groups: ``samples`` are trained (in batch order), ``failed`` dropped with their error."""

    groups: list[list[Sample]]
    samples: list[Sample]
    failed: list[Sample]

    @property
    def trajectories(self) -> list[ScoredTrajectory]:
        """What the learner takes: the trained samples' scored trajectories."""
        return [s.item for s in self.samples]


def assemble(groups: list[list[Sample]], distill: DistillSection) -> Batch:
    """Split ``groups`` into the samples to train and the failed ones (the module docstring)."""
    samples = [s for g in groups for s in g]
    if distill.enabled:  # never trained without its teacher logprobs: dropped with the reason
        fail_missing_teacher(samples)
    failed = [s for s in samples if s.item.rollout.error]
    return Batch(groups, [s for s in samples if not s.item.rollout.error], failed)
