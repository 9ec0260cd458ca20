"""Hostile payloads through the real consume loop on a real nats-server.

A batch of fuzzed payloads (garbage, msgpack of any shape, broken, oversized, from another run, and
valid ones) is published to stream ECHO; the shared consume loop (``services.runtime.consume``) must
hand every valid message of its run to the handler and dead-letter every other one with its reason,
keep serving afterwards, and lose nothing: published = handled + dead-lettered, message by message.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import nats
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proto import catalog, codec
from proto.deadletter import DeadLetter
from proto.echo import EchoRequest
from services.runtime import bus
from services.runtime.consume import Consumer, DeadLetterSink, Delivery, Poison
from tests.fuzz.strategies import ANY_VALUE, broken_message, encode_any, valid_message

pytestmark = pytest.mark.timeout(300)

RUN = "fzrun"
SUBJECT = f"rlbus.{RUN}.echo.in"
LIMIT = 16 * 1024  # the consumer's max_message_bytes in these tests
REPO = Path(__file__).resolve().parents[2]
DEEP = b"\x82\xa4type\xacecho_request\xa2zz" + b"\x91" * 1000 + b"\xc0"  # 1 kB, 1000 levels

VALID = valid_message(EchoRequest).map(lambda d: {**d, "run_id": RUN})
OTHER_RUNS = st.from_regex(r"[A-Za-z0-9_-]{1,16}", fullmatch=True).filter(lambda r: r != RUN)
PAYLOADS = st.one_of(
    st.binary(max_size=300),
    ANY_VALUE.map(encode_any),
    broken_message(EchoRequest).map(encode_any),
    VALID.map(encode_any),
    st.tuples(VALID, OTHER_RUNS).map(lambda t: encode_any({**t[0], "run_id": t[1]})),
    st.integers(LIMIT + 1, 4 * LIMIT).map(lambda n: encode_any({"type": "echo_request", "run_id": RUN, "text": "x" * n})),
)
#: one of each kind in every batch, whatever hypothesis draws besides
ALWAYS = [
    encode_any({"type": "echo_request", "run_id": RUN, "text": "valid"}),
    encode_any({"type": "echo_request", "run_id": "another-run", "text": "wrong run"}),
    encode_any({"type": "echo_request", "run_id": RUN, "text": "x" * (LIMIT + 1)}),
    b"\xc1 not msgpack",
    encode_any({"type": "echo_request", "run_id": RUN, "text": 42}),
]


def expected_outcome(data: bytes) -> str:
    """What the consume loop must do with ``data``: handle it, or dead-letter it with this error type."""
    if len(data) > LIMIT:
        return "Oversized"
    try:
        msg = codec.decode(data, EchoRequest, max_bytes=None)
    except codec.DecodeError:
        return "DecodeError"
    return "WrongRun" if msg.run_id != RUN else "handled"


class RecordingSink(DeadLetterSink):
    """The runtime's dead-letter sink, also telling the test when a letter went out."""

    def __init__(self, js: Any, changed: asyncio.Condition) -> None:
        super().__init__(js, RUN, "fuzz")
        self.changed = changed

    async def send(self, raw: Any, reason: str, error_type: str, deliveries: int = 0) -> None:
        await super().send(raw, reason, error_type, deliveries)
        async with self.changed:
            self.changed.notify_all()


async def reset(js: Any) -> None:
    """Fresh consumer and empty subjects for this run (each example starts clean)."""
    try:
        await js.delete_consumer("ECHO", catalog.ECHO_IN.for_run(RUN).durable)
    except nats.js.errors.NotFoundError:
        pass
    await js.purge_stream("ECHO", subject=f"rlbus.{RUN}.echo.>")
    await js.purge_stream("DLQ", subject=f"rlbus.{RUN}.dlq.>")


async def read_letters(js: Any, n: int) -> list[DeadLetter]:
    sub = await js.subscribe(f"rlbus.{RUN}.dlq.>", ordered_consumer=True)
    try:
        letters = [codec.decode((await sub.next_msg(timeout=15)).data, DeadLetter) for _ in range(n)]
        with pytest.raises(nats.errors.TimeoutError):
            await sub.next_msg(timeout=0.3)  # and no more than that
        return letters
    finally:
        await sub.unsubscribe()


async def run_batch(url: str, batch: list[bytes], figures: Any) -> None:
    nc = await nats.connect(url, allow_reconnect=False)
    js = nc.jetstream(timeout=10.0)
    try:
        await bus.provision_all(js)
        await reset(js)
        cdef = catalog.ECHO_IN.for_run(RUN)
        await bus.ensure_consumer(js, cdef)
        changed = asyncio.Condition()
        sink = RecordingSink(js, changed)
        handled: list[int] = []

        async def handle(msg: EchoRequest, d: Delivery[EchoRequest]) -> None:
            handled.append(d.stream_seq)
            async with changed:
                changed.notify_all()

        consumer = Consumer(js, cdef, EchoRequest, handle, run_id=RUN, dead_letters=sink, concurrency=8,
                            max_message_bytes=LIMIT, name="fuzz")
        stop = asyncio.Event()
        task = asyncio.create_task(consumer.run(stop, drain_timeout=5.0), name="fuzz-consumer")

        by_seq = {(await js.publish(SUBJECT, data)).seq: data for data in batch}
        async with changed:
            await asyncio.wait_for(changed.wait_for(lambda: len(handled) + sink.count >= len(batch)), 60)
        assert not task.done(), "the consume loop stopped on hostile input"

        # it keeps serving valid work afterwards
        after = (await js.publish(SUBJECT, encode_any({"type": "echo_request", "run_id": RUN, "text": "after"}))).seq
        async with changed:
            await asyncio.wait_for(changed.wait_for(lambda: after in handled), 30)
        stop.set()
        await asyncio.wait_for(task, 30)

        expected = {seq: expected_outcome(data) for seq, data in by_seq.items()}
        letters = await read_letters(js, sink.count)
        lettered = {letter.stream_seq: letter for letter in letters}
        # nothing lost, nothing twice: every published message was handled or dead-lettered, once
        assert sorted(handled) == sorted([*(s for s, o in expected.items() if o == "handled"), after])
        assert len(lettered) == len(letters) and set(lettered).isdisjoint(handled)
        assert set(lettered) | set(handled) == set(by_seq) | {after}
        for seq, letter in lettered.items():
            assert letter.error_type == expected[seq], (letter.error_type, letter.reason, by_seq[seq][:80])
            assert letter.reason and letter.service == "fuzz" and letter.original_subject == SUBJECT
            assert letter.stream == "ECHO" and letter.payload == by_seq[seq]  # the payload, untouched
        info = await js.consumer_info("ECHO", cdef.durable)
        assert info.num_ack_pending == 0 and info.num_pending == 0

        figures.add("bus/published", len(batch))
        figures.add("bus/handled", len(handled) - 1)
        figures.add("bus/dead_lettered", len(letters))
        for letter in letters:
            figures.add(f"bus/dead_lettered/{letter.error_type}")
    finally:
        await nc.close()


@settings(max_examples=6, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(drawn=st.lists(PAYLOADS, min_size=5, max_size=20))
def test_fuzzed_batches_are_handled_or_dead_lettered(nats_url, fuzz_figures, drawn):
    asyncio.run(run_batch(nats_url, ALWAYS + drawn, fuzz_figures))


async def deep_nesting_scenario(url: str) -> str:
    """Publish one deeply nested message to a fresh consumer; "dead-lettered" or "lost" (no letter in 5 s)."""
    nc = await nats.connect(url, allow_reconnect=False)
    js = nc.jetstream(timeout=10.0)
    try:
        await bus.provision_all(js)
        await reset(js)
        cdef = catalog.ECHO_IN.for_run(RUN)
        await bus.ensure_consumer(js, cdef)
        changed = asyncio.Condition()
        sink = RecordingSink(js, changed)

        async def handle(msg: EchoRequest, d: Delivery[EchoRequest]) -> None:
            raise Poison("a deeply nested message reached the handler")

        consumer = Consumer(js, cdef, EchoRequest, handle, run_id=RUN, dead_letters=sink, max_message_bytes=LIMIT)
        stop = asyncio.Event()
        task = asyncio.create_task(consumer.run(stop, drain_timeout=1.0), name="fuzz-consumer")
        await js.publish(SUBJECT, DEEP)
        try:
            async with changed:
                await asyncio.wait_for(changed.wait_for(lambda: sink.count >= 1), 5)
        except TimeoutError:
            return "lost"
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)
        [letter] = await read_letters(js, 1)
        return f"dead-lettered as {letter.error_type}"
    finally:
        await nc.close()


def test_deeply_nested_message_is_dead_lettered(nats_url):
    # in a child interpreter: a RecursionError inside C code can leave CPython 3.11's AST recursion counter
    # off, which breaks pytest's traceback rendering for the rest of the session
    res = subprocess.run([sys.executable, "-c", "import asyncio, sys; from tests.fuzz.test_fuzz_consume import "
                          "deep_nesting_scenario as s; print(asyncio.run(s(sys.argv[1])))", nats_url],
                         cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "dead-lettered as DecodeError", res.stdout


def test_payloads_of_each_kind_are_classified():
    """The oracle itself: each fixed payload has the outcome it was written for."""
    assert [expected_outcome(p) for p in ALWAYS] == ["handled", "WrongRun", "Oversized", "DecodeError", "DecodeError"]
    assert msgspec.msgpack.decode(ALWAYS[0])["text"] == "valid"
