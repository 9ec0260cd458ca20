"""Hosts on one machine: network namespaces joined by veth pairs (used by ``tests/cluster/test_multihost.py``
and ``bench/multihost.py``).

:class:`Hosts` makes namespaces ``<p>-nats``, ``<p>-a``, ``<p>-b`` and one veth pair from the NATS host to each
of the others and to the caller's own namespace, in 10.<net>.<k>.0/30 (k = 0 the caller, 1 host a, 2 host b).
Needs root and iproute2; :meth:`Hosts.delay` also needs ``tc`` (netem). :meth:`Hosts.down` deletes every
namespace and the caller's veth (deleting a namespace deletes the veths in it and their peers).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the NATS port inside the NATS namespace
PORT = 4222


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, timeout=30)


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

    def delay(self, ms: float, hosts: tuple[str, ...] = ("a", "b")) -> None:
        """netem ``delay ms`` on both ends of each named host's link: ``ms`` each way, 2 * ``ms`` round trip."""
        for host in hosts:
            sh("ip", "netns", "exec", f"{self.p}-{host}", "tc", "qdisc", "add", "dev", f"{self.p}{host}h", "root",
               "netem", "delay", f"{ms}ms")
            sh("ip", "netns", "exec", self.nats_ns, "tc", "qdisc", "add", "dev", f"{self.p}{host}n", "root",
               "netem", "delay", f"{ms}ms")

    def run(self, host: str, argv: list[str], log: Path) -> subprocess.Popen:
        ns = self.nats_ns if host == "nats" else f"{self.p}-{host}"
        return subprocess.Popen(["ip", "netns", "exec", ns, *argv], cwd=ROOT, stdout=open(log, "wb"),
                                stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def down(self) -> None:
        for ns in (self.nats_ns, f"{self.p}-a", f"{self.p}-b"):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", f"{self.p}rooth"], capture_output=True, timeout=30)

    def leftovers(self) -> list[str]:
        """This object's namespaces and host-side veth that still exist (empty after :meth:`down`)."""
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout.split()
        left = [ns for ns in (self.nats_ns, f"{self.p}-a", f"{self.p}-b") if ns in names]
        if subprocess.run(["ip", "link", "show", f"{self.p}rooth"], capture_output=True, timeout=30).returncode == 0:
            left.append(f"{self.p}rooth")
        return left


def netem_missing() -> str | None:
    """Why ``tc ... netem`` cannot be used here (None when it can): tried on ``lo`` of a scratch namespace."""
    ns = f"rlbmprobe{os.getpid() % 100000}"
    try:
        sh("ip", "netns", "add", ns)
        r = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", "netem",
                            "delay", "1ms"], capture_output=True, text=True, timeout=30)
        return None if r.returncode == 0 else (r.stderr or r.stdout).strip() or f"tc exited with {r.returncode}"
    except (OSError, subprocess.SubprocessError) as e:
        return str(e)
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
