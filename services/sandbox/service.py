"""The sandbox service: the backend's verbs as NATS request/reply, its lifecycle events on JetStream.

Channels (see :mod:`proto.catalog`): ``SANDBOX_REQUESTS`` with target ``create`` in queue group ``QUEUE_GROUP`` (one
instance of the run takes each create), ``SANDBOX_REQUESTS`` with this instance's id (every verb on a sandbox or
snapshot this instance owns) and ``SANDBOX_LIST`` (scatter/gather: every instance answers). Requests are core NATS
requests; each is answered with its reply Struct or an :class:`proto.sandbox.ErrorReply`.

* Admission (:mod:`.admission`): a request past its deadline is never started; creates run at most
  ``max_creating`` at once with a bounded queue; sandboxes held (a warm pool's included), the memory budget and
  ``max_in_flight`` are bounded. Past a bound the answer is ``overloaded`` (with ``retry_after_s``) at once, never
  a silence. Each admitted request runs in its own task. A warm pool refills only while admission is easy.
* A payload that does not decode, belongs to another run, or was sent to the wrong subject gets an
  ``invalid`` ErrorReply *and* a dead letter; the service carries on.
* Every backend event is queued by the backend's ``on_event`` callback and published, in order, by one
  task to channel ``SANDBOX_EVENTS`` (stream SANDBOX_EVENTS), carrying the trace context of the
  request that caused it. Nothing is dropped; a publish that keeps failing is retried.
* Shutdown (``ctx.stop``) stays within ``drain_timeout_s`` in all: drain the subscriptions and answer every request
  they still held and every queued create ``overloaded`` (the client sends it elsewhere), give in-flight requests
  half the bound (the rest are cancelled and answered ``unavailable``), ``backend.close()`` until 90 % of it
  (destroys every sandbox, reason ``shutdown``, and the warm pool; what is left past it stays for the reaper of the
  next instance), then flush the queued events in what remains.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from nats.aio.msg import Msg

from proto import catalog, codec
from proto import sandbox as api
from services.runtime import metrics, tracing
from services.runtime.config import Loaded
from services.runtime.service import ServiceContext
from services.sandbox.admission import Admission, Job, deadline_of
from services.sandbox.backend import (
    BackendUnavailable,
    SandboxBackend,
    SandboxError,
    create_backend,
    dispatch,
)
from services.sandbox.config import SandboxConfig
from services.sandbox.events import EventPublisher

log = logging.getLogger("rlbus.sandbox")
#: seconds the backend took per request, by verb (``create``, ``exec``, ...): rlbus_sandbox_request_seconds
_LATENCY = metrics.histogram("sandbox_request_seconds", "backend time of a sandbox request, by verb", unit="s")

#: Every request type; a payload is decoded as this union, then checked against its subject.
AnyRequest = (
    api.CreateRequest
    | api.ExecRequest
    | api.WriteFilesRequest
    | api.ReadFilesRequest
    | api.PauseRequest
    | api.ResumeRequest
    | api.SnapshotRequest
    | api.ForkRequest
    | api.DestroyRequest
    | api.ListRequest
    | api.RenewLeaseRequest
)

INSTANCE_TYPES: tuple[type, ...] = (
    api.ExecRequest, api.WriteFilesRequest, api.ReadFilesRequest, api.PauseRequest, api.ResumeRequest,
    api.SnapshotRequest, api.ForkRequest, api.DestroyRequest, api.RenewLeaseRequest,
)

#: What each subscription accepts, and how a client reaches it (for the error of a misrouted request).
_ROLES: dict[str, tuple[tuple[type, ...], str]] = {
    "create": ((api.CreateRequest,), "the create subject (queue group)"),
    "instance": (INSTANCE_TYPES, "the owning instance's subject (SANDBOX_REQUESTS with instance_of(id))"),
    "list": ((api.ListRequest,), "the list subject"),
}


def _belongs_on(req: object) -> str:
    return next(where for accepted, where in _ROLES.values() if isinstance(req, accepted))


#: shares of ``drain_timeout_s`` at shutdown: in-flight requests end by the first, sandboxes are destroyed by the
#: second, queued events get the rest
DRAIN_REQUESTS_SHARE = 0.5
DRAIN_CLOSE_SHARE = 0.9


@dataclass(frozen=True)
class _Rejection:
    """Why a request can never be served (its ``invalid`` reply, and the dead letter sent after it)."""

    reason: str
    error_type: str


class SandboxUnavailableError(RuntimeError):
    """The configured backend cannot run on this host; the service exits non-zero."""


class SandboxService:
    """Serves one backend instance over the bus (see the module docstring)."""

    def __init__(self, config: SandboxConfig, *, drain_timeout_s: float = 10.0,
                 max_message_bytes: int = codec.MAX_MESSAGE_BYTES) -> None:
        self.cfg = config
        self.drain_timeout_s = drain_timeout_s
        self.max_message_bytes = max_message_bytes
        self.admission = Admission(
            max_in_flight=config.max_in_flight, max_creating=config.creating_bound(),
            max_queued_creates=config.queued_creates_bound(), max_sandboxes=config.sandboxes_bound(),
            retry_after_s=config.overload_retry_after_s, live=lambda: self._held()[0], spare=lambda: self._held()[1],
        )
        self.backend: SandboxBackend | None = None
        self.reaped: list[str] = []
        self._live: set[str] = set()
        self._paused: set[str] = set()
        self._in_flight: set[asyncio.Task[None]] = set()
        self._requests = 0
        self._errors = 0
        #: monotonic time by which a stop must be over (set when it begins)
        self._stop_end = 0.0
        #: set at shutdown: requests still in the subscriptions' buffers are answered ``overloaded`` at once
        self._stopping = False

    @classmethod
    def from_loaded(cls, loaded: Loaded) -> SandboxService:
        return cls(loaded.service, drain_timeout_s=loaded.common.drain_timeout_s,
                   max_message_bytes=loaded.common.max_message_bytes)

    def _held(self) -> tuple[int, int]:
        """The sandboxes held (warm pool and destroys in progress included), and the pooled ones free to take."""
        return self.backend.held() if self.backend is not None else (len(self._live), 0)

    @property
    def instance_id(self) -> str:
        """The backend's instance id (what sandbox ids embed and the instance subject names)."""
        if self.backend is None:
            raise SandboxUnavailableError("the sandbox service has not started its backend yet")
        return self.backend.instance_id

    # --- lifecycle -------------------------------------------------------------------------------

    async def run(self, ctx: ServiceContext) -> None:
        events = EventPublisher(ctx)
        events.start()

        def on_event(event: api.SandboxEvent) -> None:
            self._count(ctx, event)
            events.put(event)

        backend = create_backend(self.cfg, on_event)
        backend.pressure = self.admission.pressure  # a warm pool refills only while admission is easy
        protect = getattr(backend, "protect_bus", None)
        if protect is not None:  # the bus's own addresses are never an egress target
            servers = [*ctx.nc.servers, *([ctx.nc.connected_url] if ctx.nc.connected_url else [])]
            endpoints = sorted({(u.hostname, u.port or 4222) for u in servers if u.hostname})
            await asyncio.to_thread(protect, endpoints)
        try:
            try:
                self.reaped = await backend.start()
            except BackendUnavailable as e:
                log.error("refusing to start: %s", e)  # the backend's message names what is missing and the way out
                raise SandboxUnavailableError(f"sandbox backend {self.cfg.type!r} unavailable: {e}") from None
            self.backend = backend
            if self.reaped:
                log.warning("reaped %d orphaned sandboxes left by dead instances: %s", len(self.reaped),
                            ", ".join(self.reaped))
            ctx.gauges["sandbox/orphans_reaped"] = float(len(self.reaped))
            await self._serve(ctx, backend)
        finally:
            await events.close(max(0.1, self._stop_end - time.monotonic()) if self._stop_end else self.drain_timeout_s)
            ctx.gauges["sandbox/events_published"] = float(events.published)

    async def _serve(self, ctx: ServiceContext, backend: SandboxBackend) -> None:
        adm = self.admission

        def gauges() -> None:
            ctx.gauges.update(adm.gauges())
            ctx.gauges.update(backend.gauges())

        def start(job: Job) -> None:
            task = asyncio.create_task(self._handle(ctx, backend, job), name=f"sandbox-{job.role}-request")
            self._in_flight.add(task)
            task.add_done_callback(lambda t: finished(t, job))

        def finished(task: asyncio.Task[None], job: Job) -> None:
            self._in_flight.discard(task)
            ready, expired = adm.done(job)
            for nxt in ready:
                start(nxt)
            for old in expired:
                self._refuse_soon(ctx, old.msg, "the request's deadline passed while it waited for a create slot")
            backend.wake_pool()
            gauges()

        def handler(role: str) -> Callable[[Msg], Awaitable[None]]:
            async def cb(msg: Msg) -> None:  # never waits: a full instance answers at once
                if self._stopping:  # delivered before the unsubscribe, read after it: answered, never started
                    await self._refuse(ctx, msg, "the instance is stopping; the request was not started")
                    return
                now = time.time()
                job = Job(msg=msg, role=role, deadline=deadline_of(msg, now, self.cfg.request_deadline_s),
                          arrived=now)
                verdict = adm.offer(job)
                if verdict is True:
                    start(job)
                elif verdict is not False:
                    await self._refuse(ctx, msg, verdict.message)
                gauges()

            return cb

        run = ctx.run_id
        subs = [
            await ctx.nc.subscribe(catalog.SANDBOX_REQUESTS.subject(run, api.CREATE_TARGET), queue=api.QUEUE_GROUP,
                                   cb=handler("create")),
            await ctx.nc.subscribe(catalog.SANDBOX_REQUESTS.subject(run, backend.instance_id), cb=handler("instance")),
            await ctx.nc.subscribe(catalog.SANDBOX_LIST.subject(run), cb=handler("list")),
        ]
        await ctx.nc.flush()
        log.info("sandbox instance %s serving run %s (%s backend; max_sandboxes %d, max_creating %d, memory budget "
                 "%d MiB)", backend.instance_id, run, self.cfg.type, adm.max_sandboxes, adm.max_creating,
                 self.cfg.memory_budget())
        try:
            await ctx.stop.wait()
        finally:
            t0 = time.monotonic()
            self._stop_end = t0 + self.drain_timeout_s
            self._stopping = True
            # stop accepting (new creates go to other instances); drained, not unsubscribed, which would drop
            # requests already received, their clients left to time out: each is answered "overloaded" at once
            requests_end = t0 + self.drain_timeout_s * DRAIN_REQUESTS_SHARE
            await self._stop_accepting(subs, self.drain_timeout_s * DRAIN_REQUESTS_SHARE / 2)
            for job in adm.abandon():  # never started: the client sends them to another instance
                await self._refuse(ctx, job.msg, "the instance is stopping; the create was not started")
            await self._drain_requests(max(0.1, requests_end - time.monotonic()))
            await backend.close(max(0.0, t0 + self.drain_timeout_s * DRAIN_CLOSE_SHARE - time.monotonic()))
            gauges()
            log.info("sandbox instance %s stopped serving in %.1fs", backend.instance_id, time.monotonic() - t0)

    async def _stop_accepting(self, subs: list[Any], timeout_s: float) -> None:
        """Drain ``subs`` (interest removed first), waiting ``timeout_s`` at most for what they hold to be answered;
        a drain still going then is one more in-flight request of :meth:`_drain_requests`."""
        async def drain(sub: Any) -> None:
            try:
                await sub.drain()
            except Exception as e:  # the connection is gone: nothing more arrives anyway
                log.debug("draining a subscription failed: %s", e)

        tasks = [asyncio.create_task(drain(sub), name="sandbox-drain-subscription") for sub in subs]
        _, late = await asyncio.wait(tasks, timeout=timeout_s)
        if late:  # held with the in-flight requests: waited for (then cancelled) within their share of the bound
            self._in_flight.update(late)
            log.warning("%d subscriptions still hold requests after %.1fs", len(late), timeout_s)

    async def _refuse(self, ctx: ServiceContext, msg: Msg, message: str) -> None:
        """Answer a request that was not started ``overloaded``."""
        self._errors += 1
        await self._respond(ctx, msg, api.ErrorReply(run_id=ctx.run_id, code="overloaded", message=message,
                                                     retry_after_s=self.cfg.overload_retry_after_s))

    def _refuse_soon(self, ctx: ServiceContext, msg: Msg, message: str) -> None:
        task = asyncio.create_task(self._refuse(ctx, msg, message), name="sandbox-refuse")
        self._in_flight.add(task)
        task.add_done_callback(self._in_flight.discard)

    async def _drain_requests(self, timeout_s: float) -> None:
        pending = set(self._in_flight)
        if not pending:
            return
        log.info("waiting up to %.1fs for %d in-flight sandbox requests", timeout_s, len(pending))
        _, late = await asyncio.wait(pending, timeout=timeout_s)
        if late:
            log.warning("abandoning %d sandbox requests still running after %.1fs", len(late), timeout_s)
            for task in late:
                task.cancel()
            await asyncio.wait(late, timeout=max(0.1, self._stop_end - time.monotonic()))

    def _count(self, ctx: ServiceContext, event: api.SandboxEvent) -> None:
        """Keep the heartbeat gauges (live and paused sandboxes) in step with the events."""
        kind, sid = event.kind, event.sandbox_id
        if kind in ("created", "forked"):
            self._live.add(sid)
        elif kind == "paused":
            self._paused.add(sid)
        elif kind == "resumed":
            self._paused.discard(sid)
        elif kind == "destroyed":
            self._live.discard(sid)
            self._paused.discard(sid)
        ctx.gauges["sandbox/live"] = float(len(self._live))
        ctx.gauges["sandbox/paused"] = float(len(self._paused))

    # --- one request -----------------------------------------------------------------------------

    async def _handle(self, ctx: ServiceContext, backend: SandboxBackend, job: Job) -> None:
        msg, role = job.msg, job.role
        with tracing.span(f"sandbox {role}", kind="consumer", headers=msg.headers or {}) as span:
            try:
                if time.time() > job.deadline:  # it waited past its deadline: its sender is gone
                    self.admission.refused["deadline"] += 1
                    reply: Any = api.ErrorReply(run_id=ctx.run_id, code="overloaded",
                                                message="the request's deadline passed before it could start",
                                                retry_after_s=self.cfg.overload_retry_after_s)
                    rejection = None
                else:
                    reply, rejection = await self._answer(ctx, backend, msg, role)
            except asyncio.CancelledError:
                reply = api.ErrorReply(run_id=ctx.run_id, code="unavailable",
                                       message="the sandbox instance shut down before the request finished")
                await self._respond(ctx, msg, reply)
                raise
            await self._respond(ctx, msg, reply)
            if rejection is not None:  # answered first, then dead-lettered
                span.set_attribute("sandbox.rejected", rejection.error_type)
                # a core-NATS request's reply subject is an inbox, not a JetStream ack subject: hide it from the sink
                letter = Msg(_client=ctx.nc, subject=msg.subject, reply="", data=msg.data, headers=msg.headers)
                await ctx.dead_letters.send(letter, rejection.reason, rejection.error_type)
            if isinstance(reply, api.ErrorReply):
                self._errors += 1
                span.set_attribute("sandbox.error", reply.code)
        self._requests += 1
        ctx.gauges["sandbox/requests"] = float(self._requests)
        ctx.gauges["sandbox/request_errors"] = float(self._errors)

    async def _answer(self, ctx: ServiceContext, backend: SandboxBackend, msg: Msg,
                      role: str) -> tuple[Any, _Rejection | None]:
        """The reply, and the rejection when the request can never be served (decode, run, subject)."""
        rejection = None
        try:
            req = codec.decode(msg.data, AnyRequest, max_bytes=self.max_message_bytes)
        except codec.DecodeError as e:
            named = codec.DecodeError(f"sandbox request on {msg.subject}", e.reason, e.field)
            rejection = _Rejection(str(named), "DecodeError")
        else:
            if req.run_id != ctx.run_id:
                rejection = _Rejection(f"request of run {req.run_id!r} sent to run {ctx.run_id!r}", "WrongRun")
            elif not isinstance(req, _ROLES[role][0]):
                rejection = _Rejection(f"{type(req).__name__} sent to {msg.subject}: it belongs on "
                                       f"{_belongs_on(req)}", "WrongSubject")
        if rejection is not None:
            return api.ErrorReply(run_id=ctx.run_id, code="invalid", message=rejection.reason), rejection
        t0 = time.perf_counter()
        try:
            reply = await dispatch(backend, req)
            _LATENCY(time.perf_counter() - t0, verb=_verb(req))
            return reply, None
        except SandboxError as e:
            return e.reply(ctx.run_id), None
        except Exception as e:  # a bug or host failure: answer it, keep serving
            log.exception("sandbox %s failed", type(req).__name__)
            return api.ErrorReply(run_id=ctx.run_id, code="internal", message=f"{type(e).__name__}: {e}",
                                  sandbox_id=getattr(req, "sandbox_id", None)), None

    async def _respond(self, ctx: ServiceContext, msg: Msg, reply: Any) -> None:
        if not msg.reply:
            return  # published without a reply subject: nobody is waiting
        data = codec.encode(reply)
        if len(data) > ctx.nc.max_payload:
            reply = api.ErrorReply(
                run_id=ctx.run_id, code="limit", sandbox_id=getattr(reply, "sandbox_id", None),
                message=f"the {type(reply).__name__} of {len(data)} bytes exceeds the NATS server's max_payload "
                f"({ctx.nc.max_payload} bytes): ask for less (max_output_bytes, max_bytes) or raise max_payload",
            )
            data = codec.encode(reply)
        headers: dict[str, str] = {}
        tracing.inject(headers)
        try:
            await ctx.nc.publish(msg.reply, data, headers=headers or None)
        except Exception as e:  # disconnected: the requester times out
            log.warning("could not send the reply to %s: %s", msg.subject, e)


def _verb(req: Any) -> str:
    """``ExecRequest`` -> ``exec``: the label of the latency histogram."""
    return type(req).__name__.removesuffix("Request").lower()


def build(loaded: Loaded) -> SandboxService:
    """The service for a resolved config (``loaded.service`` is the SandboxConfig); the backend loads in ``run``."""
    return SandboxService.from_loaded(loaded)
