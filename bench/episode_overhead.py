"""The episode loop's own cost per turn, beyond generation and tool time (``services/rollout/episode.py``).

**An engine stand-in, on purpose.** The bench isolates what :class:`EpisodeLoop` itself adds to a turn, so
the engine is a stand-in whose ``generate`` costs a fixed, known time (``await asyncio.sleep(--gen-s)``) and
returns the same token ids every turn: a hermes tool call ``<tool_call>{"name": ..., "arguments":
{"seconds": --tool-s}}</tool_call>`` closed by EOS. Everything else is real: the loop, the hermes parser, the
tool runner, the environment's ``reset``/``step`` (:class:`FunctionEnvironment`'s, sync, so each runs in a
thread of its own, as any sync hook does), and the observation rendered through a ChatML chat template that
renders tools (the tokenizer of ``tests/rollout/env_harness.py``, built here the same way).

**Tool kinds** (each tool waits ``--tool-s``):

* ``async``: an ``async def`` tool, awaited on the event loop;
* ``worker``: a sync module-level tool (``bench/_episode_tools.py``), run in a tool worker process
  (``agent.tool_workers``; ``--tool-workers`` workers, by default one per episode, so that no call waits for a
  free worker: the bench measures the dispatch, not the pool's capacity);
* ``thread``: a sync tool no worker can import (a closure), run in a thread of its own;
* ``none``: no tools; every turn answered by one user message (the loop without parsing or dispatch);
* ``bare``: the reference, no loop at all: the same sleeps in a plain coroutine (what asyncio's timers and
  scheduling cost at this concurrency; a loop's figure minus this one is the loop's alone).

``--episodes`` episodes of ``--turns`` turns run concurrently per kind, one kind at a time, each kind once
untimed first (worker start, template compilation) and then ``--rounds`` times (the kinds' order reversed
every other round; the machine is shared). Episode ``i`` starts ``i / episodes`` of one turn's waits after
the first (untimed), as episodes of a real run are spread out; ``--no-stagger`` starts them at once, so that
every turn's loop work queues behind the other episodes' (the worst case: a turn then waits about half of
``episodes x cpu_ms_per_turn``). **Per turn** (from the episode's start, or the turn's generate
call, to the next generate call, or the episode's end), ``overhead = wall - gen_s - tool_s`` (no ``tool_s``
on the last turn, whose calls are not run, nor for ``none`` / ``bare`` without tools): parsing, tool
dispatch, ``step``, rendering the observation, bookkeeping, and waiting for the event loop that the other
episodes keep busy. Figures per kind: ``overhead_ms_p50`` / ``_p99`` / ``_mean``, ``over_bare_ms_mean``
(the mean minus ``bare``'s), ``cpu_ms_per_turn`` (the process's CPU time over the timed rounds per turn;
the worker processes' own CPU is not in it).

**Single turn**: the issue requires the single-turn path to cost nothing extra. ``--episodes`` concurrent
callers each make ``--turns`` calls in turn, per round once as a bare ``engine.generate`` and once as
``EpisodeLoop.run`` of a :class:`SingleTurn` environment (order alternating); figures: wall time per call
(``bare_ms_mean``, ``loop_ms_mean``, ``ratio_loop_over_bare``), the loop's extra microseconds per call
(``overhead_us_mean``, which noise can make negative) and the process's CPU time per call (``cpu_us_bare``,
``cpu_us_loop``, ``cpu_ratio_loop_over_bare``).

    .venv/bin/python bench/episode_overhead.py [--episodes 64] [--turns 8] [--gen-s 0.05] [--tool-s 0.01]

Progress goes to stderr; stdout is a table, then one JSON line of every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from itertools import pairwise
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import PreTrainedTokenizerFast  # noqa: E402

from bench._episode_tools import wait_async, wait_worker  # noqa: E402
from services.lib.engine.base import GenerationResult, SamplingParams  # noqa: E402
from services.rollout.config import AgentSection, ToolWorkersSection  # noqa: E402
from services.rollout.episode import EpisodeLoop  # noqa: E402
from services.tasks.base import Prompt  # noqa: E402
from services.tasks.env import Action, FunctionEnvironment, SingleTurn, Step  # noqa: E402
from tests.agentic.agentic_harness import CHATML_TOOLS, ScriptedEngine, chat_tokenizer  # noqa: E402

#: in the order they run (reversed every other round)
KINDS = ("bare", "none", "async", "worker", "thread")
TOOL_KINDS = ("async", "worker", "thread")
PROMPT = Prompt(id="bench/0", text="Wait a little.", messages=[{"role": "user", "content": "Wait a little."}])
#: the generate calls of the episode running in this task (set per episode task; the stand-in appends)
_generate_calls: contextvars.ContextVar[list[float]] = contextvars.ContextVar("generate_calls")


class BenchError(RuntimeError):
    """An episode did not run as the bench expects (its turns, its calls): the figures would mean nothing."""


def tools_tokenizer() -> PreTrainedTokenizerFast:
    """The environment tests' tokenizer: character-level, ChatML, a template that renders tools."""
    return chat_tokenizer(CHATML_TOOLS)


# --- the engine stand-in and the environments ------------------------------------------------------------


class SleepEngine(ScriptedEngine):
    """Engine stand-in (see the module docstring): every ``generate`` waits ``gen_s`` and returns ``text``'s
    token ids closed by EOS; it notes when each call began in the calling episode's list (the tests'
    :class:`ScriptedEngine` for start, stop, version and stats)."""

    def __init__(self, tokenizer: Any, text: str, gen_s: float) -> None:
        super().__init__(tokenizer, [])
        self.ids = [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]
        self.text = tokenizer.decode(self.ids, skip_special_tokens=True)
        self.gen_s = gen_s

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        calls = _generate_calls.get(None)
        if calls is not None:
            calls.append(time.perf_counter())
        await asyncio.sleep(self.gen_s)
        n = len(self.ids)
        return GenerationResult(token_ids=list(self.ids), logprobs=[-0.1] * n, versions=[0] * n,
                                finish_reason="eos", text=self.text)


def thread_tool() -> Callable[[float], str]:
    """A sync tool no worker can import (a closure): the tool runner runs it in a thread."""

    def wait_thread(seconds: float) -> str:
        """Wait in a thread (a sync tool that is not importable).

        Args:
            seconds: how long.
        """
        time.sleep(seconds)
        return "done"

    return wait_thread


class ToolEnv(FunctionEnvironment):
    """One tool; the default ``step``: never done while the turn makes a call."""

    def __init__(self, tool: Callable[..., Any]) -> None:
        self.tools = (tool,)


class ChatEnv(FunctionEnvironment):
    """No tools; every turn answered by one user message, never done."""

    def step(self, state: Any, action: Action) -> Step:
        return Step(observations=[{"role": "user", "content": "go on"}], state=state)


def kind_setup(kind: str, tok: Any, args: argparse.Namespace) -> tuple[Any, SleepEngine]:
    """The environment and engine of a kind (not ``bare``)."""
    if kind == "none":
        return ChatEnv(), SleepEngine(tok, "Still waiting.", args.gen_s)
    tool = {"async": wait_async, "worker": wait_worker, "thread": thread_tool()}[kind]
    call = json.dumps({"name": tool.__name__, "arguments": {"seconds": args.tool_s}})
    return ToolEnv(tool), SleepEngine(tok, f"I will wait.<tool_call>{call}</tool_call>", args.gen_s)


# --- timing ------------------------------------------------------------------------------------------------


def turn_overheads(t0: float, calls: list[float], t1: float, gen_s: float, tool_s: float) -> list[float]:
    """Per turn, its wall time minus ``gen_s`` and ``tool_s`` (none on the last turn, whose calls are not run);
    turn k runs from generate call k (the episode's start for k = 0) to call k + 1 (the episode's end)."""
    bounds = [t0, *calls[1:], t1]
    last = len(calls) - 1
    return [(b - a) - gen_s - (tool_s if k < last else 0.0) for k, (a, b) in enumerate(pairwise(bounds))]


def stagger_s(i: int, args: argparse.Namespace) -> float:
    """When episode ``i`` starts (untimed): spread over one turn's waits, so that the episodes' turns do not run
    in lockstep (``--no-stagger``: all at once, every turn's loop work queued behind the others')."""
    return i * (args.gen_s + args.tool_s) / args.episodes if args.stagger else 0.0


async def bare_episode(i: int, args: argparse.Namespace) -> list[float]:
    """The reference: the same waits, no loop."""
    await asyncio.sleep(stagger_s(i, args))
    calls: list[float] = []
    t0 = time.perf_counter()
    for k in range(args.turns):
        calls.append(time.perf_counter())
        await asyncio.sleep(args.gen_s)
        if k < args.turns - 1:
            await asyncio.sleep(args.tool_s)
    return turn_overheads(t0, calls, time.perf_counter(), args.gen_s, args.tool_s)


async def loop_episode(i: int, kind: str, loop: EpisodeLoop, env: Any, prompt_ids: list[int],
                       args: argparse.Namespace) -> list[float]:
    """Episode ``i`` through the loop; its per-turn overheads (checked: every turn ran, every call ran)."""
    await asyncio.sleep(stagger_s(i, args))
    calls: list[float] = []
    _generate_calls.set(calls)  # this episode's task's own context
    t0 = time.perf_counter()
    out = await loop.run(env, PROMPT, prompt_ids, SamplingParams(max_new_tokens=200))
    t1 = time.perf_counter()
    want_calls = args.turns - 1 if kind in TOOL_KINDS else 0
    if out.finish_reason != "turn_limit" or len(calls) != args.turns or out.tool_calls != want_calls:
        raise BenchError(f"{kind}: an episode ended {out.finish_reason!r} ({out.error}) after {len(calls)} "
                         f"generations and {out.tool_calls} tool calls; expected turn_limit, {args.turns}, "
                         f"{want_calls}")
    return turn_overheads(t0, calls, t1, args.gen_s, args.tool_s if kind in TOOL_KINDS else 0.0)


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile ``q`` (0-100) of ``xs``."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))]


async def episodes(tok: Any, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Every kind: one untimed round, then ``--rounds`` timed; per-turn figures per kind."""
    agent = AgentSection(tool_parser="hermes", max_turns=args.turns, max_total_tokens=1_000_000,
                         tool_workers=ToolWorkersSection(workers=args.tool_workers))
    setups: dict[str, tuple[EpisodeLoop, Any, list[int]]] = {}
    for kind in KINDS[1:]:
        env, engine = kind_setup(kind, tok, args)
        setups[kind] = (EpisodeLoop(engine, tok, agent), env, env.format_prompt(tok, PROMPT))
    samples: dict[str, list[float]] = {k: [] for k in KINDS}
    cpu: dict[str, float] = dict.fromkeys(KINDS, 0.0)

    async def one_round(kind: str) -> list[float]:
        if kind == "bare":
            runs = [bare_episode(i, args) for i in range(args.episodes)]
        else:
            loop, env, ids = setups[kind]
            runs = [loop_episode(i, kind, loop, env, ids, args) for i in range(args.episodes)]
        return [x for turns in await asyncio.gather(*runs) for x in turns]

    try:
        for kind in KINDS:
            await one_round(kind)  # untimed: workers start, templates compile
        for r in range(args.rounds):
            for kind in KINDS if r % 2 == 0 else KINDS[::-1]:
                c0 = time.process_time()
                samples[kind] += await one_round(kind)
                cpu[kind] += time.process_time() - c0
                print(f"round {r}: {kind}: overhead mean {1e3 * statistics.fmean(samples[kind]):.3f} ms/turn",
                      file=sys.stderr, flush=True)
        where = {k: setups[k][0].tools.metrics() for k in TOOL_KINDS}
        if where["worker"]["in_thread"] or not where["worker"].get("workers") or not where["thread"]["in_thread"]:
            raise BenchError(f"the sync tools did not run where their kind says (worker, thread): {where}")
    finally:
        for loop, _, _ in setups.values():
            await loop.close()
    bare_mean = statistics.fmean(samples["bare"])
    figures: dict[str, dict[str, float]] = {}
    for kind, xs in samples.items():
        mean = statistics.fmean(xs)
        figures[kind] = {"turns": len(xs), "overhead_ms_p50": round(1e3 * percentile(xs, 50), 4),
                         "overhead_ms_p99": round(1e3 * percentile(xs, 99), 4),
                         "overhead_ms_mean": round(1e3 * mean, 4),
                         "over_bare_ms_mean": round(1e3 * (mean - bare_mean), 4),
                         "cpu_ms_per_turn": round(1e3 * cpu[kind] / len(xs), 4)}
    return figures


async def single_turn(tok: Any, args: argparse.Namespace) -> dict[str, float]:
    """A bare ``engine.generate`` against ``EpisodeLoop.run`` of a single-turn environment, per call."""
    engine = SleepEngine(tok, "47", args.gen_s)
    loop = EpisodeLoop(engine, tok, AgentSection())
    env = SingleTurn()
    ids = list(tok.encode("12+35=", add_special_tokens=False))
    params = SamplingParams(max_new_tokens=8)

    async def caller(path: str) -> list[float]:
        walls = []
        for _ in range(args.turns):
            t0 = time.perf_counter()
            if path == "bare":
                await engine.generate(ids, params)
            else:
                await loop.run(env, PROMPT, ids, params)
            walls.append(time.perf_counter() - t0)
        return walls

    walls: dict[str, list[float]] = {"bare": [], "loop": []}
    cpu = {"bare": 0.0, "loop": 0.0}
    for r in range(args.rounds + 1):  # round 0 untimed
        for path in ("bare", "loop") if r % 2 == 0 else ("loop", "bare"):
            c0 = time.process_time()
            got = [w for ws in await asyncio.gather(*(caller(path) for _ in range(args.episodes))) for w in ws]
            if r:
                walls[path] += got
                cpu[path] += time.process_time() - c0
    await loop.close()
    bare, looped = statistics.fmean(walls["bare"]), statistics.fmean(walls["loop"])
    n = len(walls["bare"])
    return {"calls": n, "bare_ms_mean": round(1e3 * bare, 4), "loop_ms_mean": round(1e3 * looped, 4),
            "ratio_loop_over_bare": round(looped / bare, 4), "overhead_us_mean": round(1e6 * (looped - bare), 2),
            "cpu_us_bare": round(1e6 * cpu["bare"] / n, 2), "cpu_us_loop": round(1e6 * cpu["loop"] / n, 2),
            "cpu_ratio_loop_over_bare": round(cpu["loop"] / cpu["bare"], 4)}


async def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("--episodes", type=int, default=64, help="concurrent episodes")
    ap.add_argument("--turns", type=int, default=8, help="assistant turns per episode (>= 2)")
    ap.add_argument("--gen-s", type=float, default=0.05, help="seconds one generate call takes")
    ap.add_argument("--tool-s", type=float, default=0.01, help="seconds one tool call takes")
    ap.add_argument("--rounds", type=int, default=2, help="timed rounds per kind (after one untimed)")
    ap.add_argument("--no-stagger", dest="stagger", action="store_false",
                    help="start every episode at once (their turns in lockstep)")
    ap.add_argument("--tool-workers", type=int, default=0, help="tool worker processes (0: one per episode)")
    args = ap.parse_args(argv)
    if args.turns < 2 or args.episodes < 1 or args.rounds < 1:
        ap.error("--turns must be at least 2, --episodes and --rounds at least 1")
    args.tool_workers = args.tool_workers or args.episodes
    tok = tools_tokenizer()
    out: dict[str, Any] = {"episodes": args.episodes, "turns": args.turns, "gen_s": args.gen_s,
                           "tool_s": args.tool_s, "rounds": args.rounds, "tool_workers": args.tool_workers,
                           "stagger": args.stagger, "parser": "hermes", "cpus": os.cpu_count()}
    out["kinds"] = await episodes(tok, args)
    out["single_turn"] = await single_turn(tok, args)
    out["loadavg_1m"] = round(os.getloadavg()[0], 2)
    return out


def table(figures: dict[str, Any]) -> str:
    """The figures as a human-readable table."""
    cols = ("overhead_ms_p50", "overhead_ms_p99", "overhead_ms_mean", "over_bare_ms_mean", "cpu_ms_per_turn")
    lines = [f"{figures['episodes']} episodes x {figures['turns']} turns, gen {figures['gen_s']} s, "
             f"tool {figures['tool_s']} s, {figures['rounds']} rounds; per turn, ms:",
             f"{'kind':>8} " + " ".join(f"{c.removesuffix('_per_turn').removeprefix('overhead_ms_'):>10}"
                                         for c in cols)]
    for kind, f in figures["kinds"].items():
        lines.append(f"{kind:>8} " + " ".join(f"{f[c]:>10.3f}" for c in cols))
    st = figures["single_turn"]
    lines.append(f"single turn: bare generate {st['bare_ms_mean']:.3f} ms, through the loop {st['loop_ms_mean']:.3f} "
                 f"ms (x{st['ratio_loop_over_bare']:.4f}, {st['overhead_us_mean']:+.1f} us); CPU per call "
                 f"{st['cpu_us_bare']:.1f} / {st['cpu_us_loop']:.1f} us (x{st['cpu_ratio_loop_over_bare']:.3f})")
    return "\n".join(lines)


if __name__ == "__main__":
    result = asyncio.run(main())
    print(table(result))
    print(json.dumps(result))
