"""The trace context travels in NATS headers: a consumer's span continues the publisher's trace."""

from __future__ import annotations

import asyncio

import nats
from opentelemetry import trace

from proto import catalog
from proto.echo import EchoRequest
from services.runtime import bus, tracing
from services.runtime.consume import Consumer, DeadLetterSink


async def test_trace_follows_message_across_publish_and_consume(nats_url):
    tracing.setup("test")
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    await bus.provision_all(js)
    cdef = catalog.ECHO_IN.for_run("tr")
    await bus.ensure_consumer(js, cdef)
    with tracing.span("producer-work") as parent:
        await bus.publish(js, "rlbus.tr.echo.in", EchoRequest(run_id="tr", text="hi"))
        parent_trace = parent.get_span_context().trace_id
    seen: list[int] = []
    stop = asyncio.Event()

    async def handler(msg, d):
        assert "traceparent" in d.headers
        seen.append(trace.get_current_span().get_span_context().trace_id)
        stop.set()

    c = Consumer(js, cdef, EchoRequest, handler, run_id="tr", dead_letters=DeadLetterSink(js, "tr", "test"))
    await asyncio.wait_for(c.run(stop, drain_timeout=2.0), 20)
    assert seen == [parent_trace] and parent_trace != 0
    await nc.close()
