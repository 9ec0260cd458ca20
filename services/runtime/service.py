"""The service harness: connect, provision, heartbeat, run, shut down gracefully.

A service is an object with ``async def run(self, ctx: ServiceContext) -> None``
that returns once ``ctx.stop`` is set and its work is drained. Everything
shared (connection, publishing, the consume loop, dead letters, heartbeats,
metrics, tracing, signals) lives here so each ``services/<name>/service.py`` holds only its work: ``build(loaded)`` and ``run(ctx)``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any, Protocol

import msgspec
from nats.aio.client import Client
from nats.js import api

from proto import catalog, codec, membership, subjects
from proto.membership import Heartbeat
from proto.metrics import MetricsReport
from services.runtime import bus, gang, lag, lifeline, metrics, tracing
from services.runtime.config import ConfigError, Loaded
from services.runtime.consume import Consumer, DeadLetterSink, Handler
from services.runtime.tasks import cancel_and_wait

log = logging.getLogger("rlbus.service")
#: exit code of a service stopped by a configuration error (sysexits' EX_CONFIG): supervisors do not restart it
CONFIG_ERROR_EXIT = 78


class Service(Protocol):
    async def run(self, ctx: ServiceContext) -> None: ...


class ServiceContext:
    """What a running service gets from the harness."""

    def __init__(self, name: str, instance: str, loaded: Loaded, nc: Client) -> None:
        self.name = name
        self.instance = instance
        self.cfg = loaded
        self.run_id = loaded.run.id
        self.nc = nc
        self.js = nc.jetstream(timeout=10.0)
        self.stop = asyncio.Event()
        self.state: membership.State = "starting"
        self.gauges: dict[str, float] = {}
        self.started_at = time.time()
        self.dead_letters = DeadLetterSink(self.js, self.run_id, name)
        self.log = logging.getLogger(f"rlbus.{name}")

    async def publish(self, channel: catalog.Channel, msg: msgspec.Struct, *subject_suffix: str,
                      run_id: str | None = None) -> api.PubAck | None:
        """Publish ``msg`` on ``channel`` of this run (``subject_suffix`` fills its suffix wildcards).

        Raises TypeError when ``msg`` is not of the channel's type. A stream channel gets a JetStream
        publish (retried while the server is away, deduplicated by ``msg_id``; returns the ack), any
        other a core-NATS publish (returns None). ``run_id``: another run's subject (the sandbox files
        events of a predecessor's orphans under their own run).
        """
        return await bus.publish_on(self.nc, self.js, channel, run_id or self.run_id, msg, *subject_suffix)

    async def publish_parts(self, channel: catalog.Channel, items: list[Any],
                            make: Callable[[list[Any]], msgspec.Struct]) -> list[tuple[Any, api.PubAck | None]]:
        """Publish ``make(items)`` (a group message) on ``channel``, split into consecutive parts when it would
        exceed this service's ``[common] max_message_bytes`` (what every consumer accepts); each part with its ack.
        The parts go out in a window (``[common] publish_window``, :func:`bus.in_window`): every part is tried,
        then the first failure is raised."""
        parts = codec.fit(items, make, self.cfg.common.max_message_bytes)
        acks = await bus.in_window((self.publish(channel, m) for m in parts), self.cfg.common.publish_window)
        for ack in acks:
            if isinstance(ack, BaseException):
                raise ack
        return list(zip(parts, acks, strict=True))  # type: ignore[arg-type]

    async def consume(self, channel: catalog.Channel, handler: Handler, *, concurrency: int = 16) -> Consumer[Any]:
        """Provision this run's durable consumer of ``channel`` and run the consume loop until ``stop``;
        ``handler(msg, delivery)`` gets each message decoded as the channel's type.

        Raises ValueError when the channel has no consumer (nothing to share: read its stream or subject).
        """
        if channel.consumer is None:
            raise ValueError(f"channel {channel.name} has no durable consumer: consume(channel, handler) "
                             "works for " + ", ".join(c.name for c in catalog.CHANNELS.values() if c.consumer))
        cdef = channel.consumer.for_run(self.run_id)
        await bus.ensure_consumer(self.js, cdef)
        c: Consumer[Any] = Consumer(
            self.js, cdef, channel.msg_type, handler, run_id=self.run_id, dead_letters=self.dead_letters,
            concurrency=concurrency, max_message_bytes=self.cfg.common.max_message_bytes,
            name=f"{self.name}:{cdef.durable}",
        )
        follow = asyncio.create_task(lag.follow(self.js, cdef, self.stop), name=f"{cdef.durable}-lag")
        try:
            await c.run(self.stop, self.cfg.common.drain_timeout_s)
        finally:
            follow.cancel()
        return c

    async def report(self, values: dict[str, float], step: int = -1) -> None:
        """Publish a metrics report (channel METRICS) and keep the values as heartbeat gauges."""
        self.gauges.update(values)
        metrics.follow_gauges(self.gauges)  # a reported figure is scrapeable at once, not from the next beat
        msg = MetricsReport(run_id=self.run_id, service=self.name, instance=self.instance, step=step, values=values)
        try:
            await self.publish(catalog.METRICS, msg, self.name)
        except Exception as e:  # metrics must not break the work
            self.log.warning("metrics publish failed: %s", e)

    def heartbeat(self) -> Heartbeat:
        return Heartbeat(
            run_id=self.run_id, service=self.name, instance=self.instance, host=socket.gethostname(),
            pid=os.getpid(), state=self.state, started_at=self.started_at, metrics=dict(self.gauges),
        )


class _Stopped(Exception):
    """Stopped by a signal before the service started working."""


async def _publish_heartbeat_now(ctx: ServiceContext) -> None:
    kv = await bus.ensure_kv(ctx.js, catalog.MEMBERS)
    data = bus.codec.encode(ctx.heartbeat())
    await kv.put(membership.member_key(ctx.run_id, ctx.name, ctx.instance), data)


async def _heartbeats(ctx: ServiceContext, period: float) -> None:
    kv = await bus.ensure_kv(ctx.js, catalog.MEMBERS)
    key = membership.member_key(ctx.run_id, ctx.name, ctx.instance)
    subj = catalog.HEARTBEATS.subject(ctx.run_id, ctx.name)
    while True:
        metrics.follow_gauges(ctx.gauges)  # gauges added since the last beat get their series
        hb = ctx.heartbeat()
        data = bus.codec.encode(hb)
        try:
            await ctx.nc.publish(subj, data)
            await kv.put(key, data)
        except Exception as e:  # disconnected: keep trying, the server comes back
            ctx.log.debug("heartbeat failed: %s", e)
        await asyncio.sleep(period)  # the heartbeat period itself


def setup_logging(name: str, level: str = "INFO") -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=f"%(asctime)s %(levelname)s [{name}] %(name)s: %(message)s",
        force=True,
    )


def install_uvloop() -> bool:
    try:
        import uvloop
    except ImportError:
        return False
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True


#: the parts of this process's colocated group (its trace file is named after all of them)
_colocated_names: list[str] = []


def colocated_names() -> list[str]:
    """The services sharing this process (``rlbus service trainer+rollout``), or [] when it runs one."""
    return list(_colocated_names)


async def serve_colocated(group: list[tuple[str, Callable[[Loaded], Service], Loaded, str | None]]) -> int:
    """Run several services in this process on one event loop (e.g. trainer + rollout sharing weights
    in memory through the inproc transport). Each has its own connection, login and heartbeats; when one
    stops (finished, crashed, or SIGTERM/SIGINT to the process) the others are stopped too, and the
    process exits with the first non-zero code of its parts (0 when all finished)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    _colocated_names[:] = [name for name, *_ in group]
    tasks = [asyncio.create_task(serve(name, factory, loaded, instance, stop=stop), name=f"serve-{name}")
             for name, factory, loaded, instance in group]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        stop.set()
        codes = await asyncio.gather(*tasks)
        await asyncio.to_thread(tracing.shutdown)
        await asyncio.to_thread(metrics.shutdown)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    return next((c for c in codes if c), 0)


async def serve(name: str, service_factory: Callable[[Loaded], Service], loaded: Loaded,
                instance: str | None = None, stop: asyncio.Event | None = None) -> int:
    """Run one service until SIGTERM/SIGINT (or until it returns). Returns the process exit code.

    With ``stop`` (colocated services) the caller owns the signals: setting ``stop`` drains this service."""
    subjects.check_run_id(loaded.run.id)
    instance = instance or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    tracing.setup(name if stop is None else "+".join(_colocated_names) or name, loaded.run.dir)
    port = metrics.setup(name, instance, loaded.common.metrics_port)
    nc = await bus.connect(loaded.nats, f"rlbus-{name}-{instance}")
    ctx = ServiceContext(name, instance, loaded, nc)
    if port is not None:
        ctx.gauges["metrics_port"] = float(port)  # in the heartbeat: rlbus status shows where to scrape
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        if not ctx.stop.is_set():
            lifeline.say_if_launcher_gone()  # the parent-death signal: say why before the (fast) stop
            log.info("%s: %s received; stopping (drain bound %.1fs)", name, sig.name, loaded.common.drain_timeout_s)
            ctx.state = "draining"
            ctx.stop.set()

    stop_watch = None
    if stop is None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal, sig)
    else:
        async def follow_stop() -> None:
            await stop.wait()
            on_signal(signal.SIGTERM)

        stop_watch = asyncio.create_task(follow_stop(), name=f"{name}-stop")
    hb = asyncio.create_task(_heartbeats(ctx, loaded.common.heartbeat_s), name=f"{name}-heartbeat")
    code = 0
    try:
        await bus.provision_all(ctx.js)
        if loaded.gang is not None and loaded.gang.roles:
            ctx.state = "waiting"
            await _publish_heartbeat_now(ctx)
            barrier = asyncio.create_task(gang.barrier(ctx.js, ctx.run_id, name, loaded.gang), name=f"{name}-gang")
            stop_wait = asyncio.create_task(ctx.stop.wait(), name=f"{name}-gang-stop")
            done, _ = await asyncio.wait({barrier, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
            stop_wait.cancel()
            if barrier not in done:
                barrier.cancel()
                raise _Stopped()
            barrier.result()
        service = service_factory(loaded)
        ctx.state = "running"
        log.info("%s: running (run %s, instance %s, nats %s)", name, ctx.run_id, instance, loaded.nats.url)
        await service.run(ctx)
    except _Stopped:
        code = 0
    except gang.GangFailed as e:
        log.error("%s: %s", name, e)
        code = gang.GANG_FAILED_EXIT
    except ConfigError as e:  # the run file must change: a restart would fail the same way
        log.error("%s: configuration error: %s", name, e)
        code = CONFIG_ERROR_EXIT
    except Exception:
        log.exception("%s: crashed", name)
        code = 1
    finally:
        ctx.state = "stopped"
        await cancel_and_wait(hb)  # before the delete: a heartbeat's KV put can swallow one cancel (3.11)
        try:
            kv = await ctx.js.key_value(catalog.MEMBERS.bucket)
            await kv.delete(membership.member_key(ctx.run_id, name, instance))
        except Exception as e:
            log.debug("could not remove membership key: %s", e)
        try:
            await asyncio.wait_for(nc.drain(), timeout=5.0)
        except Exception as e:
            log.debug("drain failed: %s", e)
        if stop_watch is not None:
            stop_watch.cancel()
        else:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
    if stop is None:  # a colocated group flushes once, when all its parts stopped (serve_colocated)
        await asyncio.to_thread(tracing.shutdown)
        await asyncio.to_thread(metrics.shutdown)
    log.info("%s: stopped", name)
    return code
