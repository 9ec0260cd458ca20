"""The one consume loop and its ack policy.

Every service consumes through this loop, so that what becomes of a message
(ack, redelivery, dead letter) follows the same rules everywhere.

A handler is ``async def handle(msg: T, d: Delivery) -> None``. What happens to
the message is decided here, in one place:

* handler returns → **ack**;
* handler called :meth:`Delivery.defer` and returns → **no ack yet**: the
  handler's concurrency slot is freed at once, the message is kept alive with
  ``in_progress()`` and is settled later through the returned
  :class:`DeferredAck` (``ack()``, ``nak()`` or ``term(reason)``); the
  consumer's ``max_ack_pending`` bounds how many such messages are held;
* handler raises :class:`Retry` → **nak** with the given delay (redelivered);
* handler raises :class:`Poison`, the payload cannot be decoded, it is too big,
  or it belongs to another run → **term** + a dead letter with the reason;
* handler raises anything else → nak with backoff, and once the delivery count
  reaches the consumer's ``max_deliver`` → term + dead letter.

A handler that defers and then raises gets the exception policy above; its
deferred handle is settled by it, so a later ``ack()`` on the handle is a no-op.

Long handlers, and deferred messages until they are settled, are kept alive
with ``in_progress()`` every ``ack_wait / 3``. On stop, fetching stops at once
and in-flight handlers get ``drain_timeout`` seconds; the ones still running
are cancelled and their messages naked so another instance picks them up.
Deferred messages still unsettled once draining is over are naked too (no
delay, so another instance gets them at once) and their keepalives stop; a
later ``ack()`` on their handles is a no-op.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg

from proto import catalog, codec, subjects
from proto.deadletter import DeadLetter
from services.runtime import metrics, tracing
from services.runtime.tasks import cancel_and_wait

T = TypeVar("T")
log = logging.getLogger("rlbus.consume")

#: counters on the service's metrics endpoint (services/runtime/metrics.py)
_HANDLED = metrics.counter("messages_handled", "messages a consumer handled and acked (or deferred)")
_FAILED = metrics.counter("messages_failed", "handler failures (retried or dead-lettered)")
_DEAD_LETTERS = metrics.counter("dead_letters", "messages dead-lettered, by family and error type")


class Retry(Exception):
    """A transient failure: redeliver after ``delay_s``."""

    def __init__(self, reason: str, delay_s: float = 1.0) -> None:
        super().__init__(reason)
        self.delay_s = delay_s


class Poison(Exception):
    """The message can never be processed: terminate it and dead-letter it with the reason."""


class DeferredAck:
    """A message whose handler returned without settling it: ack, nak or term it later.

    Returned by :meth:`Delivery.defer`. It exists because some work is not done when the
    handler returns: the trainer acks a trajectory only once the training step that used it
    is durable (its weight version stored or delivered, and the trainer's state saved), so that a crash in between redelivers it rather
    than losing it. Until the handle is settled the consume loop keeps the message alive with
    ``in_progress()`` (it is never redelivered while held), without holding a concurrency
    slot; the consumer's ``max_ack_pending`` bounds how many messages can be held at once.

    Settling is idempotent: only the first of ``ack``/``nak``/``term`` does anything, later
    calls are no-ops. A failed ack (lost connection) is logged, not raised: the message will
    be redelivered, and handlers are idempotent. If the handler raised after deferring, or
    the consumer stopped (its unsettled messages are naked), the handle is already settled.
    """

    def __init__(self, raw: Msg, owner: Consumer[Any]) -> None:
        self.raw = raw
        self.subject = raw.subject
        self.stream_seq = raw.metadata.sequence.stream
        self._owner = owner
        self._done = False
        self._keepalive: asyncio.Task[None] | None = None

    @property
    def done(self) -> bool:
        """Whether the message has been settled (acked, naked or terminated) already."""
        return self._done

    def _settle(self) -> bool:
        """Mark settled and stop holding the message; False if it already was."""
        if self._done:
            return False
        self._done = True
        if self._keepalive is not None:
            self._keepalive.cancel()
            self._keepalive = None
        self._owner._deferred.discard(self)
        return True

    def _hold(self, keepalive: asyncio.Task[None]) -> None:
        """Taken over from the consume loop after the handler returned: keep it alive until settled."""
        keepalive.set_name(f"{self._owner.name}-deferred-keepalive-{self.stream_seq}")
        self._keepalive = keepalive
        self._owner._deferred.add(self)

    async def ack(self) -> None:
        """Acknowledge: the message is done with and will not be redelivered."""
        if not self._settle():
            return
        try:
            await self.raw.ack()
        except Exception as e:  # lost connection: it will be redelivered; handlers are idempotent
            log.warning("%s: deferred ack of %s failed (%s); the message will be redelivered",
                        self._owner.name, self.subject, e)

    async def nak(self, delay_s: float = 0.0) -> None:
        """Hand the message back for redelivery after ``delay_s`` seconds (to any instance)."""
        if self._settle():
            await self._owner._nak(self.raw, delay_s)

    async def term(self, reason: str) -> None:
        """Terminate the message (never redelivered) and dead-letter it with ``reason``."""
        if self._settle():
            await self._owner._poison(self.raw, reason, "Poison", self.raw.metadata.num_delivered)


class Delivery(Generic[T]):
    """What a handler knows about the delivery besides the decoded message."""

    def __init__(self, raw: Msg, consumer: Consumer[Any] | None = None) -> None:
        self.raw = raw
        md = raw.metadata
        self.subject = raw.subject
        self.num_delivered = md.num_delivered
        self.stream_seq = md.sequence.stream
        self.headers = dict(raw.headers or {})
        self._consumer = consumer
        self._deferred: DeferredAck | None = None
        self._open = consumer is not None  # defer() only while the handler runs

    async def in_progress(self) -> None:
        await self.raw.in_progress()

    def defer(self) -> DeferredAck:
        """Do not ack when the handler returns; settle the message later through the returned handle.

        Call from inside the handler. The handler's concurrency slot is freed as soon as it
        returns, and the message is kept alive until the handle is settled. Calling it again
        returns the same handle.
        """
        if self._deferred is None:
            if not self._open or self._consumer is None:
                raise RuntimeError("Delivery.defer() must be called from inside the handler, while it runs")
            self._deferred = DeferredAck(self.raw, self._consumer)
        return self._deferred


Handler = Callable[[Any, Delivery[Any]], Awaitable[None]]


class DeadLetterSink:
    """Publishes dead letters for a service (never raises: a failure is logged)."""

    def __init__(self, js: Any, run_id: str, service: str) -> None:
        self.js = js
        self.run_id = run_id
        self.service = service
        self.count = 0

    async def send(self, raw: Msg, reason: str, error_type: str, deliveries: int = 0) -> None:
        from services.runtime.bus import publish  # local: bus imports this module's siblings

        run = subjects.run_of(raw.subject) or self.run_id
        family = subjects.family_of(raw.subject) or "unknown"
        try:
            run = subjects.check_run_id(run)
        except subjects.InvalidRunId:
            run = self.run_id
        md = raw.metadata if raw.reply and raw.reply.startswith("$JS.") else None
        letter = DeadLetter(
            run_id=run,
            service=self.service,
            original_subject=raw.subject,
            reason=reason,
            error_type=error_type,
            stream=md.stream if md else "",
            stream_seq=md.sequence.stream if md else 0,
            deliveries=deliveries,
            headers={k: str(v) for k, v in (raw.headers or {}).items()},
            payload=bytes(raw.data[: codec.MAX_MESSAGE_BYTES]),
        )
        self.count += 1
        _DEAD_LETTERS(family=subjects.family_of(raw.subject) or "unknown", reason=error_type)
        log.warning("dead letter from %s: %s (%s)", raw.subject, reason, error_type)
        try:
            await publish(self.js, catalog.DEAD_LETTERS.subject(run, family), letter)
        except Exception:  # the dead-letter path must not take the service down
            log.exception("could not publish a dead letter for %s", raw.subject)


class Consumer(Generic[T]):
    """Runs ``handler`` over a durable pull consumer with bounded concurrency."""

    def __init__(
        self,
        js: Any,
        consumer: catalog.ConsumerDef,
        msg_type: type[T],
        handler: Handler,
        *,
        run_id: str,
        dead_letters: DeadLetterSink,
        concurrency: int = 16,
        max_message_bytes: int = codec.MAX_MESSAGE_BYTES,
        name: str = "",
    ) -> None:
        self.js = js
        self.cdef = consumer
        self.msg_type = msg_type
        self.handler = handler
        self.run_id = run_id
        self.dlq = dead_letters
        self.concurrency = concurrency
        self.max_message_bytes = max_message_bytes
        self.name = name or consumer.durable
        self.in_flight: set[asyncio.Task[None]] = set()
        self.handled = 0
        self.failed = 0
        self._deferred: set[DeferredAck] = set()

    @property
    def deferred_pending(self) -> int:
        """How many deferred messages are held now (handler returned, handle not settled yet)."""
        return len(self._deferred)

    async def run(self, stop: asyncio.Event, drain_timeout: float) -> None:
        """Fetch and handle until ``stop`` is set, then drain in-flight work within ``drain_timeout``."""
        psub = await self.js.pull_subscribe_bind(durable=self.cdef.durable, stream=self.cdef.stream)
        self._free = self.concurrency
        self._slot_freed = asyncio.Condition()
        stop_wait = asyncio.create_task(self._wake_on_stop(stop), name=f"{self.name}-stopwait")
        failures = 0  # fetches failed in a row (a reconnect, a leader election)
        try:
            while not stop.is_set():
                async with self._slot_freed:  # flow control: fetch only what we can start now
                    await self._slot_freed.wait_for(lambda: self._free > 0 or stop.is_set())
                    if stop.is_set():
                        break
                    want = self._free
                    self._free = 0
                fetch = asyncio.create_task(psub.fetch(batch=want, timeout=5.0), name=f"{self.name}-fetch")
                done, _ = await asyncio.wait({fetch, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
                msgs: list[Msg] = []
                failed = False
                if fetch in done:
                    try:
                        msgs = fetch.result()
                    except (TimeoutError, nats.errors.TimeoutError):
                        msgs = []
                    except (nats.errors.ConnectionReconnectingError, nats.errors.ConnectionClosedError,
                            nats.errors.NoRespondersError, nats.js.errors.ServiceUnavailableError) as e:
                        # ServiceUnavailable: the consumer's leader node went away and a new one is being
                        # elected (a replicated stream); transient like a reconnect
                        failures += 1
                        if failures == 1 or failures % 30 == 0:
                            log.warning("%s: fetch interrupted (%s; %d in a row)", self.name, e, failures)
                        failed = True
                    else:
                        failures = 0
                else:
                    fetch.cancel()
                async with self._slot_freed:
                    self._free += want - len(msgs)
                for m in msgs:
                    t = asyncio.create_task(self._handle(m), name=f"{self.name}-handle")
                    self.in_flight.add(t)
                    t.add_done_callback(self.in_flight.discard)
                if fetch not in done:
                    break
                if failed:
                    await asyncio.wait({stop_wait}, timeout=1.0)  # reconnecting: back off instead of spinning
        finally:
            stop_wait.cancel()
            # withdraw interest first: the server drops our outstanding pull request, so what is
            # naked below goes to another instance at once rather than back to this one
            try:
                await psub.unsubscribe()
            except Exception as e:  # connection may already be closed
                log.debug("%s: unsubscribe failed: %s", self.name, e)
            await self._drain(drain_timeout)
            await self._release_deferred()

    async def _wake_on_stop(self, stop: asyncio.Event) -> None:
        await stop.wait()
        async with self._slot_freed:
            self._slot_freed.notify_all()

    async def _drain(self, timeout: float) -> None:
        if not self.in_flight:
            return
        log.info("%s: draining %d in-flight messages (up to %.1fs)", self.name, len(self.in_flight), timeout)
        _, pending = await asyncio.wait(set(self.in_flight), timeout=timeout)
        if pending:
            log.warning("%s: %d handlers did not finish within %.1fs; their messages are redelivered",
                        self.name, len(pending), timeout)
            await cancel_and_wait(*pending)  # a handler's JetStream request can swallow one cancel (3.11)

    async def _release_deferred(self) -> None:
        """Nak the deferred messages still held (no delay: another instance gets them at once)."""
        if not self._deferred:
            return
        held = list(self._deferred)
        log.info("%s: stopping with %d unsettled deferred messages; naking them for redelivery",
                 self.name, len(held))
        await asyncio.gather(*(h.nak(0.0) for h in held))

    async def _keepalive(self, raw: Msg) -> None:
        period = max(self.cdef.ack_wait_s / 3.0, 0.5)
        while True:
            await asyncio.sleep(period)  # periodic in_progress, the protocol's own heartbeat
            try:
                await raw.in_progress()
            except Exception as e:
                log.debug("in_progress failed: %s", e)

    async def _handle(self, raw: Msg) -> None:
        try:
            await self._handle_one(raw)
        finally:
            async with self._slot_freed:
                self._free += 1
                self._slot_freed.notify()

    async def _handle_one(self, raw: Msg) -> None:
        deliveries = raw.metadata.num_delivered
        if len(raw.data) > self.max_message_bytes:
            await self._poison(raw, f"message of {len(raw.data)} bytes exceeds {self.max_message_bytes}", "Oversized", deliveries)
            return
        try:
            msg = codec.decode(raw.data, self.msg_type, max_bytes=None)
        except codec.DecodeError as e:
            await self._poison(raw, str(e), "DecodeError", deliveries)
            return
        msg_run = getattr(msg, "run_id", self.run_id)
        if msg_run != self.run_id:
            await self._poison(raw, f"message of run {msg_run!r} delivered to run {self.run_id!r}", "WrongRun", deliveries)
            return
        keepalive = asyncio.create_task(self._keepalive(raw), name=f"{self.name}-keepalive")
        d: Delivery[Any] = Delivery(raw, self)
        held = False
        try:
            with tracing.span(f"handle {raw.subject}", kind="consumer", headers=raw.headers):
                await self.handler(msg, d)
        except asyncio.CancelledError:
            if self._settled_by_loop(d):
                await self._nak(raw, 0)
            raise
        except Poison as e:
            if self._settled_by_loop(d):
                await self._poison(raw, str(e), "Poison", deliveries)
            return
        except Retry as e:
            if not self._settled_by_loop(d):
                return
            self.failed += 1
            _FAILED(consumer=self.cdef.durable, kind="retry")
            if deliveries >= self.cdef.max_deliver:
                await self._poison(raw, f"still failing after {deliveries} deliveries: {e}", "Retry", deliveries)
            else:
                log.info("%s: retry in %.1fs: %s", self.name, e.delay_s, e)
                await self._nak(raw, e.delay_s)
            return
        except Exception as e:
            if not self._settled_by_loop(d):
                return
            self.failed += 1
            _FAILED(consumer=self.cdef.durable, kind="error")
            if deliveries >= self.cdef.max_deliver:
                await self._poison(raw, f"failed {deliveries} times, last: {type(e).__name__}: {e}",
                                   type(e).__name__, deliveries)
            else:
                log.exception("%s: handler failed (delivery %d of %d); will retry", self.name, deliveries,
                              self.cdef.max_deliver)
                backoff = self.cdef.backoff_s
                await self._nak(raw, backoff[min(deliveries - 1, len(backoff) - 1)] if backoff else 1.0)
            return
        else:
            d._open = False
            self.handled += 1
            _HANDLED(consumer=self.cdef.durable)
            deferred = d._deferred
            if deferred is not None:
                if not deferred.done:  # held until settled; its keepalive goes on with it
                    deferred._hold(keepalive)
                    held = True
                return
        finally:
            d._open = False
            if not held:
                keepalive.cancel()
        try:
            await raw.ack()
        except Exception as e:  # lost connection: it will be redelivered; handlers are idempotent
            log.warning("%s: ack failed (%s); the message will be redelivered", self.name, e)

    def _settled_by_loop(self, d: Delivery[Any]) -> bool:
        """The handler raised: its deferred handle (if any) is settled by the exception policy.

        False if the handle had already been settled while the handler ran: the message's fate
        was decided then, and the policy is not applied on top of it.
        """
        d._open = False
        deferred = d._deferred
        if deferred is None or deferred._settle():
            return True
        log.warning("%s: handler raised after settling its deferred message %s; left as settled",
                    self.name, d.subject)
        return False

    async def _nak(self, raw: Msg, delay: float) -> None:
        try:
            await raw.nak(delay=delay or None)
        except Exception as e:
            log.debug("nak failed: %s", e)

    async def _poison(self, raw: Msg, reason: str, error_type: str, deliveries: int) -> None:
        await self.dlq.send(raw, reason, error_type, deliveries)
        try:
            await raw.term()
        except Exception as e:
            log.debug("term failed: %s", e)
