"""The one episode loop (services/rollout/episode.py) with environments (services/tasks/env.py).

Single-turn tasks and budgets run on the real tiny torch engine. Function-tool episodes need a model that
writes tool calls, which the tiny model does not: those use ``env_harness.ReplayEngine``, an engine stand-in
that replays fixed token ids (only to exercise the parser and the tool path); tokens, tools, the template, the
judge and nats-server are real.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from env_harness import PROMPT, CalculatorEnv, NeverDone, ReplayEngine, call, tools_tokenizer

from proto.prompts import PromptTicket, Sampling
from services.lib.engine.base import SamplingParams
from services.lib.engine.config import TorchEngineConfig
from services.lib.engine.torch_engine import TorchEngine
from services.rollout.config import AgentSection, RolloutConfig
from services.rollout.episode import EpisodeLoop
from services.rollout.service import RolloutService
from services.runtime.config import CommonSection, Loaded, ModelSection, NatsSection, RunSection
from services.tasks import get_task
from services.tasks.env import SingleTurn, environment_of, tool_schemas

TOK = tools_tokenizer()
@pytest.fixture
async def tiny_engine(tiny_model_dir):
    engine = TorchEngine(TorchEngineConfig(), tiny_model_dir)
    await engine.start()
    yield engine
    await engine.stop()


def rollout_service(engine, tokenizer, agent: AgentSection | None = None) -> RolloutService:
    loaded = Loaded(run=RunSection(id="env"), nats=NatsSection(url="nats://unused:1"), common=CommonSection(),
                    model=ModelSection(name="tiny"), service=RolloutConfig(agent=agent or AgentSection()))
    svc = RolloutService(loaded)
    svc.attach(engine, tokenizer, sandboxes=None)
    return svc


async def test_a_single_turn_task_is_one_generation_through_the_loop_with_the_real_engine(tiny_engine):
    """The addition task, unchanged, as the single-turn environment: one assistant turn holding exactly the
    engine's generation, and nothing of the tool machinery built (no template, no frame)."""
    svc = rollout_service(tiny_engine, tiny_engine.tokenizer)
    task = get_task("addition")
    env = svc.environment("addition")
    assert isinstance(env, SingleTurn) and isinstance(environment_of(task), SingleTurn)
    prompt = task.eval_prompts()[0]
    ids = task.format_prompt(tiny_engine.tokenizer, prompt)
    ticket = PromptTicket(run_id="env", task="addition", group_id="g", prompt_id=prompt.id, prompt_ids=ids,
                          group_size=1, policy_version=0, sampling=Sampling(max_new_tokens=8))
    params = SamplingParams(max_new_tokens=8, temperature=1e-4, seed=0)
    out = await svc.episode(ticket, env, params, 0)
    direct = await tiny_engine.generate(ids, params)
    [turn] = out.turns
    assert turn.role == "assistant" and turn.token_ids == direct.token_ids and turn.text == direct.text
    assert len(turn.logprobs) == len(turn.versions) == len(turn.token_ids) and turn.reward is None
    assert out.finish_reason == direct.finish_reason and out.error is None
    assert svc.episodes._frame is None and svc.episodes._specs == {}  # the single-turn path built nothing


async def test_function_tools_parallel_calls_are_token_exact():
    """Two parallel calls (a sync and an async tool) and a malformed one in one message; the tool turn is
    exactly the template's rendering of the results; the assistant turns are exactly the replayed ids."""
    texts = [f"Let me compute.{call('add', a=2, b=3)}{call('multiply', a=2, b=2.5)}<tool_call>{{bad</tool_call>",
             "The answer is\n5"]
    engine = ReplayEngine.of_texts(TOK, texts)
    loop = EpisodeLoop(engine, TOK, AgentSection(tool_parser="hermes"))
    env = CalculatorEnv()
    prompt_ids = env.format_prompt(TOK, PROMPT)
    assert '"name": "add"' in TOK.decode(prompt_ids)  # the tools rendered into the prompt by the template
    out = await loop.run(env, PROMPT, prompt_ids, SamplingParams(max_new_tokens=400))

    assert [t.role for t in out.turns] == ["assistant", "tool", "assistant"]
    a0, obs, a1 = out.turns
    assert a0.token_ids == engine.script[0] and a1.token_ids == engine.script[1]  # the engine's ids, untouched
    assert a0.logprobs == [-0.1] * len(a0.token_ids) and a0.versions == [7] * len(a0.token_ids)
    assert obs.logprobs == [] and obs.versions == []
    assert out.finish_reason == "eos" and out.error is None and out.tool_calls == 3
    assert a0.reward == 0.0 and a1.reward is None  # the malformed call made turn 0's calls not all good
    # the whole context decodes to the template's rendering of the conversation, tool results included
    conversation = [*PROMPT.messages, {"role": "assistant", "content": texts[0]},
                    {"role": "tool", "tool_call_id": "call_0", "name": "add", "content": "5"},
                    {"role": "tool", "tool_call_id": "call_1", "name": "multiply", "content": "5.0"},
                    {"role": "tool", "tool_call_id": "error_0", "name": "error", "content": "<the parse error>"},
                    {"role": "assistant", "content": texts[1]}]
    rendered = TOK.apply_chat_template(conversation, tools=tool_schemas(env.tools), tokenize=False)
    error_text = obs.text.split('<tool_response id="error_0">\n', 1)[1].split("\n</tool_response>", 1)[0]
    assert "invalid JSON" in error_text or "JSON" in error_text
    context = TOK.decode(prompt_ids + a0.token_ids + obs.token_ids + a1.token_ids, skip_special_tokens=False)
    assert context == rendered.replace("<the parse error>", error_text).rstrip("\n")
    assert loop.tools.counters["calls"] == 2 and loop.tools.counters["parse"] == 1


async def test_budgets_end_the_episode_with_their_reason_on_the_real_engine(tiny_engine):
    tok = tiny_engine.tokenizer
    env = NeverDone()
    ids = env.format_prompt(tok, PROMPT)
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=1)
    loop = EpisodeLoop(tiny_engine, tok, AgentSection(max_turns=3, max_total_tokens=10_000))
    out = await loop.run(env, PROMPT, ids, params)
    assert out.finish_reason == "turn_limit" and out.error is None
    assert [t.role for t in out.turns] == ["assistant", "tool"] * 2 + ["assistant"]
    assert [t.reward for t in out.turns if t.role == "assistant"] == [0.1, 0.1, 0.1]
    assert all(0 < len(t.token_ids) <= 6 for t in out.turns if t.role == "assistant")

    loop = EpisodeLoop(tiny_engine, tok, AgentSection(max_turns=50, max_total_tokens=40))
    out = await loop.run(env, PROMPT, ids, params)
    assert out.finish_reason == "token_budget" and sum(len(t.token_ids) for t in out.turns) <= 40

    class Slow(NeverDone):
        async def step(self, state, action):
            await asyncio.sleep(0.4)
            return await super().step(state, action)

    loop = EpisodeLoop(tiny_engine, tok, AgentSection(max_turns=50, max_total_tokens=100_000, wall_time_s=1.0))
    t0 = time.monotonic()
    out = await loop.run(Slow(), PROMPT, ids, params)
    assert out.finish_reason == "wall_time" and time.monotonic() - t0 < 3.0
    assert loop.counters["wall_time"] == 1
