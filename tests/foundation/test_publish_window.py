"""Publishes in a bounded window (``bus.in_window``): bounded, every one tried, failures reported, retried
publishes stored once — against a real nats-server."""

from __future__ import annotations

import asyncio
import logging

import nats
import pytest
from nats.js import api

from proto import codec
from proto.echo import EchoRequest
from services.runtime import bus
from tests.conftest import wait_for_async


async def test_the_window_bounds_what_is_in_flight_and_keeps_results_in_order():
    running, most = 0, 0
    release = asyncio.Event()

    async def job(i: int) -> int:
        nonlocal running, most
        running += 1
        most = max(most, running)
        await release.wait()
        running -= 1
        return i

    window = asyncio.create_task(bus.in_window((job(i) for i in range(10)), 3))
    await wait_for_async(lambda: running == 3, 5, "three jobs in flight")
    release.set()
    assert await window == list(range(10))
    assert most == 3


async def test_a_failure_is_returned_in_its_place_after_the_others_ran():
    async def job(i: int) -> int:
        if i == 1:
            raise ValueError("the second one fails")
        return i

    out = await bus.in_window((job(i) for i in range(4)), 2)
    assert out[0] == 0 and out[2:] == [2, 3]
    assert isinstance(out[1], ValueError)
    with pytest.raises(ValueError, match="window must be >= 1"):
        await bus.in_window([], 0)


async def _stored(js, stream: str) -> list[bytes]:
    info = await js.stream_info(stream)
    return [(await js.get_msg(stream, seq)).data for seq in range(info.state.first_seq, info.state.last_seq + 1)]


async def test_publishes_in_a_window_are_all_stored_once(nats_url):
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    await js.add_stream(name="WIN", subjects=["win.>"])
    msgs = [EchoRequest(run_id="w", text=f"m{i}", msg_id=f"w-{i}") for i in range(40)]
    acks = await bus.in_window((bus.publish(js, "win.a", m) for m in msgs), 8)
    assert all(isinstance(a, api.PubAck) and not a.duplicate for a in acks)
    # published again (a retried window after a lost ack): JetStream keeps the first copies only
    again = await bus.in_window((bus.publish(js, "win.a", m) for m in msgs), 8)
    assert all(a.duplicate for a in again)
    stored = await _stored(js, "WIN")
    assert len(stored) == 40
    assert sorted(stored) == sorted(codec.encode(m) for m in msgs)
    await nc.close()


async def test_a_publish_that_fails_in_the_window_is_reported_and_the_others_stored(nats_url):
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    await js.add_stream(name="WIN", subjects=["win.>"])
    subjects = ["win.a", "win.a", "nowhere.b", "win.a"]  # no stream takes nowhere.b: no PubAck ever comes
    msgs = [EchoRequest(run_id="w", text=f"m{i}", msg_id=f"f-{i}") for i in range(4)]
    out = await bus.in_window((bus.publish(js, s, m, timeout=1.0, retry_for_s=0.5)
                               for s, m in zip(subjects, msgs, strict=True)), 4)
    assert isinstance(out[2], bus.BusError) and "nowhere.b" in str(out[2])
    assert [isinstance(a, api.PubAck) for a in out] == [True, True, False, True]
    assert len(await _stored(js, "WIN")) == 3
    await nc.close()


async def test_a_publish_retried_in_the_window_is_stored_once_with_the_others(nats_url, caplog):
    """A publish whose ack does not come (its stream is not there yet) is retried while the others are
    stored; once the stream exists it is stored, once, and nothing of the window is lost."""
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    await js.add_stream(name="WIN", subjects=["win.>"])
    msgs = [EchoRequest(run_id="w", text=f"m{i}", msg_id=f"r-{i}") for i in range(6)]
    subjects = ["win.a", "win.a", "late.x", "win.a", "win.a", "win.a"]
    caplog.set_level(logging.WARNING, logger="rlbus.bus")
    window = asyncio.create_task(bus.in_window((bus.publish(js, s, m, timeout=1.0)
                                                for s, m in zip(subjects, msgs, strict=True)), 3))
    await wait_for_async(lambda: any("late.x" in r.getMessage() and "retrying" in r.getMessage()
                                     for r in caplog.records), 20, "the failed publish to be retried")
    await js.add_stream(name="LATE", subjects=["late.>"])
    acks = await asyncio.wait_for(window, 30)
    assert all(isinstance(a, api.PubAck) for a in acks), acks
    assert len(await _stored(js, "WIN")) == 5
    assert await _stored(js, "LATE") == [codec.encode(msgs[2])]
    await nc.close()
