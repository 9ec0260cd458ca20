"""The broadcast group follows the fleet (real nats-server, real gloo groups): an engine that joins a full
group asks for a rank, and the trainer's next send forms a larger group that every engine joins and gets
the version from; when an engine leaves, the next send fails on its rank, the group is formed again at the
configured size, and the remaining engine keeps receiving."""

from __future__ import annotations

import asyncio
import logging

import nats
import torch

from services.lib.weights.transport import make_receiver, make_sender
from services.runtime.weights_config import BroadcastConfig
from tests.conftest import wait_for_async
from tests.weightsync.helpers import assert_bit_identical, make_state, perturb

RUN = "bcgrow"


async def test_broadcast_group_grows_when_an_engine_joins_and_shrinks_when_one_leaves(nats_url, caplog):
    caplog.set_level(logging.INFO, logger="rlbus.weightsync")
    nc = await nats.connect(nats_url, max_reconnect_attempts=0)
    cfg = BroadcastConfig(world_size=2, backend="gloo", timeout_s=5.0, bucket_bytes=4096, reform_for_s=60)
    sender = make_sender(cfg, nc, RUN)
    engines = [make_receiver(cfg, nc, RUN) for _ in range(2)]
    got: list[dict[int, dict[str, torch.Tensor]]] = [{}, {}]

    async def follow(i: int) -> None:
        async for version, state in engines[i]:
            got[i][version] = {k: t.clone() for k, t in state.items()}

    s1 = make_state(11, torch.float32, scale=2)
    s2, s3 = perturb(s1, 0.2, seed=12), perturb(s1, 0.3, seed=13)
    tasks = [asyncio.create_task(follow(0), name="engine-0")]
    try:
        await asyncio.wait_for(sender.start(), 30)  # the configured fleet: one engine
        await asyncio.wait_for(sender.send(s1, 1), 30)
        await wait_for_async(lambda: 1 in got[0], 30, "engine 0 to take v1")

        # a second engine joins: the group is full, so it asks for a rank; the next send grows the group
        tasks.append(asyncio.create_task(follow(1), name="engine-1"))
        await wait_for_async(lambda: "asked the trainer for a rank" in caplog.text, 30, "the join request")
        first_group = sender.group_id
        await asyncio.wait_for(sender.send(s2, 2), 60)
        assert sender.world_size == 3 and sender.group_id != first_group
        await wait_for_async(lambda: 2 in got[0] and 2 in got[1], 30, "both engines to take v2")
        assert_bit_identical(got[0][2], s2)
        assert_bit_identical(got[1][2], s2)
        assert 1 not in got[1]  # it joined after v1

        # engine 1 leaves: the next send fails on its rank and the group is formed again at the configured size
        tasks[1].cancel()
        await asyncio.gather(tasks[1], return_exceptions=True)
        await engines[1].close()
        await asyncio.wait_for(sender.send(s3, 3), 90)
        assert sender.world_size == 2
        await wait_for_async(lambda: 3 in got[0], 30, "engine 0 to take v3")
        assert_bit_identical(got[0][3], s3)
        assert "re-forming the broadcast group" in caplog.text
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for e in engines:
            await e.close()
        await sender.close()
        await nc.close()
