"""Multi-host on one machine: network namespaces stand for hosts. NATS runs on one, the trainer on a second,
rollout and judge on a third, each joined to the NATS host by its own veth pair in a private range the test
creates (and deletes); the loop runs across them. Then the rollout/judge host's link is cut
(``ip link set ... down``) for longer than the clients' ping timeout and restored: the run steps again and
the accounting identity holds (nothing lost). Needs root and iproute2 (``ip netns``); fails, not skips,
without them."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import nats
import pytest

from bench._netns import PORT, Hosts
from services.launcher.accounting import accounting
from services.runtime.natsd import find_nats_server
from tests.conftest import run_file, trainer_records, wait_for

pytestmark = pytest.mark.slow


def last_step(metrics: Path) -> tuple[int, float]:
    """(step, time) of the newest trainer step recorded so far."""
    newest = max(trainer_records(metrics), key=lambda r: r["step"], default=None)
    return (0, 0.0) if newest is None else (newest["step"], newest["time"])


async def live_members(url: str, service: str) -> int:
    """Instances of ``service`` in the members bucket (an entry expires 30 s after its last heartbeat)."""
    from services.launcher.status import members

    nc = await nats.connect(url, connect_timeout=5)
    try:
        return sum(1 for m in await members(nc.jetstream(), "multihost") if m["service"] == service)
    finally:
        await nc.close()


def test_loop_across_namespaced_hosts_survives_a_cut_link(tmp_path, loop_model_dir):
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.fail("this test needs root and iproute2 (ip netns): run it as root with iproute2 installed",
                    pytrace=False)
    hosts = Hosts(f"rlb{os.getpid() % 10000}", 200 + os.getpid() % 50)
    procs: list[subprocess.Popen] = []
    cfg = run_file(tmp_path, loop_model_dir, run_id="multihost",
                   common={"heartbeat_s": 1.0, "drain_timeout_s": 3.0},
                   trainer={"groups_per_step": 4, "total_steps": 100000, "max_staleness": 1,
                            "checkpoint_every": 5, "group_timeout_s": 60,
                            "eval": {"prompts": 8}},
                   rollout={"max_tickets": 8},
                   extra="[nats]\nconnect_timeout_s = 2.0\nreconnect_wait_s = 0.5\nping_interval_s = 1.0\n"
                         "max_outstanding_pings = 3\n")
    metrics = tmp_path / "run" / "metrics.jsonl"
    conf = tmp_path / "nats.conf"
    conf.write_text("max_payload: 8388608\n")
    try:
        hosts.up()
        procs.append(hosts.run("nats", [find_nats_server(), "-js", "-a", "0.0.0.0", "-p", str(PORT), "-sd",
                                        str(tmp_path / "js"), "-c", str(conf)], tmp_path / "nats.log"))
        cli = [sys.executable, "-m", "services.launcher.cli", "service"]
        for host, svc in (("a", "trainer"), ("b", "rollout"), ("b", "judge")):
            procs.append(hosts.run(host, [*cli, svc, "--config", str(cfg), "--nats-url", hosts.addr[host],
                                          "--instance", f"{svc}-0"], tmp_path / f"{svc}.log"))
        wait_for(lambda: last_step(metrics)[0] >= 3, 400, "three steps across the hosts", interval=1.0)
        assert all(p.poll() is None for p in procs), [p.args for p in procs if p.poll() is not None]

        hosts.link("b", "down")  # rollout and judge lose the bus
        step, _ = last_step(metrics)
        cut_at = time.time()
        # down longer than the clients' ping timeout (~3 s) and than the launcher's heartbeat timeout (the
        # rollout's entry in the members bucket expires)
        for svc in ("rollout", "judge"):
            wait_for(lambda svc=svc: "disconnected from NATS" in (tmp_path / f"{svc}.log").read_text(), 120,
                     f"the {svc} on the cut host to notice it")
        wait_for(lambda: asyncio.run(live_members(hosts.addr["root"], "rollout")) == 0, 120,
                 "the rollout's last heartbeat to expire (30 s: the launcher's heartbeat timeout)", interval=1.0)
        hosts.link("b", "up")
        wait_for(lambda: last_step(metrics)[1] > cut_at and last_step(metrics)[0] >= step + 2, 400,
                 "steps after the link came back", interval=1.0)
        assert all(p.poll() is None for p in procs), "a service died over the cut link"

        for p in procs[1:]:
            p.terminate()
        for p in procs[1:]:
            p.wait(60)

        async def check() -> dict:
            nc = await nats.connect(hosts.addr["root"], connect_timeout=5)
            acc = await accounting(nc.jetstream(), "multihost")
            await nc.close()
            return acc

        acc = asyncio.run(check())
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        hosts.down()
    assert acc["lost"] == 0, acc
    assert acc["trained"] > 0 and acc["outcomes_without_trajectory"] == 0, acc
    assert acc["published"] == acc["trained"] + acc["dropped"] + acc["eval"] + acc["pending"] - acc["multiple_outcomes"]
