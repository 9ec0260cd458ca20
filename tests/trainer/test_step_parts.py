"""The parts the trainer's loop calls between collecting a batch and publishing its version, without bus or
model: the batch split (services/trainer/trainable.py), a step's figures (step_figures.py) and the overlapped
publish (overlap.py)."""

from __future__ import annotations

import asyncio

import pytest

from proto.rollouts import Rollout, Turn
from proto.trajectories import ScoredTrajectory
from services.runtime.config import DistillSection
from services.trainer.admission import Sample
from services.trainer.ledger import Ledger
from services.trainer.outbox import Versions
from services.trainer.overlap import Overlap
from services.trainer.state import TrainerState
from services.trainer.step_figures import batch_figures, commit_figures, record_version_lag, timed
from services.trainer.trainable import assemble


def _sample(group: str, i: int, *, reward: float = 1.0, version: int = 0, task: str = "addition",
            error: str | None = None, teacher: list[float] | None = None) -> Sample:
    turn = Turn(role="assistant", token_ids=[5, 6], logprobs=[-1.0, -1.0], versions=[version] * 2, text="x")
    rollout = Rollout(run_id="r", task=task, group_id=group, prompt_id="p", sample_index=i, group_size=2,
                      prompt_ids=[1], turns=[turn], finish_reason="error" if error else "eos",
                      policy_version=version, error=error)
    return Sample(key=f"{group}-s{i}", group_id=group, sample_index=i, version=version,
                  item=ScoredTrajectory(run_id="r", rollout=rollout, reward=reward, teacher_logprobs=teacher))


def test_failed_rollouts_are_split_off_and_the_groups_stay_whole():
    a0, a1 = _sample("g00000000", 0), _sample("g00000000", 1, error="sandbox died")
    b0, b1 = _sample("g00000001", 0), _sample("g00000001", 1)
    batch = assemble([[a0, a1], [b0, b1]], DistillSection())
    assert batch.samples == [a0, b0, b1] and batch.failed == [a1]
    assert batch.groups == [[a0, a1], [b0, b1]]
    assert batch.trajectories == [a0.item, b0.item, b1.item]


def test_with_distillation_a_sample_without_its_teacher_logprobs_fails_with_the_reason():
    fits, missing = _sample("g00000000", 0, teacher=[-0.5, -0.5]), _sample("g00000000", 1)
    short = _sample("g00000001", 0, teacher=[-0.5])
    # without [distill] they are all trained: teacher logprobs are not read
    assert assemble([[fits, missing], [short]], DistillSection()).failed == []
    batch = assemble([[fits, missing], [short]], DistillSection(enabled=True))
    assert batch.samples == [fits] and batch.failed == [missing, short]
    assert missing.item.rollout.error.startswith("no teacher logprobs")
    assert short.item.rollout.error == "teacher logprobs do not fit: 1 for 2 tokens"
    # every sample failed: nothing is left to train
    assert assemble([[missing]], DistillSection(enabled=True)).samples == []


def test_the_figures_of_a_step():
    samples = [_sample("g00000000", 0, version=3, reward=1.0, task="addition"),
               _sample("g00000000", 1, version=5, reward=0.0, task="addition"),
               _sample("g00000001", 0, version=5, reward=0.5, task="words")]
    assert record_version_lag(samples, 5) == [2, 0, 0]
    collected = {"trainer/filtered_frac": 0.25}
    assert batch_figures(samples, collected, mixture=False) == collected
    mixed = batch_figures(samples, collected, mixture=True)
    assert mixed["trainer/filtered_frac"] == 0.25
    assert mixed["train/addition/reward_mean"] == pytest.approx(0.5)
    assert mixed["train/words/share"] == pytest.approx(1 / 3)
    ledger = Ledger(TrainerState(version=6), kv=None, run_id="r", max_in_flight=4)
    versions = Versions(sender=None, ledger=ledger)  # type: ignore[arg-type]
    versions.bytes, versions.undelivered = 1024, 1
    figures = commit_figures(ledger, versions, [2, 0, 0])
    assert figures["trainer/version"] == 6.0 and figures["trainer/admission_bound"] == 4.0
    assert figures["trainer/staleness_mean"] == pytest.approx(2 / 3) and figures["trainer/staleness_max"] == 2.0
    assert figures["weights/bytes"] == 1024.0 and figures["weights/undelivered"] == 1.0


def test_timed_sets_its_figure_only_when_the_body_finishes():
    figures: dict[str, float] = {}
    with timed(figures, "time/x_s"):
        pass
    assert figures["time/x_s"] >= 0.0
    with pytest.raises(RuntimeError), timed(figures, "time/y_s"):
        raise RuntimeError("failed")
    assert "time/y_s" not in figures


async def test_a_background_publish_is_settled_by_the_next_step_and_its_error_raised_there():
    overlap = Overlap(enabled=True)
    assert overlap.now()  # no colocated engines in this process
    assert not Overlap(enabled=False).now()
    gate, done = asyncio.Event(), []

    async def publish(tag: str) -> None:
        await gate.wait()
        done.append(tag)

    await overlap.hand_off(publish("v1"), background=True, name="publish-v1")
    assert done == []  # handed off: the step goes on while it runs
    gate.set()
    await overlap.settle()
    assert done == ["v1"]
    await overlap.hand_off(publish("v2"), background=False, name="publish-v2")
    assert done == ["v1", "v2"]  # not overlapped: finished when hand_off returns

    async def fails() -> None:
        raise ConnectionError("store unreachable")

    await overlap.hand_off(fails(), background=True, name="publish-v3")
    with pytest.raises(ConnectionError):
        await overlap.settle()
    await overlap.settle()  # settled once: nothing left
    await overlap.hand_off(fails(), background=True, name="publish-v4")
    await overlap.settle(quiet=True)  # on the way out: logged, not raised
