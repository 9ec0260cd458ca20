"""Black-box agent episodes through the real rollout and judge services over nats-server: the agent's own
code (the real ``openai`` client) calls the rollout's endpoint over the real tiny torch engine; the
trajectory is assembled from its session (one sequence, the agent's own prompt), scored by the task's reward,
and masked for the trainer. Agents that raise, flood calls past their budget or never return end only their
own episode, with the reason."""

from __future__ import annotations

import asyncio

import nats
from black_box_agents import MODES, AskTwice
from endpoint_harness import tokenizer, torch_engine
from nats.js import api as jsapi

from proto import catalog, codec
from proto.prompts import PromptTicket, Sampling
from services.judge.config import JudgeConfig
from services.judge.service import JudgeService
from services.rollout.config import AgentSection, EndpointSection, RolloutConfig
from services.rollout.service import RolloutService
from services.runtime import bus
from services.runtime.config import CommonSection, Loaded, NatsSection, RunSection, TaskSection
from services.runtime.service import ServiceContext
from services.trainer.step_input import completion_tensors

RUN = "blackbox"
TOK = tokenizer()


def loaded(url: str, service) -> Loaded:
    return Loaded(run=RunSection(id=RUN), nats=NatsSection(url=url), common=CommonSection(drain_timeout_s=5.0),
                  task=TaskSection(name="black-box-agent"), service=service)


async def test_black_box_agents_train_from_their_sessions_and_fail_alone(nats_url):
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    await bus.provision_all(js)
    contexts, runs = [], []
    r_loaded = loaded(nats_url, RolloutConfig(agent=AgentSection(max_turns=3, wall_time_s=20.0),
                                              endpoint=EndpointSection(enabled=True)))
    rollout = RolloutService(r_loaded)
    j_loaded = loaded(nats_url, JudgeConfig())
    judge = JudgeService(j_loaded)
    task = AskTwice()
    async with torch_engine(TOK) as engine:
        rollout.attach(engine, TOK, sandboxes=None)
        try:
            for name, ld, stream, handler in (("rollout", r_loaded, catalog.PROMPTS, rollout.handle),
                                              ("judge", j_loaded, catalog.ROLLOUTS, judge.handle)):
                ctx = ServiceContext(name, f"test-{name}", ld, await nats.connect(nats_url))
                contexts.append(ctx)
                if name == "rollout":
                    await rollout.serve_endpoint(ctx)
                runs.append(asyncio.create_task(ctx.consume(stream, lambda m, d, c=ctx, h=handler: h(c, m, d)),
                                                name=f"blackbox-{name}"))
            for i, prompt in enumerate(task.eval_prompts()):
                ticket = PromptTicket(run_id=RUN, task="black-box-agent", group_id=f"g{i}", prompt_id=prompt.id,
                                      prompt_ids=task.format_prompt(TOK, prompt), prompt_text=prompt.text,
                                      group_size=1, policy_version=0, sampling=Sampling(max_new_tokens=16),
                                      metadata=dict(prompt.metadata), msg_id=f"{RUN}-g{i}")
                await bus.publish(js, f"rlbus.{RUN}.prompts", ticket)
            sub = await js.subscribe(f"rlbus.{RUN}.trajectories", stream=catalog.TRAJECTORIES_STREAM.name,
                                     ordered_consumer=True,
                                     config=jsapi.ConsumerConfig(deliver_policy=jsapi.DeliverPolicy.ALL))
            trajs = []
            while len(trajs) < len(MODES):
                msg = codec.decode((await sub.next_msg(timeout=120)).data, catalog.TRAJECTORIES.msg_type)
                trajs.extend(catalog.members(msg))
            await sub.unsubscribe()
        finally:
            await judge.user_code.close()
            for ctx, run in zip(contexts, runs, strict=True):
                ctx.stop.set()
                await asyncio.wait_for(run, 30)
                await ctx.nc.close()
            if rollout.endpoint is not None:
                await rollout.endpoint.stop()
            await nc.close()

    by_mode = {t.rollout.metadata["mode"]: t for t in trajs}
    ok = by_mode["ok"].rollout
    # the agent's own first call rendered the prompt: the sample carries it, not the ticket's
    first = TOK.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], tokenize=False,
                                    add_generation_prompt=True)
    assert ok.prompt_ids == TOK.encode(first, add_special_tokens=False)
    assert ok.error is None and ok.finish_reason in ("eos", "length", "stop")
    assert [t.role for t in ok.turns] == ["assistant", "tool", "assistant"] and ok.metadata["agent_calls"] == "2"
    assert ok.metadata["agent_answer"] == ok.turns[2].text
    assert "Sure?" in ok.turns[1].text and all(len(t.versions) == len(t.token_ids) for t in ok.turns[::2])
    assert by_mode["ok"].reward in (1.0, 0.5)  # the task's reward, by the judge
    prompts, completions, masks, behaviour = completion_tensors([by_mode["ok"]])
    assert prompts[0] == ok.prompt_ids and completions[0] == [i for t in ok.turns for i in t.token_ids]
    assert masks[0] == [int(t.role == "assistant") for t in ok.turns for _ in t.token_ids]
    assert behaviour[0][:len(ok.turns[0].token_ids)] == ok.turns[0].logprobs

    raised = by_mode["raises"]
    assert raised.rollout.finish_reason == "error" and "RuntimeError: the agent broke" in raised.rollout.error
    assert raised.reward == 0.0
    flooded = by_mode["floods"].rollout
    assert flooded.finish_reason == "turn_limit" and flooded.error is None and flooded.metadata["agent_calls"] == "3"
    assert [t.role for t in flooded.turns] == ["assistant", "tool"] * 2 + ["assistant"]
    hung = by_mode["hangs"].rollout
    assert hung.finish_reason == "wall_time" and [t.role for t in hung.turns] == ["assistant", "tool", "assistant"]
    assert rollout.black_box.counters["episodes"] == len(MODES) and rollout.engine_failure is None
