"""Local supervisor: an embedded nats-server plus each service as its own child process.

Start order: NATS, then every service. Stop order (Ctrl-C / SIGTERM): SIGTERM to
every service, wait up to the drain bound, SIGKILL what is left, then stop NATS.
A service that exits unexpectedly is restarted with exponential backoff; one
that keeps crashing (``max_restarts`` within the window) is reported and left down.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from proto import catalog
from services.launcher.autoscale import CONSUMERS, desired_count
from services.launcher.environments import python_for
from services.launcher.placement import Layout, Placed
from services.launcher.runfile import LauncherSection, RunFile, provision_run
from services.launcher.usage import UsageLog
from services.runtime import lifeline
from services.runtime.config import convert, load_tree
from services.runtime.gang import GANG_FAILED_EXIT
from services.runtime.natsd import EmbeddedNats, NatsCluster, port_is_free
from services.runtime.service import CONFIG_ERROR_EXIT
from services.runtime.weights_config import InprocConfig

log = logging.getLogger("rlbus.launcher")


def _instance_of(data: bytes) -> str:
    try:
        return str(msgspec.msgpack.decode(data).get("instance", "?"))
    except Exception:
        return "?"


#: services whose instances share one durable consumer (a queue group): they may come and go mid-run
SCALABLE = {"rollout", "judge", "sandbox"}

#: lines of a crash-looping service's log quoted in the launcher's report
CRASH_LOG_LINES = 10


def last_lines(path: Path, n: int) -> list[str]:
    """The last ``n`` lines of a log file (fewer if it is shorter; none if it cannot be read)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            return f.read().decode("utf-8", errors="replace").splitlines()[-n:]
    except OSError:
        return []


@dataclass
class Child:
    service: str
    index: int
    argv: list[str]
    log_path: Path
    placed: Placed = field(default_factory=Placed)  # its GPUs and CPUs (CUDA_VISIBLE_DEVICES, affinity)
    proc: subprocess.Popen[bytes] | None = None
    restarts: list[float] = field(default_factory=list)
    started_at: float = 0.0
    next_start: float = 0.0
    given_up: bool = False
    #: removed by a scale-down: stopped gracefully, never restarted
    retired: bool = False

    @property
    def label(self) -> str:
        return f"{self.service}-{self.index}"


class Supervisor:
    def __init__(self, config_path: str | None, overrides: Sequence[str] = (), env: dict[str, str] | None = None,
                 quiet: bool = False) -> None:
        self.config_path = str(Path(config_path).resolve()) if config_path else None
        self.overrides = list(overrides)
        tree = load_tree(config_path, env, overrides)
        nats_tree = tree.get("nats") if isinstance(tree.get("nats"), dict) else {}
        size = convert(tree.get("launcher"), LauncherSection, "launcher").nats_cluster
        if size in (3, 5) and "replicas" not in nats_tree and (tree.get("launcher") or {}).get("embedded_nats", True):
            self.overrides.append(f"nats.replicas={size}")  # replicas default to the cluster's size
        self.runfile = RunFile.load(config_path, env, self.overrides)
        # what the launcher derives (a broadcast group's size) every service it starts gets too
        self.overrides += self.runfile.check()
        if self.overrides[len(overrides):]:
            self.runfile = RunFile.load(config_path, env, self.overrides)
        self.run, self.launcher = self.runfile.run, self.runfile.launcher
        self.layout = Layout(self.runfile).check_host()  # each process's GPUs and CPUs ([placement])
        self.run_dir = Path(self.run.dir).resolve()
        self.nats: EmbeddedNats | NatsCluster | None = None
        self.nats_url = ",".join(self.runfile.nats.servers())
        self.children: list[Child] = []
        self.stopping = threading.Event()
        self.quiet = quiet
        self.events: list[dict[str, Any]] = []
        self.usage = UsageLog(self.run_dir / "usage.jsonl")
        self.gang = self.runfile.gang
        self.gang_failed = False
        self.last_seen: dict[str, float] = {}  # "<service>/<instance>" -> monotonic time of its last heartbeat
        self.monitor_connected_since: float | None = None  # None: heartbeats are not being watched
        self.monitor_closed = threading.Event()  # set once the monitor has disconnected (or never ran)
        self.monitor_closed.set()
        self.auth: Any = None  # services.launcher.auth.AuthBundle when the embedded server has users
        self.control: Any = None  # services.launcher.control.ControlServer while running
        self._layout_lock = threading.Lock()  # scale() (control thread) against poll() (supervision thread)

    # --- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        if self.launcher.embedded_nats:
            config_file = None
            if self.launcher.auth:
                from services.launcher.auth import generate_auth

                relay = self.runfile.services.weightsync.relay
                roles = [part for name in self.launcher.services for part in name.split("+")]
                self.auth = generate_auth(self.run_dir, roles, run_id=self.run.id,
                                          relay_scopes=[relay.scope] if relay is not None else [],
                                          max_payload=8 * 1024 * 1024)
                config_file = self.auth.server_config
            if self.launcher.nats_cluster > 1:
                port = self.launcher.nats_port
                self.nats = NatsCluster(self.run_dir / "nats", self.launcher.nats_cluster, config_file=config_file,
                                        ports=[port] if port_is_free(port) else None)
            else:
                self.nats = EmbeddedNats(self.run_dir / "nats", port=self.launcher.nats_port,
                                         config_file=config_file)
            self.nats.start()
            self.nats_url = self.nats.url
        resolved = self.runfile.resolved()  # every key, defaults included
        resolved["nats"]["url"] = self.nats_url
        (self.run_dir / "config.resolved.json").write_text(json.dumps(resolved, indent=2, default=str))
        self._say(f"nats {self.nats_url} (data {self.run_dir / 'nats'})")
        asyncio.run(self._provision())
        for name, count in self.launcher.services.items():
            for i in range(count):
                self.children.append(self._child(name, i))
        for c in self.children:
            self._spawn(c)
        from services.launcher.control import ControlServer

        self.control = ControlServer(self.run_dir, self.scale).start()

    def _child(self, name: str, i: int) -> Child:
        argv = [python_for(name, self.runfile), "-m", "services.launcher.cli", "service", name,
                "--nats-url", self.nats_url, "--instance", f"{name}-{i}"]
        if self.config_path:
            argv += ["--config", self.config_path]
        for o in self.overrides:
            argv += ["--set", o]
        if self.auth is not None:  # after the user's overrides: the generated login wins
            parts = name.split("+")
            for part in parts:
                for o in self.auth.for_role(part).nats_overrides():
                    argv += ["--set", o] if len(parts) == 1 else ["--part-set", f"{part}:{o}"]
        return Child(name, i, argv, self.run_dir / "logs" / f"{name}-{i}.log", self.layout.for_instance(name, i))

    # --- elastic fleets ---------------------------------------------------------------------------

    def scale(self, name: str, count: int) -> dict[str, int]:
        """Run ``count`` instances of ``name`` from now on: new ones start at once; the highest-numbered
        ones get SIGTERM (they drain; what they had not acked is redelivered to the others) and are not
        restarted. Only queue-group workers scale (:data:`SCALABLE`); returns the layout after the change."""
        from services.launcher.control import ControlError

        if name not in self.launcher.services:
            raise ControlError(f"{name} is not a service of this run (its layout: "
                               f"{', '.join(f'{n}={c}' for n, c in self.launcher.services.items())})")
        if not set(name.split("+")) <= SCALABLE:
            raise ControlError(f"{name} cannot be scaled while the run goes: only {', '.join(sorted(SCALABLE))} "
                               "workers share their work through a durable consumer")
        if count < 0 or count > 64:
            raise ControlError(f"{name}={count}: expected 0..64 instances")
        if "rollout" in name.split("+") and isinstance(self.runfile.weights, InprocConfig):
            raise ControlError("rollout engines of the inproc weight transport live in the trainer's process: "
                               "the store and broadcast transports let engines come and go")
        with self._layout_lock:
            if self.stopping.is_set():
                raise ControlError("the run is stopping")
            live = [c for c in self.children if c.service == name and not c.retired]
            for c in live[count:]:
                c.retired = True
                if c.proc is not None and c.proc.poll() is None:
                    c.proc.send_signal(signal.SIGTERM)
                self._say(f"{c.label}: scaled down (SIGTERM; its unacked work is redelivered)")
            next_index = max((c.index for c in self.children if c.service == name), default=-1) + 1
            for i in range(next_index, next_index + max(count - len(live), 0)):
                c = self._child(name, i)
                self.children.append(c)
                self._spawn(c)
            self.launcher.services[name] = count
            self.events.append({"event": "scale", "service": name, "count": count, "t": time.time()})
            return dict(self.launcher.services)

    def nats_section(self, role: str = "launcher") -> Any:
        """The [nats] section for the launcher's own connections (with its login when the server has users)."""
        nats_cfg = msgspec.structs.replace(self.runfile.nats, url=self.nats_url)
        if self.auth is not None:
            creds = self.auth.for_role(role)
            nats_cfg.user, nats_cfg.password = creds.user, creds.password
        return nats_cfg

    async def _provision(self) -> None:
        """Streams and buckets exist (and match the catalog, with [nats] replicas) before any service
        starts, the weight buckets too; a fresh gang."""
        from services.runtime import bus, gang

        nc = await bus.connect(self.nats_section(), "rlbus-launcher", first_attempts=10)
        try:
            await provision_run(nc.jetstream(), self.runfile)
            if self.gang.roles:
                await gang.reset(nc.jetstream(), self.run.id)
        finally:
            await nc.close()

    def _spawn(self, c: Child) -> None:
        with open(c.log_path, "ab") as logf:
            # own session: a terminal Ctrl-C reaches only the supervisor, which stops children in order
            c.proc = subprocess.Popen(c.argv, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True,
                                      env={**os.environ, "PYTHONUNBUFFERED": "1", **c.placed.env, **lifeline.launcher_env(
                                          self.launcher.stop_timeout_s)}, preexec_fn=c.placed.preexec())
        c.started_at = time.monotonic()
        self._say(f"started {c.label} (pid {c.proc.pid}, log {c.log_path})")

    def _say(self, text: str) -> None:
        if self.quiet:
            log.info(text)
        else:
            print(f"[rlbus] {text}", file=sys.stderr, flush=True)

    def _pids(self) -> dict[str, int]:
        """Live service processes and the embedded nats-server, by label."""
        pids = {c.label: c.proc.pid for c in list(self.children) if c.proc is not None and c.proc.poll() is None}
        proc = self.nats.proc if isinstance(self.nats, EmbeddedNats) else None
        if proc is not None and proc.poll() is None:
            pids["nats-server"] = proc.pid
        return pids

    def poll(self) -> None:
        """Restart children that exited (with backoff) or went silent; give up on crash loops."""
        now = time.monotonic()
        self.usage.record(self._pids)
        self._check_heartbeats(now)
        with self._layout_lock:
            children = list(self.children)
        for c in children:
            if c.retired:
                if c.proc is not None and c.proc.poll() is not None:
                    self.events.append({"event": "retired", "child": c.label, "code": c.proc.returncode,
                                        "t": time.time()})
                    self._say(f"{c.label} stopped (scaled down, exit code {c.proc.returncode})")
                    c.proc, c.given_up = None, True
                continue
            if c.given_up or c.proc is None:
                if c.proc is None and not c.given_up and now >= c.next_start and not self.stopping.is_set():
                    self._spawn(c)
                continue
            code = c.proc.poll()
            if code is None:
                continue
            self.events.append({"event": "exit", "child": c.label, "code": code, "t": time.time()})
            c.proc = None
            if code == 0:
                c.given_up = True  # finished its work (e.g. the trainer at the end of a run)
                self._say(f"{c.label} finished")
                continue
            if code == GANG_FAILED_EXIT:
                c.given_up = True
                self.gang_failed = True
                self._say(f"{c.label}: the run's gang was not admitted in time; see {c.log_path}")
                continue
            if code == CONFIG_ERROR_EXIT:  # restarting cannot help: the run file must change
                c.given_up = True
                tail = last_lines(c.log_path, CRASH_LOG_LINES)
                self.events.append({"event": "config_error", "child": c.label, "code": code, "last_lines": tail,
                                    "t": time.time()})
                self._say(f"{c.label} stopped on a configuration error, not restarting it (see {c.log_path}):\n"
                          + "\n".join(f"    {line}" for line in tail))
                continue
            if not self.launcher.restart or self.stopping.is_set():
                continue
            c.restarts = [t for t in c.restarts if now - t < self.launcher.restart_window_s] + [now]
            if len(c.restarts) > self.launcher.max_restarts:
                c.given_up = True
                tail = last_lines(c.log_path, CRASH_LOG_LINES)
                self.events.append({"event": "crash_loop", "child": c.label, "code": code, "crashes": len(c.restarts),
                                    "last_lines": tail, "t": time.time()})
                self._say(f"{c.label} exited with code {code} and crashed {len(c.restarts)} times within "
                          f"{self.launcher.restart_window_s:.0f}s: not restarting it (see {c.log_path}); its last "
                          f"log lines:\n" + "\n".join(f"    {line}" for line in tail))
                continue
            delay = min(2.0 ** (len(c.restarts) - 1), 30.0)
            c.next_start = now + delay
            self._say(f"{c.label} exited with code {code}; restarting in {delay:.0f}s")

    # --- heartbeat monitor -----------------------------------------------------------------------

    def start_heartbeat_monitor(self) -> None:
        """Watch the run's heartbeats from a thread of its own (its own event loop); the autoscaler, when
        configured, in another."""
        self.monitor_closed.clear()
        threading.Thread(target=lambda: asyncio.run(self._monitor()), name="heartbeat-monitor", daemon=True).start()
        if self.launcher.autoscale:
            threading.Thread(target=lambda: asyncio.run(self._autoscale()), name="autoscaler", daemon=True).start()

    async def _autoscale(self) -> None:
        """Every rule's period: read its consumer's lag, apply :func:`desired_count` through :meth:`scale`."""
        from services.runtime import bus

        nc = await bus.connect(self.nats_section(), "rlbus-launcher-autoscaler")
        js = nc.jetstream()
        low_since: dict[str, float | None] = {}
        next_look = {name: 0.0 for name in self.launcher.autoscale}
        try:
            while not self.stopping.is_set():
                now = time.monotonic()
                for name, rule in self.launcher.autoscale.items():
                    if now < next_look[name]:
                        continue
                    next_look[name] = now + rule.period_s
                    cdef = CONSUMERS[name].for_run(self.run.id)
                    try:
                        ci = await js.consumer_info(cdef.stream, cdef.durable)
                    except Exception as e:  # not created yet, or the bus is away: look again next period
                        log.debug("autoscale %s: no consumer info (%s)", name, e)
                        continue
                    lag = ci.num_pending + ci.num_ack_pending
                    current = self.launcher.services[name]
                    want, low_since[name] = desired_count(current, lag, rule, low_since.get(name), now)
                    if want != current:
                        self._say(f"autoscale: {name} {current} -> {want} (lag {lag}, target {rule.target_pending} "
                                  "per worker)")
                        try:
                            self.scale(name, want)
                        except Exception as e:  # stopping, or refused: said, and looked at again next period
                            self._say(f"autoscale: {name} not scaled: {e}")
                await asyncio.sleep(0.5)  # rule periods are checked this often
        finally:
            await nc.close()

    async def _monitor(self) -> None:
        from services.runtime import bus

        try:
            nc = await bus.connect(self.nats_section(), "rlbus-launcher-monitor")
        except BaseException:
            self.monitor_closed.set()
            raise
        self.monitor_connected_since = time.monotonic()

        async def on_hb(m: Any) -> None:
            self.last_seen[m.subject.rsplit(".", 1)[-1] + "/" + _instance_of(m.data)] = time.monotonic()

        await nc.subscribe(catalog.HEARTBEATS.wildcard(self.run.id), cb=on_hb)
        try:
            while not self.stopping.is_set():
                if not nc.is_connected:
                    self.monitor_connected_since = None
                elif self.monitor_connected_since is None:
                    self.monitor_connected_since = time.monotonic()
                await asyncio.sleep(0.2)  # connection-state sampling period (and how soon a stop is seen)
        finally:
            await nc.close()
            self.monitor_closed.set()

    def _check_heartbeats(self, now: float) -> None:
        timeout = self.launcher.heartbeat_timeout_s
        if not timeout or self.monitor_connected_since is None or now - self.monitor_connected_since < timeout:
            return  # the monitor itself has not been listening long enough to judge
        if not any(now - t < timeout / 2 for t in self.last_seen.values()):
            return  # nobody is heard: a bus problem, not a hung service
        for c in list(self.children):
            if c.retired or c.proc is None or c.proc.poll() is not None or now - c.started_at < timeout:
                continue
            heard = [self.last_seen.get(f"{p}/{p}-{c.index}") for p in c.service.split("+")]
            if any(seen is None or now - seen > timeout for seen in heard):
                self._say(f"{c.label}: no heartbeat for {timeout:.0f}s; killing it for a restart")
                self.events.append({"event": "hung", "child": c.label, "t": time.time()})
                c.proc.kill()

    def kill_child(self, label: str, sig: int = signal.SIGKILL) -> int | None:
        for c in self.children:
            if c.label == label and c.proc is not None:
                c.proc.send_signal(sig)
                return c.proc.pid
        return None

    def alive(self) -> list[str]:
        return [c.label for c in self.children if c.proc is not None and c.proc.poll() is None]

    def wait(self, until: threading.Event | None = None, tick: float = 0.5) -> None:
        """Supervise until ``stop()`` (or a signal) or ``until`` is set."""
        while not self.stopping.is_set() and not (until and until.is_set()):
            self.poll()
            self.stopping.wait(tick)  # supervision tick: child exits are checked this often

    def stop(self) -> None:
        self.stop_services()
        if self.nats is not None:
            # the heartbeat monitor disconnects first: a clean stop prints no "unexpected EOF" from it
            self.monitor_closed.wait(timeout=5.0)
            self.nats.stop()
            self.nats = None
        self._say("stopped")

    def stop_services(self) -> None:
        """SIGTERM every service, SIGKILL what has not drained within stop_timeout_s; NATS stays up."""
        with self._layout_lock:
            self.stopping.set()
        self.usage.record(self._pids, force=True)
        if self.control is not None:
            self.control.stop()
            self.control = None
        procs = [c.proc for c in list(self.children) if c.proc is not None and c.proc.poll() is None]
        for p in procs:
            p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.launcher.stop_timeout_s
        for p in procs:
            try:
                p.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                self._say(f"pid {p.pid} did not stop within {self.launcher.stop_timeout_s:.0f}s; killing it")
                p.kill()
                p.wait()

    def install_signal_handlers(self) -> None:
        def handler(signum: int, frame: Any) -> None:
            if not self.stopping.is_set():
                self._say(f"{signal.Signals(signum).name}: stopping all services")
            self.stopping.set()

        signal.signal(signal.SIGINT, handler)
        signal.signal(signal.SIGTERM, handler)
