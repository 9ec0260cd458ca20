"""Sync function tools run in worker processes (``services/rollout/tool_runner.py``): a spinning tool's worker is
killed at the timeout and replaced, concurrent episodes' calls run in parallel workers, and a tool a worker
cannot import runs in a thread as before. The tools are real functions of ``tools_for_workers.py``, the
workers real processes, which import that module (it is on ``sys.path``, which the workers inherit).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

from env_harness import PROMPT, CalculatorEnv, ReplayEngine, call, tools_tokenizer
from tools_for_workers import add, die, spin, stamp, whoami

from services.lib.engine.base import SamplingParams
from services.lib.user_code import importable
from services.rollout.config import AgentSection, ToolWorkersSection
from services.rollout.episode import EpisodeLoop
from services.rollout.tool_runner import ToolRunner
from services.tasks.env import ToolResult
from services.tasks.function_tools import tools_by_name
from services.tasks.toolcalls import get_parser

HERMES = get_parser("hermes")


def runner(timeout_s: float, **bounds: Any) -> ToolRunner:
    return ToolRunner(timeout_s, 1000, workers=ToolWorkersSection(**bounds))


async def run(r: ToolRunner, tools: list[Any], *calls: tuple[str, dict[str, Any]]) -> list[ToolResult]:
    """One assistant message's calls through the runner."""
    specs = tools_by_name(tools)
    text = "".join(call(name, **args) for name, args in calls)
    return await r.run_calls(specs, HERMES.parse(text, list(specs)))


def exists(pid: int) -> bool:
    """Whether process ``pid`` exists (a zombie, killed but not reaped, counts: it still has an entry)."""
    return Path(f"/proc/{pid}").exists()


async def test_a_spinning_tool_is_killed_at_its_timeout_and_the_next_call_gets_a_fresh_worker():
    r = runner(1.0, workers=1)
    ticks = 0

    async def heartbeat() -> None:  # the event loop must keep running while the tool spins
        nonlocal ticks
        while True:
            await asyncio.sleep(0.02)
            ticks += 1

    beat = asyncio.create_task(heartbeat(), name="heartbeat")
    try:
        (first,) = await run(r, [whoami, spin], ("whoami", {"x": 0}))  # starts the worker
        pid = json.loads(first.content)["pid"]
        assert pid != os.getpid() and exists(pid)
        ticks_before = ticks
        (spun,) = await run(r, [whoami, spin], ("spin", {"x": 0}))
        assert spun.error == "timeout"
        assert spun.content == "error: tool 'spin': spin did not return within 1 s (its worker process was killed)"
        assert ticks - ticks_before >= 3  # the event loop ran all along (about 50 ticks on an idle machine)
        # killed and reaped: nothing keeps spinning on a core
        assert not exists(pid)
        assert r.counters["killed"] == 1 and r.counters["timeout"] == 1 and r.hung == 0
        (again,) = await run(r, [whoami, spin], ("whoami", {"x": 0}))
        fresh = json.loads(again.content)["pid"]
        assert fresh not in (pid, os.getpid()) and exists(fresh)
        assert r.pool is not None and r.pool.restarts == 1
    finally:
        beat.cancel()
        await r.close()
    assert not exists(fresh)  # closed with the runner


async def test_a_tool_that_kills_its_worker_is_an_error_observation_and_the_worker_is_replaced():
    r = runner(5.0, workers=1)
    try:
        (died,) = await run(r, [die, add], ("die", {"x": 1}))
        assert died.error == "exception" and "die killed its worker process" in died.content
        (ok,) = await run(r, [die, add], ("add", {"a": 2, "b": 3}))
        assert ok.error is None and ok.content == "5"
    finally:
        await r.close()


async def test_concurrent_episodes_call_their_tools_in_parallel_workers():
    class StampEnv(CalculatorEnv):
        tools = (stamp, whoami)

    tok = tools_tokenizer()
    env = StampEnv()
    loop = EpisodeLoop(ReplayEngine.of_texts(tok, [call("stamp", seconds=1.0), "Done"]), tok,
                       AgentSection(tool_timeout_s=10.0, max_total_tokens=20_000,
                                    tool_workers=ToolWorkersSection(workers=2)))
    try:
        # both workers started and the tools' module imported, so the calls below start together
        warm = await run(loop.tools, [stamp, whoami], ("whoami", {"x": 0}), ("whoami", {"x": 1}))
        assert len({json.loads(w.content)["pid"] for w in warm}) == 2
        ids = env.format_prompt(tok, PROMPT)
        outs = await asyncio.gather(*(loop.run(env, PROMPT, ids, SamplingParams(max_new_tokens=400))
                                      for _ in range(2)))
    finally:
        await loop.close()
    stamps = []
    for out in outs:
        assert out.error is None and [t.role for t in out.turns] == ["assistant", "tool", "assistant"]
        stamps.append(json.loads(re.search(r"\{.*\}", out.turns[1].text).group(0)))
    a, b = stamps
    assert a["pid"] != b["pid"] and os.getpid() not in (a["pid"], b["pid"])
    # the two calls overlapped in time: each started before the other ended
    assert a["start"] < b["end"] and b["start"] < a["end"], stamps


async def test_with_every_worker_stuck_a_call_fails_at_its_timeout_instead_of_queueing():
    r = runner(1.0, workers=1, max_workers=1)
    try:
        spun, waited = await run(r, [spin, whoami], ("spin", {"x": 0}), ("whoami", {"x": 0}))
    finally:
        await r.close()
    assert spun.error == "timeout" and "its worker process was killed" in spun.content
    assert waited.error == "timeout" and "no tool worker was free within 1 s" in waited.content


def _closure() -> Any:
    def where(x: int) -> dict[str, Any]:
        """The process and thread the call ran in."""
        return {"pid": os.getpid(), "thread": threading.current_thread().name}

    return where


_EXECD: dict[str, Any] = {"__name__": "tools_by_exec"}
exec("import os, threading\n"
     "def where_execd(x: int) -> dict:\n"
     "    '''The process and thread the call ran in.'''\n"
     "    return {'pid': os.getpid(), 'thread': threading.current_thread().name}\n", _EXECD)


async def test_a_tool_a_worker_cannot_import_runs_in_a_thread_said_once_per_tool(caplog):
    closure, execd = _closure(), _EXECD["where_execd"]
    r = runner(5.0, workers=1)
    caplog.set_level(logging.WARNING, logger="rlbus.rollout.tools")
    try:
        for _ in range(2):
            results = await run(r, [closure, execd], ("where", {"x": 0}), ("where_execd", {"x": 0}))
            for res in results:
                ran = json.loads(res.content)
                assert ran["pid"] == os.getpid() and ran["thread"].startswith("rlbus-tool-"), res
    finally:
        await r.close()
    assert r.counters["in_thread"] == 4 and r.pool is not None and r.pool.calls == 0
    said = [rec.getMessage() for rec in caplog.records if "runs in a thread" in rec.getMessage()]
    assert len(said) == 2 and "where" in said[0] and "where_execd" in said[1]


def test_importable_names_module_level_functions_only():
    assert importable(add) == ("tools_for_workers", "add")
    assert importable(json.dumps) == ("json", "dumps")
    assert importable(time.sleep) == ("time", "sleep")
    assert importable(ToolRunner.metrics) == ("services.rollout.tool_runner", "ToolRunner.metrics")
    bound = ToolRunner(1.0, 10).metrics  # a method of an object: its state does not travel
    for fn in (lambda x: x, _closure(), _EXECD["where_execd"], bound):
        assert importable(fn) is None, fn
