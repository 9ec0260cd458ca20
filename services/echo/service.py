"""The echo service: a trivial workload that exercises the whole harness.

Consumes channel ``ECHO_REQUESTS`` (``rlbus.<run>.echo.in``, EchoRequest) and publishes an
EchoReply on ``ECHO_REPLIES`` (``rlbus.<run>.echo.out``). ``fail_times`` makes a request fail transiently that
many deliveries; a text starting with ``poison`` always fails (dead-lettered
after max_deliver); ``work_s`` makes the handler take that long.
"""

from __future__ import annotations

import asyncio

from proto import catalog
from proto.echo import EchoReply, EchoRequest
from services.echo.config import EchoConfig
from services.runtime.config import Loaded
from services.runtime.consume import Delivery, Retry
from services.runtime.service import ServiceContext


class EchoService:
    def __init__(self, cfg: EchoConfig) -> None:
        self.cfg = cfg

    async def run(self, ctx: ServiceContext) -> None:
        async def handle(req: EchoRequest, d: Delivery[EchoRequest]) -> None:
            if req.work_s > 0:
                await asyncio.sleep(req.work_s)  # simulated work
            if req.text.startswith("poison"):
                raise RuntimeError(f"cannot echo {req.text!r}")
            if d.num_delivered <= req.fail_times:
                raise Retry(f"transient failure {d.num_delivered}/{req.fail_times}", delay_s=0.1)
            reply = EchoReply(run_id=ctx.run_id, text=self.cfg.prefix + req.text, worker=ctx.instance,
                              deliveries=d.num_delivered)
            await ctx.publish(catalog.ECHO_REPLIES, reply)

        await ctx.consume(catalog.ECHO_REQUESTS, handle, concurrency=self.cfg.concurrency)


def build(loaded: Loaded) -> EchoService:
    return EchoService(loaded.service)
