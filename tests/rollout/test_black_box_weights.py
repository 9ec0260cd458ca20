"""Weights move under a running black-box agent: the real rollout service (endpoint over the torch engine,
weights followed from the store transport over nats-server) runs an agent whose two model calls straddle the
publication of a new weight version. The episode stays one sequence and every generated token keeps the
version that sampled it: the first call's tokens version 0, the second's version 1; the staleness filter reads
the oldest (``Rollout.min_version``)."""

from __future__ import annotations

import asyncio

import nats
from black_box_agents import BETWEEN_CALLS, TwoCalls
from endpoint_harness import tiny_model, tokenizer
from nats.js import api as jsapi

from proto import catalog, codec
from proto.prompts import PromptTicket, Sampling
from services.lib.engine.config import TorchEngineConfig
from services.lib.engine.torch_engine import TorchEngine
from services.lib.weights.client import WeightPublisher
from services.lib.weights.objstore import ObjectStoreBlobs
from services.lib.weights.transport import make_receiver
from services.rollout.config import AgentSection, EndpointSection, RolloutConfig
from services.rollout.service import RolloutService
from services.runtime import bus
from services.runtime.config import CommonSection, Loaded, NatsSection, RunSection, TaskSection
from services.runtime.service import ServiceContext
from services.runtime.weights_config import EncodingConfig, StoreTransportConfig
from services.trainer.admission import is_stale
from tests.conftest import wait_for_async

RUN = "bbweights"
TOK = tokenizer()


def _state(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


async def test_an_agent_spanning_two_weight_versions_records_both_per_token(nats_url):
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    await bus.provision_all(js)
    model = tiny_model(TOK)
    publisher = WeightPublisher(nc, RUN, ObjectStoreBlobs(nc), encoding=EncodingConfig(anchor_every=1))
    await publisher.publish(_state(model), version=0)
    loaded = Loaded(run=RunSection(id=RUN), nats=NatsSection(url=nats_url), common=CommonSection(drain_timeout_s=5.0),
                    task=TaskSection(name=TwoCalls.name),
                    service=RolloutConfig(agent=AgentSection(max_turns=4, wall_time_s=120.0),
                                          endpoint=EndpointSection(enabled=True)))
    rollout = RolloutService(loaded)
    engine = TorchEngine.from_model(tiny_model(TOK), TOK, TorchEngineConfig(), seed=0)
    await engine.start()
    rollout.attach(engine, TOK, sandboxes=None)
    ctx = ServiceContext("rollout", "test-rollout", loaded, await nats.connect(nats_url))
    follower = asyncio.create_task(
        rollout.follow_weights(ctx, make_receiver(StoreTransportConfig(recheck_s=0.2), nc, RUN)), name="follow")
    published: list[int] = []

    async def publish_version_1() -> None:  # between the agent's two calls: a new version reaches the engine
        state = _state(model)
        state["lm_head.weight"] = -state["lm_head.weight"]
        await publisher.publish(state, version=1)
        published.append(1)
        await wait_for_async(lambda: engine.version == 1, 60, "version 1 applied by the engine")

    BETWEEN_CALLS[:] = [publish_version_1]
    try:
        await asyncio.wait_for(rollout.first_weights.wait(), 60)
        assert engine.version == 0
        await rollout.serve_endpoint(ctx)
        run = asyncio.create_task(ctx.consume(catalog.PROMPTS, lambda m, d: rollout.handle(ctx, m, d)),
                                  name="rollout-consume")
        task = TwoCalls()
        (prompt,) = task.eval_prompts()
        ticket = PromptTicket(run_id=RUN, task=TwoCalls.name, group_id="g0", prompt_id=prompt.id,
                              prompt_ids=task.format_prompt(TOK, prompt), prompt_text=prompt.text, group_size=1,
                              policy_version=0, sampling=Sampling(max_new_tokens=16), metadata=dict(prompt.metadata),
                              msg_id=f"{RUN}-g0")
        await bus.publish(js, f"rlbus.{RUN}.prompts", ticket)
        sub = await js.subscribe(f"rlbus.{RUN}.rollouts", stream=catalog.ROLLOUTS_STREAM.name, ordered_consumer=True,
                                 config=jsapi.ConsumerConfig(deliver_policy=jsapi.DeliverPolicy.ALL))
        msg = codec.decode((await sub.next_msg(timeout=120)).data, catalog.ROLLOUTS.msg_type)
        await sub.unsubscribe()
        ctx.stop.set()
        await asyncio.wait_for(run, 30)
    finally:
        BETWEEN_CALLS.clear()
        follower.cancel()
        await asyncio.gather(follower, return_exceptions=True)
        if rollout.endpoint is not None:
            await rollout.endpoint.stop()
        await engine.stop()
        await ctx.nc.close()
        await nc.close()

    (r,) = msg.records()
    assert published == [1] and r.error is None and r.metadata["agent_calls"] == "2"
    assert not r.extra_segments  # the second call continued the first: one sequence
    first, between, second = r.turns
    assert (first.role, between.role, second.role) == ("assistant", "tool", "assistant")
    assert first.token_ids and second.token_ids
    assert first.versions == [0] * len(first.token_ids)  # sampled before the new version arrived
    assert second.versions == [1] * len(second.token_ids)  # after: every token keeps its own version
    assert r.min_version() == 0  # what the staleness filter reads: the oldest token
    assert not is_stale(r.min_version(), current_version=1, max_staleness=1)
    assert is_stale(r.min_version(), current_version=1, max_staleness=0)
