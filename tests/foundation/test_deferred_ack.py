"""Deferred acknowledgement in the consume loop, against a real nats-server.

A handler may call ``Delivery.defer()`` and return: the message is then held (kept alive with
``in_progress``, never redelivered, no concurrency slot used) until its ``DeferredAck`` is settled
with ``ack``, ``nak`` or ``term``; a stopping consumer naks what it still holds. What the consume loop
sends back to the server is observed on the wire: a second connection subscribes to the ack subjects
(``$JS.ACK.ECHO.>``) of the messages it handles.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import nats
import pytest

from proto import catalog, codec
from proto.deadletter import DeadLetter
from proto.echo import EchoRequest
from services.runtime import bus
from services.runtime.consume import Consumer, DeadLetterSink, DeferredAck, Delivery
from tests.conftest import wait_for_async

pytestmark = pytest.mark.timeout(60)

RUN = "dfr"
SUBJECT = f"rlbus.{RUN}.echo.in"
WPI = b"+WPI"
ACK = b""  # what nats-py sends for ack()


class Log:
    """A list that tests can wait on: items appended by handlers or subscriptions."""

    def __init__(self) -> None:
        self.items: list[Any] = []
        self.changed = asyncio.Condition()

    async def add(self, item: Any) -> None:
        async with self.changed:
            self.items.append(item)
            self.changed.notify_all()

    async def until(self, pred: Callable[[list[Any]], bool], timeout: float = 5.0) -> None:
        async with self.changed:
            await asyncio.wait_for(self.changed.wait_for(lambda: pred(self.items)), timeout)


async def until(probe: Callable[[], Awaitable[Any]], ok: Callable[[Any], bool], timeout: float = 5.0) -> Any:
    """Wait until ``ok`` holds for ``probe()``'s value (the shared ``wait_for_async``); returns that value."""
    seen: list[Any] = []

    async def holds() -> bool:
        seen.append(await probe())
        return ok(seen[-1])

    await wait_for_async(holds, timeout, "the condition")
    return seen[-1]


def spy(h: DeferredAck) -> list[str]:
    """Record what a handle still sends for its message from now on (a settled handle sends nothing)."""
    calls: list[str] = []
    for name in ("ack", "nak", "term", "in_progress"):
        orig = getattr(h.raw, name)

        async def wrapped(*a: Any, _orig: Any = orig, _name: str = name, **k: Any) -> Any:
            calls.append(_name)
            return await _orig(*a, **k)

        setattr(h.raw, name, wrapped)
    return calls


def live_keepalives() -> list[asyncio.Task[Any]]:
    return [t for t in asyncio.all_tasks() if "keepalive" in t.get_name() and not t.done()]


class Bench:
    """A connection for the consume loop, one that watches its acks, and the consumer definition."""

    def __init__(self, url: str, ack_wait_s: float = 10.0) -> None:
        self.url = url
        self.cdef = msgspec.structs.replace(catalog.ECHO_IN, ack_wait_s=ack_wait_s).for_run(RUN)

    async def __aenter__(self) -> Bench:
        self.nc = await nats.connect(self.url)
        self.js = self.nc.jetstream()
        await bus.provision_all(self.js)
        await bus.ensure_consumer(self.js, self.cdef)
        self.watch = await nats.connect(self.url)
        self.wire = Log()  # (reply subject, body) of every ack/nak/term/in_progress the loop sends

        async def on_ack(m: Any) -> None:
            await self.wire.add((m.subject, m.data))

        await self.watch.subscribe(f"$JS.ACK.ECHO.{self.cdef.durable}.>", cb=on_ack)
        await self.watch.flush()
        self.runs: list[tuple[asyncio.Event, asyncio.Task[None]]] = []
        return self

    def start(self, handler: Any, concurrency: int = 4) -> Consumer[EchoRequest]:
        c: Consumer[EchoRequest] = Consumer(self.js, self.cdef, EchoRequest, handler, run_id=RUN,
                                            dead_letters=DeadLetterSink(self.js, RUN, "deferred-test"),
                                            concurrency=concurrency, name="deferred-test")
        stop = asyncio.Event()
        self.runs.append((stop, asyncio.create_task(c.run(stop, drain_timeout=2.0), name="deferred-consumer")))
        return c

    async def stop(self) -> None:
        stop, task = self.runs[-1]
        stop.set()
        await asyncio.wait_for(task, 10)

    async def send(self, text: str) -> int:
        return (await self.js.publish(SUBJECT, codec.encode(EchoRequest(run_id=RUN, text=text)))).seq

    async def info(self) -> Any:
        return await self.js.consumer_info("ECHO", self.cdef.durable)

    def sent(self, reply: str) -> list[bytes]:
        """What the loop sent for one delivery (its reply subject), heartbeats left out."""
        return [body for subj, body in self.wire.items if subj == reply and body != WPI]

    async def __aexit__(self, *exc: Any) -> None:
        for stop, task in self.runs:
            stop.set()
            await asyncio.wait_for(task, 10)
        await self.watch.close()
        await self.nc.close()


async def test_deferred_message_is_held_past_ack_wait_then_acked(nats_url):
    ack_wait = 3.0  # a keepalive each second: only a loop stalled for 2 s would let the server redeliver
    async with Bench(nats_url, ack_wait_s=ack_wait) as b:
        got = Log()

        async def handle(msg: EchoRequest, d: Delivery[EchoRequest]) -> None:
            await got.add((d, d.defer()))

        c = b.start(handle)
        seq = await b.send("hold me")
        await got.until(lambda xs: len(xs) == 1)
        t0 = asyncio.get_running_loop().time()
        d, h = got.items[0]
        # kept alive by in_progress every ack_wait/3, for well over two ack_wait periods
        await b.wire.until(lambda xs: sum(1 for s, body in xs if s == d.raw.reply and body == WPI) >= 7, 30)
        assert asyncio.get_running_loop().time() - t0 >= 2 * ack_wait
        info = await b.info()
        assert info.num_ack_pending == 1 and info.num_pending == 0
        assert info.delivered.consumer_seq == 1, "redelivered while held"
        assert len(got.items) == 1 and d.num_delivered == 1
        assert c.deferred_pending == 1 and not h.done and b.sent(d.raw.reply) == []
        assert h.stream_seq == seq

        await h.ack()
        assert h.done and c.deferred_pending == 0
        info = await until(b.info, lambda i: i.num_ack_pending == 0)
        assert info.ack_floor.stream_seq == seq and info.delivered.consumer_seq == 1 and info.num_pending == 0
        await b.wire.until(lambda xs: any(body == ACK for _, body in xs))
        assert b.sent(d.raw.reply) == [ACK]
        sent = spy(h)
        await h.ack()  # settling twice is a no-op
        await h.nak()
        await h.term("late")
        assert sent == [] and h.done and c.dlq.count == 0
        assert live_keepalives() == []
        assert len(got.items) == 1 and c.handled == 1 and c.failed == 0


async def test_deferring_frees_the_concurrency_slot_at_once(nats_url):
    async with Bench(nats_url) as b:
        got = Log()

        async def handle(msg: EchoRequest, d: Delivery[EchoRequest]) -> None:
            await got.add(d.defer())

        c = b.start(handle, concurrency=1)
        seqs = [await b.send(f"m{i}") for i in range(5)]
        await got.until(lambda xs: len(xs) == 5)  # one slot, five messages held at once
        assert c.deferred_pending == 5 and not c.in_flight
        assert sorted(h.stream_seq for h in got.items) == seqs
        info = await b.info()
        assert info.num_ack_pending == 5 and info.num_pending == 0
        await asyncio.gather(*(h.ack() for h in got.items))
        info = await until(b.info, lambda i: i.num_ack_pending == 0)
        assert info.delivered.consumer_seq == 5 and info.ack_floor.stream_seq == seqs[-1]
        assert c.deferred_pending == 0 and c.handled == 5


async def test_nak_redelivers_and_term_dead_letters(nats_url):
    async with Bench(nats_url) as b:
        got = Log()

        async def handle(msg: EchoRequest, d: Delivery[EchoRequest]) -> None:
            if d.num_delivered == 1:
                await got.add((msg.text, d, d.defer()))
            else:
                await got.add((msg.text, d, None))  # acked on return

        c = b.start(handle)
        dlq = await b.js.subscribe(f"rlbus.{RUN}.dlq.>", ordered_consumer=True)
        nak_seq = await b.send("nak me")
        term_seq = await b.send("term me")
        await got.until(lambda xs: len(xs) == 2)
        held = {text: h for text, _, h in got.items}

        await held["nak me"].nak()
        await got.until(lambda xs: len(xs) == 3)
        text, d, h = got.items[2]
        assert (text, d.num_delivered, d.stream_seq, h) == ("nak me", 2, nak_seq, None)

        await held["term me"].term("no use for it")
        letter = codec.decode((await dlq.next_msg(timeout=5)).data, DeadLetter)
        assert letter.reason == "no use for it" and letter.stream_seq == term_seq
        assert codec.decode(letter.payload, EchoRequest).text == "term me"
        assert letter.original_subject == SUBJECT and letter.deliveries == 1
        sent = spy(held["term me"])
        await held["term me"].term("again")  # no-ops: one letter, one term
        await held["term me"].ack()
        assert sent == [] and c.dlq.count == 1

        info = await until(b.info, lambda i: i.num_ack_pending == 0)
        assert info.num_pending == 0 and info.delivered.consumer_seq == 3  # nak me twice, term me once
        await b.wire.until(lambda xs: sum(1 for _, body in xs if body != WPI) == 3)
        (_, nak1, _), (_, term1, _), (_, nak2, _) = got.items
        assert (b.sent(nak1.raw.reply), b.sent(term1.raw.reply), b.sent(nak2.raw.reply)) == \
            ([b"-NAK"], [b"+TERM"], [ACK])
        assert len(got.items) == 3 and c.deferred_pending == 0
        await dlq.unsubscribe()


async def test_stop_naks_unsettled_deferred_messages_for_prompt_redelivery(nats_url):
    ack_wait = 20.0
    async with Bench(nats_url, ack_wait_s=ack_wait) as b:
        first = Log()

        async def park(msg: EchoRequest, d: Delivery[EchoRequest]) -> None:
            await first.add(d.defer())

        c1 = b.start(park)
        seqs = [await b.send(f"m{i}") for i in range(3)]
        await first.until(lambda xs: len(xs) == 3)
        assert c1.deferred_pending == 3 and len(live_keepalives()) == 3
        await b.stop()
        assert c1.deferred_pending == 0 and all(h.done for h in first.items)
        assert live_keepalives() == []

        second = Log()

        async def take(msg: EchoRequest, d: Delivery[EchoRequest]) -> None:
            await second.add((d.stream_seq, d.num_delivered))

        t0 = asyncio.get_running_loop().time()
        b.start(take)
        await second.until(lambda xs: len(xs) == 3, timeout=ack_wait / 4)
        assert asyncio.get_running_loop().time() - t0 < ack_wait / 4
        assert sorted(second.items) == [(s, 2) for s in seqs]
        for h in first.items:
            sent = spy(h)
            await h.ack()  # settled by the stop already: no-op
            assert sent == []
        info = await until(b.info, lambda i: i.num_ack_pending == 0)
        assert info.num_pending == 0 and info.delivered.consumer_seq == 6


async def test_defer_then_raise_follows_the_retry_policy(nats_url):
    async with Bench(nats_url) as b:
        got = Log()

        async def handle(msg: EchoRequest, d: Delivery[EchoRequest]) -> None:
            h: DeferredAck = d.defer()
            await got.add((d, h))
            if d.num_delivered == 1:
                raise RuntimeError("failed after deferring")

        c = b.start(handle)
        await b.send("flaky")
        await got.until(lambda xs: len(xs) == 2)  # naked with the consumer's backoff, redelivered
        (d1, h1), (d2, h2) = got.items
        assert d2.num_delivered == 2 and h1.done and not h2.done
        assert c.failed == 1 and c.deferred_pending == 1
        sent = spy(h1)
        await h1.ack()  # settled by the retry policy: a no-op
        assert sent == []
        await h2.ack()
        info = await until(b.info, lambda i: i.num_ack_pending == 0)
        assert info.num_pending == 0 and info.delivered.consumer_seq == 2
        await b.wire.until(lambda xs: any(body == ACK for _, body in xs))
        nak = b.sent(d1.raw.reply)
        assert len(nak) == 1 and nak[0].startswith(b"-NAK")  # with the backoff delay
        assert b.sent(d2.raw.reply) == [ACK]
        assert c.dlq.count == 0 and c.deferred_pending == 0


async def test_defer_outside_the_handler_is_refused(nats_url):
    async with Bench(nats_url) as b:
        got = Log()

        async def handle(msg: EchoRequest, d: Delivery[EchoRequest]) -> None:
            await got.add(d)

        b.start(handle)
        await b.send("late")
        await got.until(lambda xs: len(xs) == 1)
        info = await until(b.info, lambda i: i.num_ack_pending == 0)  # acked on return as usual
        assert info.num_pending == 0
        with pytest.raises(RuntimeError, match="inside the handler"):
            got.items[0].defer()


async def test_a_stop_ends_a_handler_that_lost_its_cancellation(nats_url, caplog):
    """A handler still running at the drain bound is cancelled; one that loses that cancellation (as a JetStream
    request inside Python 3.11's ``wait_for`` can) is cancelled again, so the stop stays bounded."""
    async with Bench(nats_url) as b:
        started, outcome = Log(), Log()

        async def handle(msg: EchoRequest, d: Delivery[EchoRequest]) -> None:
            await started.add(msg.text)
            try:
                await asyncio.Event().wait()  # stuck until cancelled
            except asyncio.CancelledError:
                await outcome.add("first cancel swallowed")  # what the lost cancellation leaves: it goes on
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                await outcome.add("cancelled again")
                raise

        b.start(handle)
        await b.send("stuck")
        await started.until(lambda xs: xs == ["stuck"])
        with caplog.at_level("WARNING"):
            await b.stop()  # drain bound 2 s; bounded at 10 s here, the handler would wait for good
        assert outcome.items == ["first cancel swallowed", "cancelled again"]
        assert "went on after their cancellation" in caplog.text
