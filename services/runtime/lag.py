"""Queue depth and consumer lag of a durable consumer, as metrics.

While a service consumes (:meth:`ServiceContext.consume`), :func:`follow` asks the server for the
consumer's info every ``every_s`` seconds (one small request, in its own task: the consume loop never
waits for it) and exports, labelled ``consumer=<durable>``:

* ``rlbus_consumer_pending``: messages in the stream not yet delivered to the consumer (``num_pending``,
  the queue depth);
* ``rlbus_consumer_ack_pending``: delivered but not acked yet (``num_ack_pending``: in handlers, or held
  deferred, like the trainer's trajectories until their step is durable);
* ``rlbus_consumer_redelivered``: delivered more than once and not acked yet (``num_redelivered``).

A failed request (a reconnect, a leader election, a slow server) is counted in
``rlbus_consumer_info_failed_total`` and skipped; it never raises.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from proto import catalog
from services.runtime import metrics

log = logging.getLogger("rlbus.lag")

_PENDING = metrics.gauge("consumer_pending", "messages not yet delivered to the consumer (queue depth)")
_ACK_PENDING = metrics.gauge("consumer_ack_pending", "messages delivered to the consumer and not acked yet")
_REDELIVERED = metrics.gauge("consumer_redelivered", "messages delivered more than once and not acked yet")
_FAILED = metrics.counter("consumer_info_failed", "consumer info requests that failed (lag not refreshed)")


async def sample(js: Any, cdef: catalog.ConsumerDef, timeout_s: float = 5.0) -> bool:
    """Refresh the consumer's series once; False (counted) when the server did not answer."""
    try:
        info = await asyncio.wait_for(js.consumer_info(cdef.stream, cdef.durable), timeout_s)
    except Exception as e:  # never raised: lag is a figure, not the work
        _FAILED(consumer=cdef.durable, error=type(e).__name__)
        log.debug("consumer info of %s failed: %s", cdef.durable, e)
        return False
    _PENDING(float(info.num_pending or 0), consumer=cdef.durable)
    _ACK_PENDING(float(info.num_ack_pending or 0), consumer=cdef.durable)
    _REDELIVERED(float(info.num_redelivered or 0), consumer=cdef.durable)
    return True


async def follow(js: Any, cdef: catalog.ConsumerDef, stop: asyncio.Event, every_s: float = 5.0) -> None:
    """:func:`sample` every ``every_s`` seconds until ``stop`` is set (nothing when metrics are off)."""
    while metrics.active() and not stop.is_set():
        await sample(js, cdef, timeout_s=min(every_s, 5.0))
        try:
            await asyncio.wait_for(stop.wait(), every_s)  # the refresh period, ended early by stop
        except TimeoutError:
            pass
