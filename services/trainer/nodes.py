"""A trainer rank group over several nodes: how ranks are started, and how node 0 drives the other nodes.

One rank group spans ``nnodes`` nodes of ``nproc_per_node`` ranks each (torchrun's terms; the keys are in
``[services.trainer.devices]``). Node 0's trainer service is rank 0: it alone talks to the bus, and it
drives every rank with the commands of :mod:`services.trainer.ranks`. On node ``n > 0`` the trainer
service is a *node agent* (:func:`node_agent`): it connects to node 0 (``master_addr:master_port + 1``),
starts the node's ranks ``n * nproc_per_node ...`` as its children, and relays node 0's commands to them.
Tensors move only through torch.distributed, whose rendezvous is ``tcp://master_addr:master_port`` (rank
0 hosts it).

Failure stays all-or-nothing: node 0 sees a node's link close (the agent died, or one of its ranks did
and the agent stopped the others) as a dead rank and stops the group; an agent whose link closes (node 0
died) stops its ranks and exits non-zero. Node 0 waits for the other nodes at most ``rank_timeout_s``.

Commands travel pickled from node 0 to the agents (as they do to local ranks over their stdin): run a
group only on a network its nodes trust, as torch.distributed's own rendezvous assumes.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

from services.runtime.natsd import die_with_parent
from services.runtime.placement import CPUS_ENV, THREAD_ENV, format_cpus, inherited_cpus, split_evenly
from services.trainer.config import DevicesConfig

log = logging.getLogger("rlbus.trainer.nodes")

_REPO = Path(__file__).resolve().parents[2]


def rank_cpus(devices: DevicesConfig, local_rank: int) -> list[int]:
    """The CPUs of ``local_rank`` when this process was placed on CPUs (``RLBUS_PLACEMENT_CPUS``): the node's
    list split evenly among its ranks ([]: not placed)."""
    cpus = inherited_cpus()
    return split_evenly(cpus, devices.nproc_per_node)[local_rank] if cpus else []


def start_rank(rank: int, devices: DevicesConfig, rank_dir: Path) -> subprocess.Popen[bytes]:
    """Rank ``rank`` as a child process reading its commands from a stdin pipe, pinned to its share of the
    node's CPUs (with thread counts to match) when the node was placed."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(_REPO), os.environ.get("PYTHONPATH", "")) if p)}
    cpus = rank_cpus(devices, rank % devices.nproc_per_node)
    if cpus:
        env.update({CPUS_ENV: format_cpus(cpus), **{name: str(len(cpus)) for name in THREAD_ENV}})

    def preexec() -> None:
        die_with_parent()
        if cpus:
            os.sched_setaffinity(0, cpus)

    with open(rank_dir / f"rank-{rank}.log", "ab") as logf:
        proc = subprocess.Popen([sys.executable, "-m", "services.trainer.ranks", "--rank", str(rank)],
                                stdin=subprocess.PIPE, stdout=logf, stderr=subprocess.STDOUT, env=env,
                                preexec_fn=preexec)
    (rank_dir / f"rank-{rank}.pid").write_text(str(proc.pid))
    return proc


class RemoteNode:
    """Node 0's handle on a connected node agent, shaped like the ``Popen`` of a local rank: ``stdin``
    carries the commands, ``wait()`` returns the agent's exit code (1 when its link closed without one)."""

    def __init__(self, node_rank: int, conn: socket.socket) -> None:
        self.node_rank = node_rank
        self.conn = conn
        self.stdin: IO[bytes] = conn.makefile("wb")
        self.pid = f"node {node_rank} at {conn.getpeername()[0]}"
        self._code: int | None = None
        self._done = threading.Event()
        threading.Thread(target=self._read, name=f"trainer-node-{node_rank}-link", daemon=True).start()

    def _read(self) -> None:
        try:
            line = self.conn.makefile("rb").readline()
            self._code = int(line) if line.strip() else 1
        except (OSError, ValueError):
            self._code = 1
        self._done.set()

    def poll(self) -> int | None:
        return self._code if self._done.is_set() else None

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(f"trainer node {self.node_rank}", timeout or 0.0)
        return self._code if self._code is not None else 1

    def kill(self) -> None:
        try:
            self.conn.shutdown(socket.SHUT_RDWR)
        except OSError as e:  # already gone
            log.debug("trainer node %d: link already closed (%s)", self.node_rank, e)


def accept_nodes(devices: DevicesConfig, timeout_s: float) -> dict[int, RemoteNode]:
    """Node 0: wait (at most ``timeout_s``) until every other node's agent has connected; by node rank."""
    nodes: dict[int, RemoteNode] = {}
    with socket.create_server(("", devices.master_port + 1), reuse_port=False) as server:
        deadline = time.monotonic() + timeout_s
        while len(nodes) < devices.nnodes - 1:
            server.settimeout(max(deadline - time.monotonic(), 0.001))
            try:
                conn, addr = server.accept()
            except TimeoutError:
                missing = sorted(set(range(1, devices.nnodes)) - set(nodes))
                raise TimeoutError(f"trainer node(s) {missing} did not connect to port {devices.master_port + 1} "
                                   f"within {timeout_s:.0f}s (services.trainer.devices.rank_timeout_s)") from None
            conn.settimeout(timeout_s)
            hello = json.loads(conn.makefile("rb").readline() or b"{}")
            conn.settimeout(None)
            node_rank = hello.get("node_rank")
            if not isinstance(node_rank, int) or not 0 < node_rank < devices.nnodes or node_rank in nodes:
                log.warning("trainer rank group: refused a link from %s (hello %r)", addr, hello)
                conn.close()
                continue
            nodes[node_rank] = RemoteNode(node_rank, conn)
            log.info("trainer node %d connected from %s", node_rank, addr[0])
    return nodes


def _connect(devices: DevicesConfig) -> socket.socket:
    """Node n > 0: reach node 0's command port, retrying (node 0 may start later) for rank_timeout_s."""
    deadline = time.monotonic() + devices.rank_timeout_s
    delay = 0.2
    while True:
        try:
            return socket.create_connection((devices.master_addr, devices.master_port + 1), timeout=10.0)
        except OSError as e:
            if time.monotonic() > deadline:
                raise ConnectionError(f"trainer node {devices.node_rank}: node 0 at {devices.master_addr}:"
                                      f"{devices.master_port + 1} not reachable within {devices.rank_timeout_s:.0f}s "
                                      f"({e})") from e
            time.sleep(delay)  # connection retry backoff, not synchronisation
            delay = min(delay * 2, 5.0)


def node_agent(devices: DevicesConfig, run_dir: Path) -> int:
    """Node ``devices.node_rank`` (> 0): start this node's ranks and relay node 0's commands to them until
    ``stop``; returns the exit code (0 after a clean stop)."""
    rank_dir = run_dir / "ranks"
    rank_dir.mkdir(parents=True, exist_ok=True)
    conn = _connect(devices)
    conn.settimeout(None)
    conn.sendall(json.dumps({"node_rank": devices.node_rank}).encode() + b"\n")
    first = devices.node_rank * devices.nproc_per_node
    procs = {r: start_rank(r, devices, rank_dir) for r in range(first, first + devices.nproc_per_node)}
    log.info("trainer node %d: ranks %s (pids %s), rendezvous tcp://%s:%d", devices.node_rank, list(procs),
             [p.pid for p in procs.values()], devices.master_addr, devices.master_port)
    stopping = threading.Event()

    def watch(rank: int, proc: subprocess.Popen[bytes]) -> None:
        code = proc.wait()
        if not (stopping.is_set() and code == 0):
            log.error("trainer rank %d (pid %d) exited with code %s: closing the link to node 0", rank, proc.pid, code)
            try:
                conn.shutdown(socket.SHUT_RDWR)  # node 0 sees the node gone and stops the group
            except OSError as e:
                log.debug("link already closed (%s)", e)

    for rank, proc in procs.items():
        threading.Thread(target=watch, args=(rank, proc), name=f"trainer-rank-{rank}-watch", daemon=True).start()
    commands = conn.makefile("rb")
    code = 1
    try:
        while True:
            try:
                name, args = pickle.load(commands)
            except (EOFError, OSError, pickle.UnpicklingError):
                log.error("trainer node %d: the link to node 0 closed; stopping this node's ranks", devices.node_rank)
                break
            if name == "stop":
                stopping.set()
            data = pickle.dumps((name, args), protocol=pickle.HIGHEST_PROTOCOL)
            for proc in procs.values():
                pipe: IO[bytes] = proc.stdin  # type: ignore[assignment]  # always a pipe (start_rank)
                pipe.write(data)
                pipe.flush()
            if name == "stop":
                codes = [p.wait(devices.rank_timeout_s) for p in procs.values()]
                code = max(codes, key=abs)
                break
    except (BrokenPipeError, OSError, subprocess.TimeoutExpired) as e:
        log.error("trainer node %d: %s", devices.node_rank, e)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        try:
            conn.sendall(f"{code}\n".encode())
        except OSError as e:  # node 0 went away first
            log.debug("exit code not sent (%s)", e)
        conn.close()
    return code
