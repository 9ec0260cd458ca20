"""Weights published by the trainer reach the rollout engine: outputs change, checksums are enforced."""

from __future__ import annotations

import asyncio

import nats
import torch

from services.lib.engine.base import SamplingParams
from services.lib.engine.config import TorchEngineConfig
from services.lib.engine.torch_engine import TorchEngine
from services.lib.model_io import load_policy
from services.lib.weights.client import WeightPublisher
from services.lib.weights.objstore import ObjectStoreBlobs
from services.lib.weights.transport import make_receiver
from services.rollout.config import RolloutConfig
from services.rollout.service import RolloutService
from services.runtime.config import CommonSection, Loaded, ModelSection, NatsSection, RunSection
from services.runtime.weights_config import EncodingConfig, StoreTransportConfig
from tests.conftest import wait_for_async

RUN = "wt"


class Gauges:
    """The part of ServiceContext the weight follower touches (its gauges dict)."""

    def __init__(self) -> None:
        self.gauges: dict[str, float] = {}


async def greedy(engine: TorchEngine, prompt: list[int]) -> list[int]:
    res = await engine.generate(prompt, SamplingParams(max_new_tokens=6, temperature=1e-4, seed=0))
    return res.token_ids


async def test_publish_pull_apply_changes_outputs_and_refuses_corruption(nats_url, loop_model_dir):
    model, tok = load_policy(loop_model_dir)
    prompt = tok("12+34=")["input_ids"]
    nc = await nats.connect(nats_url)
    store = ObjectStoreBlobs(nc)
    pub = WeightPublisher(nc, RUN, store, encoding=EncodingConfig(anchor_every=1))
    await pub.publish({k: v.detach() for k, v in model.state_dict().items()}, version=0)

    loaded = Loaded(run=RunSection(id=RUN), nats=NatsSection(url=nats_url), common=CommonSection(),
                    model=ModelSection(name=str(loop_model_dir)), service=RolloutConfig())
    svc = RolloutService(loaded)
    svc.engine = TorchEngine(TorchEngineConfig(), loop_model_dir)
    await svc.engine.start()
    receiver = make_receiver(StoreTransportConfig(recheck_s=0.2), nc, RUN)
    follower = asyncio.create_task(svc.follow_weights(Gauges(), receiver))
    try:
        await asyncio.wait_for(svc.first_weights.wait(), 30)
        assert svc.engine.version == 0
        before = await greedy(svc.engine, prompt)

        # version 1: a clearly different model (scaled LM head) changes the greedy output
        new_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        new_state["lm_head.weight"] = -new_state["lm_head.weight"]
        await pub.publish(new_state, version=1)
        async with svc.version_changed:
            await asyncio.wait_for(svc.version_changed.wait_for(lambda: svc.engine.version == 1), 30)
        after = await greedy(svc.engine, prompt)
        assert after != before

        # version 2 with a corrupted chunk: refused, engine stays on version 1 with the same outputs
        # (the follower is paused so the chunk is corrupted before it first reads version 2)
        follower.cancel()
        await asyncio.wait({follower})
        bad = {k: v.clone() for k, v in new_state.items()}
        bad["model.norm.weight"] += 1.0
        m2 = await pub.publish(bad, version=2)
        victim = m2.chunks[0]
        buf = bytearray(victim.size)
        await store.read_into(victim.name, memoryview(buf))
        buf[victim.size // 2] ^= 0xFF
        await store.put(victim.name, memoryview(buf), victim.sha256)
        follower = asyncio.create_task(svc.follow_weights(Gauges(), receiver))
        await wait_for_async(lambda: svc.weight_errors, 10, "the follower to refuse the corrupted version")
        assert svc.weight_errors == 1 and "blake3" in receiver.last_error
        assert svc.engine.version == 1
        assert await greedy(svc.engine, prompt) == after
        assert torch.equal(svc.engine._model.lm_head.weight.detach(), new_state["lm_head.weight"])
    finally:
        follower.cancel()
        await asyncio.wait({follower})
        await receiver.close()
        await svc.engine.stop()
        await nc.close()
