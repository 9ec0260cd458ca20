"""A function-tool environment through the real rollout and judge services over nats-server: per-turn rewards
summed by the judge with the final score, the trainer's loss mask over the recorded turns.

The assistant turns are replayed token ids (``env_harness.ReplayEngine``, an engine stand-in used because the
tiny model does not write tool calls); the judge runs the task's reward in its real worker processes.
"""

from __future__ import annotations

import asyncio

import nats
from env_harness import PROMPT, CalculatorEnv, ReplayEngine, call, tools_tokenizer
from nats.js import api as jsapi

from proto import catalog, codec
from proto.prompts import PromptTicket, Sampling
from services.judge.config import JudgeConfig
from services.judge.service import JudgeService
from services.rollout.config import AgentSection, RolloutConfig
from services.rollout.service import RolloutService
from services.runtime import bus
from services.runtime.config import CommonSection, Loaded, NatsSection, RunSection, TaskSection
from services.runtime.service import ServiceContext
from services.trainer.step_input import completion_tensors

RUN = "envbus"
TOK = tools_tokenizer()


def loaded(url: str, service) -> Loaded:
    return Loaded(run=RunSection(id=RUN), nats=NatsSection(url=url), common=CommonSection(drain_timeout_s=5.0),
                  task=TaskSection(name="calculator-env"), service=service)


async def test_turn_rewards_are_summed_with_the_final_score_by_the_judge(nats_url):
    texts = [f"First.{call('add', a=2, b=3)}", f"Check.{call('multiply', a=5, b=1)}{call('boom', x=1)}",
             "The answer is\n5"]
    engine = ReplayEngine.of_texts(TOK, texts)
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    await bus.provision_all(js)
    contexts, runs = [], []
    r_loaded = loaded(nats_url, RolloutConfig(agent=AgentSection(max_turns=5, max_total_tokens=4000)))
    rollout = RolloutService(r_loaded)
    rollout.attach(engine, TOK, sandboxes=None)
    j_loaded = loaded(nats_url, JudgeConfig())
    judge = JudgeService(j_loaded)
    for name, ld, stream, handler in (("rollout", r_loaded, catalog.PROMPTS, rollout.handle),
                                      ("judge", j_loaded, catalog.ROLLOUTS, judge.handle)):
        ctx = ServiceContext(name, f"test-{name}", ld, await nats.connect(nats_url))
        contexts.append(ctx)
        runs.append(asyncio.create_task(ctx.consume(stream, lambda m, d, c=ctx, h=handler: h(c, m, d)),
                                        name=f"envbus-{name}"))
    try:
        env = CalculatorEnv()
        ticket = PromptTicket(run_id=RUN, task="calculator-env", group_id="g0", prompt_id=PROMPT.id,
                              prompt_ids=env.format_prompt(TOK, PROMPT), prompt_text=PROMPT.text, group_size=2,
                              policy_version=0, sampling=Sampling(max_new_tokens=400),
                              metadata=dict(PROMPT.metadata))
        ticket.msg_id = f"{RUN}-g0"
        await bus.publish(js, f"rlbus.{RUN}.prompts", ticket)
        sub = await js.subscribe(f"rlbus.{RUN}.trajectories", stream=catalog.TRAJECTORIES_STREAM.name,
                                 ordered_consumer=True,
                                 config=jsapi.ConsumerConfig(deliver_policy=jsapi.DeliverPolicy.ALL))
        trajs = []
        while len(trajs) < 2:
            msg = codec.decode((await sub.next_msg(timeout=60)).data, catalog.TRAJECTORIES.msg_type)
            trajs.extend(catalog.members(msg))
        await sub.unsubscribe()
    finally:
        await judge.user_code.close()
        for ctx, task in zip(contexts, runs, strict=True):
            ctx.stop.set()
            await asyncio.wait_for(task, 30)
            await ctx.nc.close()
        await nc.close()

    for traj in trajs:
        r = traj.rollout
        assert r.error is None and r.finish_reason == "eos"
        assert [t.role for t in r.turns] == ["assistant", "tool", "assistant", "tool", "assistant"]
        # turn 0's call ran (0.25), turn 1 had a raising tool (0.0), the last turn answered (no turn reward)
        assert [t.reward for t in r.turns] == [0.25, None, 0.0, None, None]
        assert "ZeroDivisionError" in r.turns[3].text and ">\n5\n<" in r.turns[1].text
        by_name = {s.grader: s for s in traj.scores}
        assert by_name["calculator-env.reward"].score == 1.0
        assert by_name["turn_rewards"].score == 0.25 and by_name["turn_rewards"].weight == 0.0
        assert traj.reward == 1.25  # sum of turn rewards + final score
        assert [t.token_ids for t in r.turns if t.role == "assistant"] == engine.script
    _, completions, masks, behaviour = completion_tensors(trajs)
    turns = trajs[0].rollout.turns
    assert masks[0] == [int(t.role == "assistant") for t in turns for _ in t.token_ids]
    assert completions[0] == [i for t in turns for i in t.token_ids]
    assert behaviour[0][:len(turns[0].token_ids)] == [-0.1] * len(turns[0].token_ids)
