"""Multi-turn agent loops through real sandboxes and the bus, driven by a scripted stand-in policy.

The policy is :class:`agentic_harness.ScriptedEngine`: a stand-in engine that emits a fixed sequence of
tool calls (it satisfies the Engine protocol with fake logprobs and versions). The sandbox service, the
rollout and judge handlers with their consume loops, JetStream and the trainer's loss-mask code are real.
"""

from __future__ import annotations

import asyncio

from agentic_harness import RUN, Bus, ScriptedEngine, all_events, coding_prompt, loaded, ticket_for

from proto import catalog
from services.judge.config import JudgeConfig
from services.judge.service import JudgeService
from services.lib.engine.base import Engine, SamplingParams
from services.lib.sandbox_client import SandboxClient
from services.rollout.agent import AgentLoop
from services.rollout.config import AgentSection, RolloutConfig, SandboxSection
from services.rollout.service import RolloutService
from services.runtime import bus as runtime_bus
from services.tasks import get_task
from services.tasks.grader_specs import RewardGraderSpec, SandboxTestsSpec
from services.trainer.step_input import completion_tensors

SCRIPT = [
    "I will write the function.\n```python file=solution.py\ndef add_2(x):\n    return x + 2\n```\n",
    "Let me check it.\n```bash\npython3 -c 'from solution import add_2; print(add_2(40))'\n```\n",
    "And once more in Python.\n```python\nimport solution\nprint(solution.add_2(1) * 100)\n```\n",
    "It works: add_2 adds two.",
]


async def start_pipeline(b: Bus, engine: ScriptedEngine, tokenizer, agent: AgentSection | None = None) -> None:
    """The rollout and judge services' consume loops in this event loop (their engines: the stand-in)."""
    r_loaded = loaded(b.url, RolloutConfig(agent=agent or AgentSection(
        max_turns=6, wall_time_s=60.0, sandbox=SandboxSection(disk_mb=64, inodes=4096))))
    r_ctx = await b.context("rollout", r_loaded)
    rollout = RolloutService(r_loaded)
    rollout.attach(engine, tokenizer, SandboxClient(r_ctx.nc, RUN, timeout_s=20.0))
    b.serve(r_ctx, r_ctx.consume(catalog.PROMPTS, lambda t, d: rollout.handle(r_ctx, t, d),
                                 concurrency=4))
    j_loaded = loaded(b.url, JudgeConfig(graders={"coding": [SandboxTestsSpec(weight=1.0),
                                                             RewardGraderSpec(weight=0.0)]}))
    j_ctx = await b.context("judge", j_loaded)
    judge = JudgeService(j_loaded)
    judge.attach(SandboxClient(j_ctx.nc, RUN, timeout_s=20.0))
    b.serve(j_ctx, j_ctx.consume(catalog.ROLLOUTS, lambda r, d: judge.handle(j_ctx, r, d),
                                 concurrency=4))


async def test_scripted_multi_turn_rollout_through_sandbox_judge_and_loss_mask(bus: Bus, tokenizer):
    task = get_task("coding")
    paused_at_generation: list[list[str]] = []

    async def hook(turn: int, context: str) -> None:  # the sandbox's state while the agent waits on inference
        paused_at_generation.append([s.state for s in await bus.sandboxes.sandboxes(expected=1)])

    engine = ScriptedEngine(tokenizer, SCRIPT, hook=hook, version=3)
    assert isinstance(engine, Engine)
    await start_pipeline(bus, engine, tokenizer)
    await bus.publish_ticket(ticket_for(task, tokenizer, coding_prompt(), "g-multi", group_size=1))
    [traj] = await bus.trajectories(1)
    r = traj.rollout

    # the loop: three tool calls, their observations, then the final answer
    assert [t.role for t in r.turns] == ["assistant", "tool"] * 3 + ["assistant"]
    assert r.finish_reason == "eos" and r.error is None and engine.calls == [0, 1, 2, 3]
    assert "wrote solution.py" in r.turns[1].text
    assert "exit code 0" in r.turns[3].text and "42" in r.turns[3].text
    assert "300" in r.turns[5].text
    # every generation happened while the (only) sandbox was paused
    assert paused_at_generation == [["paused"]] * 4

    # graded by the hidden tests in a fork; the original sandbox is destroyed by the judge afterwards
    by_name = {s.grader: s for s in traj.scores}
    assert by_name["sandbox_tests"].score == 1.0 and "3/3 hidden tests passed" in by_name["sandbox_tests"].explanation
    assert by_name["coding.reward"].weight == 0.0 and traj.reward == 1.0
    await bus.events(r.sandbox_id)  # waits for "destroyed"
    events = await all_events(bus.js)
    assert [e.kind for e in events[r.sandbox_id]] == [
        "created", "paused",
        "resumed", "paused",                                   # write solution.py
        "resumed", "exec_started", "exec_finished", "paused",  # bash
        "resumed", "exec_started", "exec_finished", "paused",  # python
        "snapshotted", "destroyed",                             # the judge's fork, then the judge's destroy
    ]
    created = events[r.sandbox_id][0].detail  # the rollout's sandbox section reached the sandbox's limits
    assert created.limits.disk_mb == 64 and created.limits.inodes == 4096
    [fork_id] = [sid for sid, evs in events.items()
                 if evs[0].kind == "forked" and evs[0].detail.parent_id == r.sandbox_id]
    assert [e.kind for e in events[fork_id]] == ["forked", "exec_started", "exec_finished", "destroyed"]

    # the trainer's view: tool tokens are masked out, behaviour logprobs and versions kept per token
    prompts, completions, masks, behaviour = completion_tensors([traj])
    assert prompts[0] == r.prompt_ids and completions[0] == r.completion_ids()
    want_mask, want_lp = [], []
    for k, t in enumerate(r.turns):
        assistant = t.role == "assistant"
        want_mask += [1 if assistant else 0] * len(t.token_ids)
        want_lp += [-(k // 2 + 1) / 10 if assistant else 0.0] * len(t.token_ids)
        assert (t.versions == [3] * len(t.token_ids)) if assistant else (t.versions == [] and t.logprobs == [])
    assert masks[0] == want_mask and behaviour[0] == want_lp
    assert 0 < sum(masks[0]) < len(masks[0])
    # the engine was conditioned on exactly prompt + all earlier turns (what the trainer's forward pass sees)
    last_context = tokenizer.decode(r.prompt_ids + [t for turn in r.turns[:-1] for t in turn.token_ids],
                                    skip_special_tokens=False)
    assert last_context.endswith("<|im_start|>assistant\n") and last_context.count("<|im_start|>assistant") == 4


async def test_sandbox_failure_mid_rollout_is_recorded_and_reaches_judge_and_trainer(bus: Bus, tokenizer):
    task = get_task("coding")
    killed: list[str] = []

    async def hook(turn: int, context: str) -> None:  # the test kills sample 0's sandbox between turns
        if turn == 1 and not killed:
            killed.append("")
            [victim] = [s.sandbox_id for s in await bus.sandboxes.sandboxes(expected=1) if s.labels["sample"] == "0"]
            killed[0] = victim
            await bus.sandboxes.destroy(victim)

    engine = ScriptedEngine(tokenizer, SCRIPT, hook=hook)
    # the trainer's durable consumer exists, as in a run: published trajectories wait there for the trainer
    await runtime_bus.ensure_consumer(bus.js, catalog.TRAINER_TRAJECTORIES.for_run(RUN))
    await start_pipeline(bus, engine, tokenizer)
    await bus.publish_ticket(ticket_for(task, tokenizer, coding_prompt(), "g-fail", group_size=2))
    trajs = sorted(await bus.trajectories(2), key=lambda t: t.rollout.sample_index)

    failed, ok = trajs
    assert failed.rollout.sandbox_id == killed[0]
    assert failed.rollout.finish_reason == "error" and "sandbox" in failed.rollout.error
    assert "not_found" in failed.rollout.error
    assert failed.reward == 0.0 and failed.scores[0].error == failed.rollout.error
    assert failed.rollout.turns and failed.rollout.turns[0].role == "assistant"  # what it did before is kept
    # the other rollout of the group is untouched by its sibling's failure
    assert ok.rollout.error is None and ok.rollout.finish_reason == "eos" and ok.reward == 1.0
    # both reached the trainer's accounting: held by its consumer, nothing lost (the trainer then drops
    # the failed one with its error instead of training on it: tests/loop/test_failed_rollouts.py)
    from services.launcher.accounting import accounting

    acc = await accounting(bus.js, RUN)
    assert acc["published"] == 2 and acc["held_by_trainer_consumer"] == 2 and acc["lost"] == 0
    _, completions, masks, _ = completion_tensors(trajs)
    assert all(len(c) == len(m) for c, m in zip(completions, masks, strict=True))


async def test_tool_timeout_is_an_observation_and_wall_time_ends_the_rollout(bus: Bus, tokenizer):
    task = get_task("coding")
    prompt = coding_prompt()
    ids = task.format_prompt(tokenizer, prompt)
    params = SamplingParams(max_new_tokens=200)
    script = ["```bash\nsleep 5\n```\n", "Too slow; I stop here."]
    loop = AgentLoop(ScriptedEngine(tokenizer, script), tokenizer, bus.sandboxes,
                     AgentSection(exec_timeout_s=1.0, wall_time_s=30.0))
    out = await loop.run(task, prompt, ids, params)
    assert out.finish_reason == "eos" and out.error is None and out.handed_off
    assert "timed out after" in out.turns[1].text
    assert await bus.state(out.sandbox_id) == "paused"  # handed to the judge, paused

    loop = AgentLoop(ScriptedEngine(tokenizer, ["```bash\nsleep 20\n```\n"]), tokenizer, bus.sandboxes,
                     AgentSection(exec_timeout_s=15.0, wall_time_s=1.5))
    slow = await asyncio.wait_for(loop.run(task, prompt, ids, params), 20)
    assert slow.finish_reason == "wall_time" and slow.error is None
    assert [t.role for t in slow.turns] == ["assistant"]
    assert await bus.state(slow.sandbox_id) == "paused"
    for sid in (out.sandbox_id, slow.sandbox_id):
        await bus.sandboxes.destroy(sid)


async def test_a_bare_opening_fence_does_not_cut_the_message(bus: Bus, tokenizer):
    # "\n```\n" opens a bare block and closes any block: the loop continues the message until it closes
    task = get_task("coding")
    prompt = coding_prompt()
    engine = ScriptedEngine(tokenizer, ["The output will be:\n```\n42\n```\n", "Done."])
    loop = AgentLoop(engine, tokenizer, bus.sandboxes, AgentSection())
    out = await loop.run(task, prompt, task.format_prompt(tokenizer, prompt), SamplingParams(max_new_tokens=100))
    assert engine.calls == [0, 0, 1]
    first = out.turns[0]
    assert first.text == "The output will be:\n```\n42\n```\n"
    assert len(first.token_ids) == len(first.logprobs) == len(first.versions) == len(first.text)  # char tokens
    assert "is not a tool" in out.turns[1].text and out.finish_reason == "eos"
    await bus.sandboxes.destroy(out.sandbox_id)


async def test_hundreds_of_concurrent_loops_each_with_its_own_sandbox(bus: Bus, tokenizer):
    task = get_task("coding")
    prompt = coding_prompt()
    script = ["```python file=solution.py\ndef add_2(x):\n    return x + 2\n```\n", "Done."]
    peak: list[int] = []
    loop = AgentLoop(ScriptedEngine(tokenizer, script, hook=lambda turn, ctx: _note(peak, loop.active)), tokenizer,
                     bus.sandboxes, AgentSection(handoff=False))
    ids = task.format_prompt(tokenizer, prompt)
    outs = await asyncio.gather(*(loop.run(task, prompt, ids, SamplingParams(max_new_tokens=100), labels={"i": str(i)})
                                  for i in range(200)))
    assert [o.error for o in outs] == [None] * 200 and {o.finish_reason for o in outs} == {"eos"}
    assert len({o.sandbox_id for o in outs}) == 200 and max(peak) == 200
    assert loop.counters["tool_calls"] == 200 and loop.active == 0
    assert await bus.sandboxes.sandboxes(expected=1) == []  # handoff = false: each loop destroyed its own


async def _note(peak: list[int], active: int) -> None:
    peak.append(active)
