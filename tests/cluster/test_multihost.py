"""Multi-host on one machine: network namespaces stand for hosts. NATS runs on one, the trainer on a second,
rollout and judge on a third, each joined to the NATS host by its own veth pair in a private range the test
creates (and deletes); the loop runs across them. Then the rollout/judge host's link is cut
(``ip link set ... down``) for longer than the clients' ping timeout and restored: the run steps again and
the accounting identity holds (nothing lost). Needs root and iproute2 (``ip netns``); fails, not skips,
without them."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import nats
import pytest

from services.launcher.accounting import accounting
from services.runtime.natsd import find_nats_server
from tests.conftest import run_file, wait_for

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
PORT = 4222


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, timeout=30)


def last_step(metrics: Path) -> tuple[int, float]:
    step, t = 0, 0.0
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line being written
            if "trainer/version" in rec and rec["step"] > step:
                step, t = rec["step"], rec["time"]
    return step, t


async def live_members(url: str, service: str) -> int:
    """Instances of ``service`` in the members bucket (an entry expires 30 s after its last heartbeat)."""
    from services.launcher.status import members

    nc = await nats.connect(url, connect_timeout=5)
    try:
        return sum(1 for m in await members(nc.jetstream(), "multihost") if m["service"] == service)
    finally:
        await nc.close()


class Hosts:
    """Namespaces ``<p>-nats``, ``<p>-a``, ``<p>-b`` and one veth pair from the NATS host to each of the
    others and to the test's own namespace (10.<n>.<k>.0/30 links)."""

    def __init__(self, prefix: str, net: int) -> None:
        self.p, self.net = prefix, net
        self.nats_ns = f"{prefix}-nats"
        self.addr: dict[str, str] = {}

    def up(self) -> None:
        sh("ip", "netns", "add", self.nats_ns)
        sh("ip", "-n", self.nats_ns, "link", "set", "lo", "up")
        for k, host in enumerate(["root", "a", "b"]):
            ns = None if host == "root" else f"{self.p}-{host}"
            here, there = f"{self.p}{host}h", f"{self.p}{host}n"  # host end, NATS end
            if ns:
                sh("ip", "netns", "add", ns)
                sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh("ip", "link", "add", here, "type", "veth", "peer", "name", there)
            sh("ip", "link", "set", there, "netns", self.nats_ns)
            if ns:
                sh("ip", "link", "set", here, "netns", ns)
            inside = ["ip", "-n", ns] if ns else ["ip"]
            sh(*inside, "addr", "add", f"10.{self.net}.{k}.2/30", "dev", here)
            sh(*inside, "link", "set", here, "up")
            sh("ip", "-n", self.nats_ns, "addr", "add", f"10.{self.net}.{k}.1/30", "dev", there)
            sh("ip", "-n", self.nats_ns, "link", "set", there, "up")
            self.addr[host] = f"nats://10.{self.net}.{k}.1:{PORT}"

    def link(self, host: str, state: str) -> None:
        sh("ip", "-n", f"{self.p}-{host}", "link", "set", f"{self.p}{host}h", state)

    def run(self, host: str, argv: list[str], log: Path) -> subprocess.Popen:
        ns = self.nats_ns if host == "nats" else f"{self.p}-{host}"
        return subprocess.Popen(["ip", "netns", "exec", ns, *argv], cwd=ROOT, stdout=open(log, "wb"),
                                stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def down(self) -> None:
        for ns in (self.nats_ns, f"{self.p}-a", f"{self.p}-b"):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", f"{self.p}rooth"], capture_output=True, timeout=30)


def test_loop_across_namespaced_hosts_survives_a_cut_link(tmp_path, loop_model_dir):
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.fail("this test needs root and iproute2 (ip netns): run it as root with iproute2 installed",
                    pytrace=False)
    hosts = Hosts(f"rlb{os.getpid() % 10000}", 200 + os.getpid() % 50)
    procs: list[subprocess.Popen] = []
    cfg = run_file(tmp_path, loop_model_dir, run_id="multihost",
                   common={"heartbeat_s": 1.0, "drain_timeout_s": 3.0},
                   trainer={"groups_per_step": 4, "total_steps": 100000, "max_staleness": 1, "eval_prompts": 8,
                            "checkpoint_every": 5, "group_timeout_s": 60},
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
