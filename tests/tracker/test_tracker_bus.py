"""The tracker service against a real nats-server: METRICS, TRAJECTORIES and OUTCOMES in, TensorBoard,
W&B (offline, no network) and trackio out; a dead backend drops what it was given, counted, and the rest
goes on. The messages are published by the test as the trainer and judges would."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import msgspec
import nats
import numpy as np
import pytest

from proto import catalog
from proto.accounting import OutcomeBatch, TrajectoryOutcome
from proto.metrics import MetricsReport
from proto.rollouts import Rollout, Turn
from proto.trajectories import GraderScore, ScoredGroup, ScoredTrajectory
from services.launcher import registry
from services.runtime import bus, service
from services.runtime.config import load_service_config
from services.runtime.natsd import free_port
from services.tracker.config import TrackerConfig
from tests.conftest import wait_for_async
from tests.tracker import readers

RUN = "trk"
GROUP = 6  # trajectories per step
ROWS = 4  # rows_per_step


def _config(tmp_path: Path, nats_url: str, backends: str, **keys: object) -> object:
    path = tmp_path / "run.toml"
    extra = "".join(f"{k} = {v}\n" for k, v in keys.items())
    path.write_text(f'[run]\nid = "{RUN}"\ndir = "{tmp_path / "run"}"\n[nats]\nurl = "{nats_url}"\n'
                    f"[services.tracker]\nbackends = {backends}\nrows_per_step = {ROWS}\ncatch_up_s = 120\n"
                    f"flush_timeout_s = 240\n{extra}")  # generous: W&B's finish took over 60 s on a loaded machine
    return load_service_config("tracker", TrackerConfig, path, env={})


def _trajectory(step: int, i: int) -> ScoredTrajectory:
    rollout = Rollout(run_id=RUN, task="addition", group_id=f"s{step}", prompt_id=f"p{step}", sample_index=i,
                      group_size=GROUP, prompt_ids=[1, 2], prompt_text=f"{step}+{i}=", finish_reason="eos",
                      policy_version=step - 1, turns=[Turn(role="assistant", token_ids=[3], text=str(step + i))])
    t = ScoredTrajectory(run_id=RUN, rollout=rollout, reward=i / GROUP,
                         scores=[GraderScore(grader="exact", score=i / GROUP), GraderScore(grader="format", score=1.0)])
    t.msg_id = f"t-{step}-{i}"
    return t


async def _publish_step(nc, js, step: int) -> dict[str, ScoredTrajectory]:
    """One trainer step as the bus sees it: trajectories, their outcomes (one dropped), the step's metrics."""
    trajs = {f"t-{step}-{i}": _trajectory(step, i) for i in range(GROUP)}
    for t in trajs.values():
        await bus.publish_on(nc, js, catalog.TRAJECTORIES, RUN, ScoredGroup.of([t]))
    for tid in trajs:
        kind = "dropped" if tid.endswith("-0") else "trained"
        await bus.publish_on(nc, js, catalog.OUTCOMES, RUN, OutcomeBatch(run_id=RUN, outcomes=[TrajectoryOutcome(
            run_id=RUN, trajectory_id=tid, group_id=f"s{step}", outcome=kind, step=step, version=step,
            sample_version=step - 2, reason="stale" if kind == "dropped" else "")]))  # trained from step - 1: staleness 1
    await bus.publish_on(nc, js, catalog.METRICS, RUN, MetricsReport(
        run_id=RUN, service="trainer", instance="trainer-0", step=step,
        values={"train/reward_mean": 0.1 * step + 0.01, "trainer/loss": 1.0 / (step + 2)}), "trainer")
    await bus.publish_on(nc, js, catalog.METRICS, RUN, MetricsReport(
        run_id=RUN, service="rollout", instance="rollout-0", values={"rollout/tokens_per_s": 100.0 + step}),
        "rollout")
    return trajs


def _check_rows(columns: list[str], rows: list[list[object]], step: int, trajs: dict[str, ScoredTrajectory]) -> None:
    assert columns == ["step", "prompt", "completion", "reward", "staleness", "finish_reason", "group_id", "env",
                       "score/exact", "score/format"]
    assert len(rows) == ROWS
    by_prompt = {t.rollout.prompt_text: t for tid, t in trajs.items() if not tid.endswith("-0")}  # trained only
    for row in rows:
        cell = dict(zip(columns, row, strict=True))
        t = by_prompt[cell["prompt"]]
        assert (cell["step"], cell["completion"], cell["reward"], cell["staleness"], cell["score/exact"]) == \
               (step, t.rollout.text(), t.reward, 1, t.reward)


async def _tracker_reports(js) -> list[MetricsReport]:
    from services.launcher.accounting import read_all

    reps = await read_all(js, "METRICS", f"rlbus.{RUN}.metrics.tracker", MetricsReport)
    assert reps, "the tracker reported no metrics"
    return reps


@pytest.mark.slow
async def test_tracker_follows_the_streams_into_tensorboard_wandb_and_trackio(nats_url, tmp_path, monkeypatch):
    # no network: W&B offline, and any attempt to reach a server would go to a closed port
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "run" / "trackio"))
    loaded = _config(tmp_path, nats_url, '[{ type = "tensorboard" }, { type = "wandb" }, { type = "trackio" }]')
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    await bus.provision_all(js)
    stop = asyncio.Event()
    tracker = asyncio.create_task(service.serve("tracker", registry.load("tracker")[1], loaded, "tracker-0",
                                                stop=stop))
    # hostile input among the good: dead-lettered with the reason, never a crash or a stall
    await js.publish(f"rlbus.{RUN}.metrics.rollout", b"\xc1 not msgpack")
    await js.publish(f"rlbus.{RUN}.trajectories", b"\x00garbage")
    published = {1: await _publish_step(nc, js, 1), 2: await _publish_step(nc, js, 2)}
    tb_dir = tmp_path / "run" / "tensorboard"

    # live: steps 1 and 2 reach the event file while the tracker runs (the writer flushes every 5 s)
    async def step_2_written() -> bool:
        assert not tracker.done(), "the tracker stopped"
        return tb_dir.is_dir() and [s for s, _ in readers.tb_scalars(readers.tensorboard(tb_dir)).get(
            "train/reward_mean", [])] == [1, 2]

    await wait_for_async(step_2_written, 120, "steps 1 and 2 in the TensorBoard event file")
    # step 3 is published just before the stop: the tracker catches up on what the streams hold first
    published[3] = await _publish_step(nc, js, 3)
    stop.set()
    assert await asyncio.wait_for(tracker, 600) == 0

    acc = readers.tensorboard(tb_dir)
    scalars = readers.tb_scalars(acc)
    f32 = np.float32
    assert scalars["train/reward_mean"] == [(s, f32(0.1 * s + 0.01)) for s in (1, 2, 3)]
    assert scalars["trainer/loss"] == [(s, f32(1.0 / (s + 2))) for s in (1, 2, 3)]
    # a report without a step is logged at the newest trainer step seen before it
    assert scalars["rollout/tokens_per_s"] == [(s, f32(100.0 + s)) for s in (1, 2, 3)]
    texts = readers.tb_texts(acc)
    assert [s for s, _ in texts] == [1, 2, 3]
    for step, text in texts:
        lines = text.splitlines()
        assert lines[0].startswith("| step | prompt | completion | reward | staleness |") and len(lines) == 2 + ROWS
        assert all(f"| {step} | {step}+" in line for line in lines[2:])
        assert f"| {step}+0= |" not in text  # the dropped trajectory is in no table

    run = readers.wandb_offline_run(tmp_path / "run")
    history = readers.wandb_history(run)
    rewards = [(h["_step"], h["train/reward_mean"]) for h in history if "train/reward_mean" in h]
    assert rewards == [(s, pytest.approx(0.1 * s + 0.01, rel=1e-12)) for s in (1, 2, 3)]
    tables = readers.wandb_tables(run)
    assert len(tables) == 3
    for step, table in zip((1, 2, 3), sorted(tables, key=lambda t: t["data"][0][0]), strict=True):
        _check_rows(table["columns"], table["data"], step, published[step])

    import trackio

    logs = trackio.SQLiteStorage.get_logs(project="rlbus", run=RUN)
    trackio_rewards = [(r["step"], r["train/reward_mean"]) for r in logs if "train/reward_mean" in r]
    assert trackio_rewards == [(s, pytest.approx(0.1 * s + 0.01)) for s in (1, 2, 3)]
    assert sum("completions" in r for r in logs) == 3

    last = (await _tracker_reports(js))[-1].values
    assert last["tracker/tables"] == 3 and last["tracker/rows_missing"] == 0
    for name in ("tensorboard", "wandb", "trackio"):
        assert last[f"tracker/{name}/dropped"] == 0 and last[f"tracker/{name}/written"] >= 9, (name, last)
    from proto.deadletter import DeadLetter
    from services.launcher.accounting import read_all

    dead = await read_all(js, "DLQ", f"rlbus.{RUN}.dlq.>", DeadLetter)
    assert sorted((d.service, d.original_subject) for d in dead) == [
        ("tracker", f"rlbus.{RUN}.metrics.rollout"), ("tracker", f"rlbus.{RUN}.trajectories")]
    assert all(d.reason for d in dead)
    # the tracker's consumers are its own: the trainer's durable consumer was neither created nor moved
    with pytest.raises(nats.js.errors.NotFoundError):
        await js.consumer_info("TRAJECTORIES", f"trainer-{RUN}")
    await nc.close()


@pytest.mark.slow
async def test_a_dead_backend_drops_counted_and_the_others_go_on(nats_url, tmp_path, monkeypatch, caplog):
    # W&B online against a port where nothing listens: wandb.init fails after init_timeout_s
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    loaded = _config(tmp_path, nats_url, '[{ type = "wandb", mode = "online", init_timeout_s = 5 }, '
                                         '{ type = "tensorboard" }]', report_every_s=1)
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    await bus.provision_all(js)
    stop = asyncio.Event()
    caplog.set_level(logging.WARNING, logger="rlbus.tracker.backends")
    tracker = asyncio.create_task(service.serve("tracker", registry.load("tracker")[1], loaded, "tracker-0",
                                                stop=stop))
    for step in (1, 2, 3):
        await _publish_step(nc, js, step)

    async def wandb_gave_up() -> bool:
        assert not tracker.done(), "the tracker stopped"
        reps = [r for r in await _tracker_reports_or_none(js) if r.values.get("tracker/wandb/dropped", 0) > 0]
        return bool(reps) and reps[-1].values["tracker/tensorboard/written"] >= 9

    await wait_for_async(wandb_gave_up, 120, "the dead W&B backend to be counted while TensorBoard writes")
    stop.set()
    assert await asyncio.wait_for(tracker, 600) == 0

    scalars = readers.tb_scalars(readers.tensorboard(tmp_path / "run" / "tensorboard"))
    assert [s for s, _ in scalars["train/reward_mean"]] == [1, 2, 3]
    last = (await _tracker_reports(js))[-1].values
    assert last["tracker/wandb/written"] == 0
    assert last["tracker/wandb/dropped"] == last["tracker/tensorboard/written"]  # everything W&B was given
    warnings = [r.getMessage() for r in caplog.records if "tracker backend wandb" in r.getMessage()]
    assert sum(w.startswith("tracker backend wandb could not start") for w in warnings) == 1
    # rate-limited: one warning about the drops within warn_every_s, not one per record
    assert sum(w.startswith("tracker backend wandb dropped") for w in warnings) == 1, warnings
    await nc.close()


async def _tracker_reports_or_none(js) -> list[MetricsReport]:
    from services.launcher.accounting import read_all

    return await read_all(js, "METRICS", f"rlbus.{RUN}.metrics.tracker", MetricsReport)


def test_backends_are_chosen_by_type_and_bad_keys_are_named(tmp_path):
    from services.runtime.config import ConfigError

    path = tmp_path / "run.toml"
    path.write_text('[services.tracker]\nbackends = [{ type = "wandb", mode = "offline" }, { type = "tensorboard" }]\n')
    cfg = load_service_config("tracker", TrackerConfig, path, env={}).service
    assert [type(b).__name__ for b in cfg.backends] == ["WandbBackend", "TensorBoardBackend"]
    assert msgspec.convert({}, TrackerConfig).backends[0].dir == "tensorboard"
    path.write_text('[services.tracker]\nbackends = [{ type = "mlflow" }]\n')
    with pytest.raises(ConfigError, match="services.tracker.backends"):
        load_service_config("tracker", TrackerConfig, path, env={})
    path.write_text('[services.tracker]\nrows_per_step = -1\n')
    with pytest.raises(ConfigError, match="services.tracker.rows_per_step"):
        load_service_config("tracker", TrackerConfig, path, env={})
