"""The admission bound follows the live rollout fleet: real rollout workers (``rlbus service rollout``)
join and leave a real nats-server; their heartbeats in the members bucket give the live fleet, and
:func:`~services.trainer.admission.fleet_bound` rises when the second worker joins and falls back when
it leaves, never above the staleness bound. :meth:`Admission.resize` applies a new bound without taking
back what is in flight."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import nats
import pytest

from proto import catalog, codec
from proto.membership import Heartbeat
from services.runtime import bus
from services.trainer.admission import (
    DEFAULT_TICKETS,
    TICKETS_GAUGE,
    Admission,
    AdmissionError,
    fleet_bound,
    fleet_tickets,
    live_workers,
)
from tests.conftest import run_file, wait_for

ROOT = Path(__file__).resolve().parents[2]
G, STALENESS, TICKETS = 2, 3, 2  # staleness bound (3 + 1) * 2 = 8; one worker holds 2 groups


def test_fleet_bound_rises_with_the_fleet_up_to_the_staleness_bound():
    assert fleet_bound(STALENESS, G, None) == 8  # fleet unknown: the staleness bound
    assert fleet_bound(STALENESS, G, 0) == 8  # no worker yet: admit for the first that comes
    assert [fleet_bound(STALENESS, G, n * TICKETS) for n in (1, 2, 3, 4)] == [4, 6, 8, 8]
    assert fleet_bound(1, 16, 64) == 32  # the default example: one worker can hold every group
    with pytest.raises(AdmissionError):
        fleet_bound(1, 0, 4)


def _beat(instance: str, age_s: float, tickets: float | None = None, state: str = "running") -> Heartbeat:
    gauges = {TICKETS_GAUGE: tickets} if tickets is not None else {}
    return Heartbeat(run_id="r", service="rollout", instance=instance, host="h", pid=1, state=state, started_at=0.0,
                     metrics=gauges, created_at=time.time() - age_s)


def test_the_fleet_holds_what_its_live_workers_advertise():
    beats = [_beat("a", 1.0, 8), _beat("b", 1.0, 2),
             _beat("c", 1.0),  # an older rollout without the gauge: the default
             _beat("d", 60.0, 100),  # silent for a minute: gone
             _beat("e", 1.0, 100, state="draining")]
    assert live_workers(beats, "rollout", time.time(), 3.0) == 3
    assert fleet_tickets(beats, "rollout", time.time(), 3.0) == 8 + 2 + DEFAULT_TICKETS
    assert fleet_bound(3, 16, fleet_tickets(beats[1:2], "rollout", time.time(), 3.0)) == 18


def test_resize_takes_nothing_back_and_admits_again_under_the_new_bound():
    a = Admission(6)
    for i in range(6):
        a.admit(f"g{i}", 0)
    a.resize(4)  # a worker left: six stay in flight, none admitted until fewer than four
    assert a.room() == 0 and len(a.in_flight) == 6
    for i in range(3):
        a.finish(f"g{i}")
    assert a.room() == 1
    a.resize(8)  # it came back
    assert a.room() == 5
    with pytest.raises(AdmissionError):
        a.resize(0)


def fleet(url: str, run: str, tickets: bool = False) -> int:
    """Live rollout workers of ``run`` by their heartbeats (younger than three heartbeat periods); ``tickets``:
    the prompt groups they advertise they hold at once instead."""
    async def go() -> int:
        nc = await nats.connect(url)
        try:
            js = nc.jetstream()
            kv = await js.key_value(catalog.MEMBERS.bucket)
            beats = []
            for key in await bus.kv_keys(js, catalog.MEMBERS.bucket, f"{run}.rollout."):
                entry = await kv.get(key)
                beats.append(codec.decode(entry.value, Heartbeat))
            return (fleet_tickets if tickets else live_workers)(beats, "rollout", time.time(), 3.0)
        except Exception:  # the bucket or a key is not there yet (no worker started), or just deleted
            return -1
        finally:
            await nc.close()
    return asyncio.run(go())


@pytest.mark.slow
def test_bound_rises_when_a_second_rollout_worker_joins_and_falls_when_it_leaves(tmp_path, nats_url, loop_model_dir):
    run = "fleetbound"
    cfg = run_file(tmp_path, loop_model_dir, run_id=run, nats_url=nats_url, common={"heartbeat_s": 1.0},
                   trainer={"groups_per_step": G, "max_staleness": STALENESS},
                   # no trainer here: the workers serve their local weights after 1 s instead of waiting
                   rollout={"max_tickets": TICKETS, "initial_weights_timeout_s": 1.0})
    workers: list[subprocess.Popen] = []

    def start(i: int) -> None:
        workers.append(subprocess.Popen(
            [sys.executable, "-m", "services.launcher.cli", "service", "rollout", "--config", str(cfg),
             "--instance", f"rollout-{i}"], cwd=ROOT, stdout=open(tmp_path / f"rollout-{i}.log", "wb"),
            stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}))

    def bound() -> int:
        n = fleet(nats_url, run, tickets=True)  # each worker advertises its max_tickets (TICKETS)
        return fleet_bound(STALENESS, G, n if n >= 0 else None)

    try:
        start(0)
        wait_for(lambda: fleet(nats_url, run) == 1, 180, "the first rollout worker's heartbeat", interval=0.5)
        assert bound() == TICKETS + G == 4
        start(1)
        wait_for(lambda: fleet(nats_url, run) == 2, 180, "the second rollout worker's heartbeat", interval=0.5)
        assert bound() == 2 * TICKETS + G == 6
        # stop it once it consumes (a graceful stop deletes its member entry)
        wait_for(lambda: "serving the local weights" in (tmp_path / "rollout-1.log").read_text(), 180,
                 "the second worker to serve")
        workers[1].terminate()
        assert workers[1].wait(60) == 0
        wait_for(lambda: fleet(nats_url, run) == 1, 30, "the second worker to leave the fleet", interval=0.5)
        assert bound() == 4
    finally:
        for w in workers:
            if w.poll() is None:
                w.terminate()
                w.wait(60)


def trainer_bound(url: str, run: str) -> float | None:
    """The trainer's admission bound from its heartbeat (``trainer/admission_bound``)."""
    async def go() -> float | None:
        nc = await nats.connect(url)
        try:
            kv = await nc.jetstream().key_value(catalog.MEMBERS.bucket)
            hb = codec.decode((await kv.get(f"{run}.trainer.trainer-0")).value, Heartbeat)
            return hb.metrics.get("trainer/admission_bound")
        except Exception:  # not heartbeating yet
            return None
        finally:
            await nc.close()
    return asyncio.run(go())


@pytest.mark.slow
def test_trainer_admission_bound_follows_a_joining_rollout_worker(tmp_path, nats_url, loop_model_dir):
    run = "fleetloop"
    cfg = run_file(tmp_path, loop_model_dir, run_id=run, nats_url=nats_url, common={"heartbeat_s": 1.0},
                   trainer={"groups_per_step": G, "max_staleness": STALENESS, "total_steps": 100000},
                   rollout={"max_tickets": TICKETS})
    procs: list[subprocess.Popen] = []

    def start(svc: str, instance: str) -> None:
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "services.launcher.cli", "service", svc, "--config", str(cfg),
             "--instance", instance], cwd=ROOT, stdout=open(tmp_path / f"{instance}.log", "wb"),
            stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}))

    try:
        for svc, instance in (("trainer", "trainer-0"), ("judge", "judge-0"), ("rollout", "rollout-0")):
            start(svc, instance)
        wait_for(lambda: trainer_bound(nats_url, run) == TICKETS + G, 300, "the bound for one worker", interval=0.5)
        start("rollout", "rollout-1")
        wait_for(lambda: trainer_bound(nats_url, run) == 2 * TICKETS + G, 300, "the bound for two workers",
                 interval=0.5)
        assert "admission bound 4 -> 6 groups (the live rollout workers hold 4 at once)" in (tmp_path / "trainer-0.log").read_text()
        assert all(p.poll() is None for p in procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
