"""Publishing a sandbox instance's lifecycle events: in the order the backend emitted them, from one task.

The backend's ``on_event`` callback must never block: :meth:`EventPublisher.put` queues each event with the trace
context of the request that caused it, and one task publishes them to channel ``SANDBOX_EVENTS``, retrying a bus
that stays away, never dropping one it could still publish.
"""

from __future__ import annotations

import asyncio
import logging

from opentelemetry import context as otel_context

from proto import catalog, subjects
from proto import sandbox as api
from services.runtime.bus import BusError
from services.runtime.service import ServiceContext
from services.runtime.tasks import cancel_and_wait

log = logging.getLogger("rlbus.sandbox")


class EventPublisher:
    """Publishes backend events in the order they were emitted, from one task.

    ``put`` is the backend's ``on_event`` sink: it never blocks and never drops. Each event
    keeps the trace context current when it was emitted (the request that caused it).
    """

    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx = ctx
        self.queue: asyncio.Queue[tuple[api.SandboxEvent, otel_context.Context]] = asyncio.Queue()
        self.published = 0
        self.failed = 0
        self._task: asyncio.Task[None] | None = None

    def put(self, event: api.SandboxEvent) -> None:
        self.queue.put_nowait((event, otel_context.get_current()))

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="sandbox-event-publisher")

    def run_of(self, event: api.SandboxEvent) -> str:
        """The run an event is filed under: its own (a reaped orphan may be a predecessor's)."""
        try:
            return subjects.check_run_id(event.run_id)
        except subjects.InvalidRunId:  # a reaped orphan of an unreadable run: file it under ours
            return self.ctx.run_id

    async def _run(self) -> None:
        while True:
            event, trace_ctx = await self.queue.get()
            token = otel_context.attach(trace_ctx)
            try:
                await self._publish(event)
            finally:
                otel_context.detach(token)
                self.queue.task_done()
            self.ctx.gauges["sandbox/events_pending"] = float(self.queue.qsize())

    async def _publish(self, event: api.SandboxEvent) -> None:
        run = self.run_of(event)
        while True:
            try:
                await self.ctx.publish(catalog.SANDBOX_EVENTS, event, event.sandbox_id, run_id=run)
                self.published += 1
                return
            except BusError as e:  # the server stayed away for a whole retry window: keep the event, go on trying
                log.error("sandbox events cannot be published (%s); %d waiting, retrying", e, self.queue.qsize() + 1)
            except Exception:  # not a transport failure (e.g. rejected by the server): it can never succeed
                self.failed += 1
                log.exception("dropping sandbox event %s of %s: the server rejected it", event.kind, event.sandbox_id)
                return

    async def close(self, timeout_s: float) -> None:
        """Publish what is queued (within ``timeout_s``), then stop the task."""
        if self._task is None:
            return
        try:
            await asyncio.wait_for(self.queue.join(), timeout_s)
        except TimeoutError:
            log.error("%d sandbox events were not published within %.1fs of shutdown (bus unreachable?)",
                      self.queue.qsize(), timeout_s)
        await cancel_and_wait(self._task)
        self._task = None
