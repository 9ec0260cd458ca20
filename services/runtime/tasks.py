"""Stopping background tasks for good.

On Python 3.11 ``asyncio.wait_for`` swallows a cancellation that arrives in the same loop step as its inner
awaitable completes: it returns the result and the task goes on as if never cancelled. Every JetStream request of
nats-py goes through ``wait_for`` (publish acks, KV gets and puts), so a loop stopped only by ``cancel()`` can lose
its cancellation mid-request, go back to its wait, and leave whoever awaits it waiting for good (a service that
never stops, a backend close that never returns). :func:`cancel_and_wait` cancels again until the tasks are done.
"""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger("rlbus.runtime.tasks")

#: how long a cancelled task may run on before it is cancelled again
RETRY_S = 1.0


async def cancel_and_wait(*tasks: asyncio.Future[object] | None, retry_s: float = RETRY_S) -> None:
    """Cancel ``tasks`` (None entries are skipped) and wait until every one is done, cancelling again each
    ``retry_s`` any that lost its cancellation. Their outcomes are left on them (``result()``, ``exception()``,
    ``cancelled()``); exceptions count as retrieved, so none is reported as never retrieved."""
    pending = {t for t in tasks if t is not None and not t.done()}
    rounds = 0
    while pending:
        for t in pending:
            t.cancel()
        if rounds == 1:
            log.warning("%d task(s) went on after their cancellation (lost inside a wait_for on Python 3.11): "
                        "cancelling again: %s", len(pending), ", ".join(_name(t) for t in pending))
        _, pending = await asyncio.wait(pending, timeout=retry_s)
        rounds += 1
    for t in tasks:
        if t is not None and not t.cancelled():
            t.exception()  # retrieved: the caller looks at it if it cares


def _name(t: asyncio.Future[object]) -> str:
    return t.get_name() if isinstance(t, asyncio.Task) else repr(t)
