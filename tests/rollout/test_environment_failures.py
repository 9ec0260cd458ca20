"""Bad input never crashes or stalls the rollout: tools that raise, hang, return non-JSON or 100 MB; environments
whose ``step`` raises, hangs or returns garbage; 2,000 tokens of broken tool-call JSON.

Every case runs concurrently with a healthy episode on the same loop, which must finish on time. The
assistant turns are replayed token ids (``env_harness.ReplayEngine``, an engine stand-in: the tiny model does
not write tool calls); the tools, the worker processes, the threads, the timeouts and the parser are real.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from env_harness import PROMPT, BadStep, CalculatorEnv, ReplayEngine, call, tools_tokenizer

from services.lib.engine.base import SamplingParams
from services.rollout.config import AgentSection
from services.rollout.episode import EpisodeLoop
from services.rollout.tool_runner import CallFailed, ToolRunner
from tests.conftest import wait_for_async

TOK = tools_tokenizer()
PARAMS = SamplingParams(max_new_tokens=4000)


def loop_for(texts: list[str], **cfg) -> EpisodeLoop:
    return EpisodeLoop(ReplayEngine.of_texts(TOK, texts), TOK,
                       AgentSection(tool_timeout_s=3.0, env_timeout_s=3.0, max_observation_chars=1000,
                                    max_total_tokens=20_000, **cfg))


async def test_failing_tools_are_error_observations_and_nothing_waits_on_them():
    env = CalculatorEnv()
    ids = env.format_prompt(TOK, PROMPT)
    cases = {"boom": "ZeroDivisionError: the tool divided by zero", "hang": "did not return within 3 s",
             "hang_async": "did not return within 3 s", "opaque": "not JSON-serialisable",
             "huge": "99999000 more characters cut", "nope": "unknown tool 'nope'"}
    loops = {name: loop_for([call(name, x=1), "Done, 5"]) for name in cases}
    loops["bad_args"] = loop_for([call("add", a="two"), "Done, 5"])
    cases["bad_args"] = "argument 'a': expected an integer"
    healthy = loop_for([call("add", a=2, b=3), "Done, 5"])
    t0 = time.monotonic()
    outs = await asyncio.gather(*(lp.run(env, PROMPT, ids, PARAMS) for lp in [*loops.values(), healthy]))
    assert time.monotonic() - t0 < 20.0  # the hangs (30 s) cost their timeout (3 s), once, concurrently
    for (name, expected), out in zip(cases.items(), outs, strict=False):
        assert out.error is None and out.finish_reason == "eos", name
        assert [t.role for t in out.turns] == ["assistant", "tool", "assistant"], name
        assert expected in out.turns[1].text, (name, out.turns[1].text)
        assert ("error" in out.turns[1].text) == (name != "huge"), name  # a cut result is no error
        assert len(out.turns[1].text) < 1500, name  # bounded observations (the 100 MB cut to 1,000 characters)
    assert outs[-1].turns[1].text.count("5") >= 1 and outs[-1].turns[0].reward == 0.25
    counters = {k: sum(lp.tools.counters[k] for lp in loops.values()) for k in ("timeout", "exception", "not_json",
                                                                                  "bad_call", "cut", "parse")}
    # an unknown name is the parser's error (it knows the tools), wrong arguments the runner's check
    assert counters == {"timeout": 2, "exception": 1, "not_json": 1, "bad_call": 1, "cut": 1, "parse": 1}
    # the hung sync tool's worker process was killed at the timeout (nothing left running), no thread abandoned
    assert loops["hang"].tools.counters["killed"] == 1 and loops["hang"].tools.hung == 0
    await asyncio.gather(*(lp.close() for lp in [*loops.values(), healthy]))


async def test_broken_environments_end_only_their_own_episode():
    ids = list(TOK.encode(PROMPT.text, add_special_tokens=False))
    hows = {"raises": "RuntimeError: the environment broke", "hangs": "did not return within 3 s",
            "garbage": "returned a str, not a Step", "nan": "not a finite number",
            "bad_observations": "not a list of messages"}
    loop = loop_for(["Hello", "Again"])
    t0 = time.monotonic()
    outs = await asyncio.gather(*(loop.run(BadStep(how), PROMPT, ids, PARAMS) for how in [*hows, "fine"]))
    assert time.monotonic() - t0 < 20.0  # the hang (30 s) costs its timeout (3 s), not its sleep
    for (how, expected), out in zip(hows.items(), outs, strict=False):
        assert out.finish_reason == "error" and expected in out.error and out.error.startswith("environment: step")
        assert [t.role for t in out.turns] == ["assistant"], how
    assert outs[-1].finish_reason == "eos" and outs[-1].error is None
    assert loop.counters["env_errors"] == len(hows)


async def test_two_thousand_tokens_of_broken_tool_call_json_is_one_error_observation():
    broken = "<tool_call>" + '{"name": "add", "arguments": {"a": [' + "[1, {\"b\": " * 200 + "</tool_call>"
    assert len(TOK.encode(broken, add_special_tokens=False)) >= 2000
    loop = loop_for([broken, "Sorry, 5"])
    env = CalculatorEnv()
    t0 = time.monotonic()
    out = await loop.run(env, PROMPT, env.format_prompt(TOK, PROMPT), PARAMS)
    assert time.monotonic() - t0 < 10.0  # no parse that grows with the nesting
    assert [t.role for t in out.turns] == ["assistant", "tool", "assistant"] and out.error is None
    assert "invalid JSON" in out.turns[1].text and len(out.turns[1].text) < 600
    assert loop.tools.counters["parse"] == 1 and loop.tools.counters["calls"] == 0
    # cut inside a call (the turn's token limit): an error observation too
    loop = loop_for([call("add", a=1, b=2)[:-8], "Sorry, 5"])
    out = await loop.run(env, PROMPT, env.format_prompt(TOK, PROMPT), PARAMS)
    assert "cut off" in out.turns[1].text and out.finish_reason == "eos"


async def test_an_abandoned_sync_call_is_counted_until_its_thread_returns_and_the_loop_keeps_running():
    runner = ToolRunner(timeout_s=0.2, max_chars=100, max_hung=1)
    ticks = 0

    async def heartbeat() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    beat = asyncio.create_task(heartbeat())
    with pytest.raises(CallFailed, match="did not return within 0.2 s") as failed:
        await runner.call(time.sleep, 0.8)
    assert failed.value.kind == "timeout" and runner.hung == 1
    with pytest.raises(CallFailed, match="still hang") as refused:  # past max_hung: no further threads
        await runner.call(time.sleep, 0.0)
    assert refused.value.kind == "hung"
    await wait_for_async(lambda: runner.hung == 0, 5.0, "the abandoned thread to return")
    assert await runner.call(len, "abc") == 3
    beat.cancel()
    assert ticks > 5  # the event loop ran all along (about 100 ticks on an idle machine)
