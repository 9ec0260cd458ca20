"""A rollout worker SIGKILLed while it serves a black-box agent mid-episode: the episode is retried on the
other worker (the ticket was never acked, so JetStream redelivers it once its ``ack_wait`` passes without the
dead worker's ``in_progress``), completes there from a fresh session, trains, and the accounting identity
holds with one trajectory; the surviving worker keeps serving and stops cleanly.

Real parts: two ``rlbus service rollout`` processes (endpoint over the torch engine, the tiny chat model),
the real trainer and judge services in this process, nats-server and JetStream."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import nats
import pytest
from black_box_agents import MARKERS_ENV, HeldOnce
from endpoint_harness import tiny_model, tokenizer

from proto import catalog
from services.launcher import registry
from services.launcher.accounting import accounting, read_channel
from services.runtime import service
from services.runtime.config import load_service_config
from tests.conftest import run_file, wait_for_async

pytestmark = pytest.mark.slow

RUN = "bbdeath"
REPO = Path(__file__).resolve().parents[2]


async def test_a_rollout_worker_killed_mid_episode_loses_no_episode(nats_url, tmp_path):
    tok = tokenizer()
    model_dir = tmp_path / "model"
    tiny_model(tok).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    cfg = run_file(tmp_path, model_dir, run_id=RUN, nats_url=nats_url, task=HeldOnce.name,
                   trainer={"groups_per_step": 1, "group_size": 2, "total_steps": 1, "max_staleness": 0},
                   rollout={"endpoint": {"enabled": True}, "agent": {"max_turns": 4, "wall_time_s": 300.0}},
                   common={"drain_timeout_s": 5.0})
    markers = tmp_path / "markers"
    markers.mkdir()
    env = {**os.environ, MARKERS_ENV: str(markers), "PYTHONPATH": str(REPO)}
    logs = {name: open(tmp_path / f"{name}.log", "wb") for name in ("rollout-a", "rollout-b")}  # noqa: SIM115
    workers = {name: subprocess.Popen([sys.executable, str(Path(__file__).with_name("rollout_worker.py")), "rollout",
                                       "--config", str(cfg), "--instance", name], cwd=REPO, env=env,
                                      stdout=subprocess.DEVNULL, stderr=log)
               for name, log in logs.items()}
    by_pid = {p.pid: name for name, p in workers.items()}
    group = []
    for name in ("trainer", "judge"):
        cfg_cls, factory = registry.load(name)
        group.append((name, factory, load_service_config(name, cfg_cls, cfg), f"{name}-0"))
    loop = asyncio.create_task(service.serve_colocated(group), name="trainer+judge")
    killed: list[str] = []
    try:
        first = await wait_for_async(lambda: [int(m.name) for m in markers.iterdir()], 300,
                                     "an agent holding its episode open on a worker")
        (pid,) = first
        assert pid in by_pid, f"the marker names process {pid}, not one of this test's workers {by_pid}"
        os.kill(pid, signal.SIGKILL)  # the worker serving the agent, its episode open
        killed.append(by_pid[pid])
        assert await asyncio.wait_for(loop, 300) == 0  # the trainer took its step on the retried episode
        survivor = next(n for n in workers if n not in killed)
        assert workers[survivor].poll() is None  # still serving: nothing crash-looped
        assert workers[killed[0]].wait(30) == -signal.SIGKILL
        nc = await nats.connect(nats_url)
        js = nc.jetstream()
        rollouts = await read_channel(js, catalog.ROLLOUTS, RUN)
        acc = await accounting(js, RUN)
        await nc.close()
    finally:
        if not loop.done():
            loop.cancel()
            await asyncio.gather(loop, return_exceptions=True)
        for p in workers.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        codes = {name: p.wait(60) for name, p in workers.items()}
        for log in logs.values():
            log.close()
    assert codes[survivor] == 0  # stopped cleanly by SIGTERM

    # the group's retry ran on the survivor, each episode from a fresh session: its own two calls, nothing of the
    # dead attempt; the dead worker published nothing
    # (the trainer's evaluation rounds run the agent too, on either worker, and it admits the next group before
    # it stops)
    retried = [r for r in rollouts if r.group_id == "g00000000"]
    assert len(retried) == 2 and all(r.worker == survivor for r in retried), [(r.msg_id, r.worker) for r in rollouts]
    assert len({r.msg_id for r in rollouts}) == len(rollouts)  # each published once
    for r in rollouts:
        assert r.error is None and r.metadata["agent_calls"] == "2"
        assert [t.role for t in r.turns] == ["assistant", "tool", "assistant"]
    assert sorted(m.name for m in markers.iterdir()) == sorted([str(pid), str(workers[survivor].pid)])
    assert acc["identity_holds"] and acc["trained"] == 2, acc
    assert acc["lost"] == 0 and acc["multiple_outcomes"] == 0 and acc["dead_lettered"] == 0, acc
