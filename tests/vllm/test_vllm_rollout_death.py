"""The vLLM engine dying under a running rollout service: the service exits non-zero (so the launcher
restarts it) and the tickets it had not finished go back to the stream for redelivery; none is lost."""

from __future__ import annotations

import asyncio
import os
import signal

import nats

from proto import catalog, codec
from proto.prompts import PromptTicket, Sampling
from services.launcher import registry
from services.runtime import bus, service
from services.runtime.config import load_service_config
from tests.conftest import run_file, wait_for_async
from tests.vllm.conftest import vllm_workers

RUN = "vdeath"
TICKETS = 6


async def test_a_dead_engine_stops_the_rollout_with_an_error_and_loses_no_ticket(nats_url, tmp_path, loop_model_dir):
    cfg = run_file(tmp_path, loop_model_dir, run_id=RUN, nats_url=nats_url, trainer={},
                   rollout={"initial_weights_timeout_s": 1.0, "max_tickets": TICKETS,
                            "engine": {"type": "vllm", "max_num_seqs": 16, "kv_cache_gib": 0.25,
                                       "enforce_eager": True, "dtype": "float32"}})
    cfg_cls, factory = registry.load("rollout")
    rollout = asyncio.create_task(service.serve("rollout", factory, load_service_config("rollout", cfg_cls, cfg),
                                                "rollout-0"))
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    await bus.provision_all(js)  # the streams exist before the tickets are published
    finished: set[str] = set()

    async def on_rollout(m) -> None:
        finished.update(r.group_id for r in catalog.members(codec.decode(m.data, catalog.ROLLOUTS.msg_type)))

    await nc.subscribe(catalog.ROLLOUTS.subject(RUN), cb=on_rollout)

    async def consumer_holds_tickets() -> bool:
        try:
            ci = await js.consumer_info(catalog.PROMPTS_STREAM.name, f"rollout-{RUN}")
        except Exception:
            return False
        return ci.num_ack_pending > 0

    for i in range(TICKETS):
        t = PromptTicket(run_id=RUN, task="addition", group_id=f"g{i}", prompt_id=f"p{i}",
                         prompt_ids=[1, 9, 6, 9, 18], prompt_text="x", group_size=2, policy_version=0,
                         sampling=Sampling(max_new_tokens=50, temperature=1.0, top_p=1.0, stop=[]))
        t.msg_id = f"{RUN}-g{i}"
        await js.publish(catalog.PROMPTS.subject(RUN), codec.encode(t), headers={"Nats-Msg-Id": t.msg_id})
    await wait_for_async(consumer_holds_tickets, 180, "the rollout to take tickets")
    workers = vllm_workers()
    assert workers, "no vLLM worker process found"
    for w in workers:
        os.kill(w.pid, signal.SIGKILL)
    code = await asyncio.wait_for(rollout, 180)
    assert code != 0  # a crash the launcher restarts, not a clean stop
    # the tickets it had not finished come back at once (naked on the way out), to the next rollout
    psub = await js.pull_subscribe_bind(durable=f"rollout-{RUN}", stream=catalog.PROMPTS_STREAM.name)
    redelivered: set[str] = set()
    for _ in range(10):
        try:
            msgs = await psub.fetch(batch=TICKETS, timeout=3)
        except nats.errors.TimeoutError:
            msgs = []
        for m in msgs:
            redelivered.add(codec.decode(m.data, PromptTicket).group_id)
            await m.ack()
        if redelivered | finished >= {f"g{i}" for i in range(TICKETS)}:
            break
    everything = {f"g{i}" for i in range(TICKETS)}
    # the tickets in flight at the kill come back; on a fast run the engine may have finished all of them
    # between the check above and the kill (seen once in CI), and then there is nothing to come back
    assert redelivered or finished == everything, "no ticket came back after the engine died"
    assert redelivered | finished == everything, (sorted(redelivered), sorted(finished))  # none lost
    await nc.close()
