"""The OpenAI-compatible endpoint against native episodes: the same turns, the same engine, side by side.

**What runs.** One process holds what a rollout worker holds: the torch engine (continuous batching) over a
tiny random Llama built here (the shape of the runs' tiny model, ``services/tasks/tiny_model.py``, ~1 M
parameters, ``--hidden``/``--layers`` change it; over the endpoint tests' character-level tokenizer with a
Qwen-style chat template, ``tests/rollout/endpoint_harness.py``) and the endpoint
(``services/rollout/endpoint.py``) on a free port of 127.0.0.1. Per concurrency level (``--sessions``,
default 64 and 256), each session runs ``--turns`` model calls (default 5) two ways:

* **endpoint**: a scripted agent with the real ``openai`` client (``AsyncOpenAI``, its session id as the API
  key): call, append the assistant message it got and a fixed user message, call again. The agents run in a
  child process, as a harness runs outside the rollout worker (in its sandbox): the worker process pays for
  HTTP, JSON, rendering and the session's prefix checks, the child for the client;
* **native**: :class:`~services.rollout.episode.EpisodeLoop` on the same engine with an environment that
  answers every turn with the same fixed user message (the rollout's own multi-turn path).

Both sides send the same prompts with the same sampling (temperature 1, ``--max-tokens`` per call, and a
seed per session, so that the two sides sample the same tokens whenever the engine computes the same
logits); ``same_sequences`` is the share of sessions whose whole token sequence (the endpoint session's one
segment, the episode's prompt + turns) came out identical. Each level runs one untimed round of each side,
then ``--rounds`` timed rounds, the sides' order alternating (the machine is shared).

**Figures** per level and side: per-call latency p50/p99 (endpoint: the client's, HTTP included; native: the
engine's ``generate``, as the episode loop waits for it), generated tokens/s (all calls' tokens over the
round's wall time, summed over rounds; ``rounds_tokens_per_s`` per round), and ``rows_per_step`` (the mean running batch size over the engine's
decode steps: when the endpoint batches concurrent calls as native episodes are, the two are alike).
``worker_cpu_us_per_token`` is the worker process's CPU time (event loop and engine threads) per generated
token, a figure less exposed than wall time to the other loads of a shared machine; the endpoint side's
``client_cpu_ms_per_call`` is the agents' (the child's). ``endpoint_over_native`` is the endpoint's tokens/s
over native's (the goal: >= 0.9 at 64 sessions; ``tokens_per_s_median_of_rounds``: the median of the rounds'
ratios, each round's two sides run back to back), its p50 latency and its worker CPU per token over native's.
``--profile`` runs one more endpoint round per level (untimed: cProfile slows the loop it profiles) with
cProfile on the worker's event loop thread and reports the shares of its busy time by part (HTTP, JSON,
chat template rendering, the session's prefix checks, tokenizer) and its top functions.

    .venv/bin/python bench/endpoint.py [--sessions 64 256] [--turns 5] [--max-tokens 32] [--rounds 2]
    .venv/bin/python bench/endpoint.py --quick      # 4 sessions, 2 turns, a smaller model: seconds

Progress goes to stderr; stdout is a table, then one JSON line of every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import multiprocessing as mp
import os
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: the first message of session i is PROMPT.format(i=i); every later turn is answered by FOLLOW_UP
PROMPT = "Session {i}: tell me a short story about the number {i}."
FOLLOW_UP = "Go on, and keep it short."
MODEL = "tiny"

#: cProfile buckets of the worker's event loop: a function goes to the first whose substring is in its file
PROFILE_PARTS: list[tuple[str, tuple[str, ...]]] = [
    ("prefix checks and sessions", ("rollout/sessions.py", "(message_key)", "(tools_key)", "(_prompt)")),
    ("chat template", ("jinja2", "chat_template", "chat_render.py")),
    ("tokenizer", ("tokenization_utils", "tokenizers")),
    ("json", ("json/",)),
    ("http (aiohttp)", ("aiohttp", "multidict", "yarl")),
    ("endpoint and api shapes", ("rollout/endpoint.py", "openai_api.py")),
    ("engine calls (event loop side)", ("engine/",)),
    ("event loop", ("asyncio/", "selectors", "uvloop")),
]


#: where the event loop thread waits (for sockets, for the child's answer): left out of the shares
IDLE = ("'poll' of 'select.epoll'", "'acquire' of '_thread.lock'", "'release' of '_thread.lock'")


class BenchError(RuntimeError):
    """A side did not run as the bench expects (calls missing, a session split): its figures would mean nothing."""


# --- the client child: scripted OpenAI agents --------------------------------------------------------------


async def _agents(base_url: str, sessions: list[str], turns: int, max_tokens: int) -> dict[str, Any]:
    import httpx
    import openai

    http = openai.DefaultAsyncHttpxClient(limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
                                          timeout=httpx.Timeout(600.0))
    base = openai.AsyncOpenAI(base_url=base_url, api_key="-", http_client=http, max_retries=0)

    async def agent(i: int, sid: str) -> tuple[list[float], int]:
        client = base.with_options(api_key=sid)
        messages: list[dict[str, Any]] = [{"role": "user", "content": PROMPT.format(i=i)}]
        latencies, tokens = [], 0
        for turn in range(turns):
            t0 = time.perf_counter()
            r = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens,  # type: ignore[arg-type]
                                                     temperature=1.0, seed=i)
            latencies.append(time.perf_counter() - t0)
            tokens += r.usage.completion_tokens if r.usage else 0
            messages.append({"role": "assistant", "content": r.choices[0].message.content or ""})
            if turn < turns - 1:
                messages.append({"role": "user", "content": FOLLOW_UP})
        return latencies, tokens

    try:
        t0, c0 = time.perf_counter(), time.process_time()
        done = await asyncio.gather(*(agent(i, sid) for i, sid in enumerate(sessions)))
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        await http.aclose()
    return {"wall_s": wall, "latencies": [x for lat, _ in done for x in lat], "tokens": sum(t for _, t in done),
            "client_cpu_s": cpu}


def client_main(conn: Any) -> None:
    """The child: runs each round of agents it is sent, answers with their figures (or the error)."""
    os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")
    while True:
        try:
            job = conn.recv()
        except EOFError:  # the parent is gone
            return
        if job is None:
            return
        try:
            conn.send(asyncio.run(_agents(**job)))
        except Exception as e:  # the parent raises it with the figures it has
            conn.send({"error": f"{type(e).__name__}: {e}"})


# --- the worker side: engine, endpoint, native episodes ----------------------------------------------------


class StepProbe:
    """Counts the engine's decode steps and their running rows (wraps the running batch's ``step``)."""

    def __init__(self, engine: Any) -> None:
        self.steps = self.rows = 0
        batch = engine._batch  # the bench reads the engine thread's batch size at each step
        inner = batch.step

        def step(version: int) -> Any:
            self.steps += 1
            self.rows += len(batch.rows)
            return inner(version)

        batch.step = step

    def take(self) -> tuple[int, int]:
        out = (self.steps, self.rows)
        self.steps = self.rows = 0
        return out


class TimedEngine:
    """The engine as the episode loop sees it, each ``generate``'s wall time noted."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.latencies: list[float] = []

    async def generate(self, prompt_ids: list[int], params: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return await self.engine.generate(prompt_ids, params)
        finally:
            self.latencies.append(time.perf_counter() - t0)


def chat_env() -> Any:
    from services.tasks.env import Action, FunctionEnvironment, Start, Step, encode_chat_with_tools

    class ChatEnv(FunctionEnvironment):
        """No tools; every turn answered by FOLLOW_UP, never done (async hooks: run on the loop)."""

        def format_prompt(self, tokenizer: Any, prompt: Any) -> list[int]:
            return encode_chat_with_tools(tokenizer, list(prompt.messages), ())

        async def reset(self, prompt: Any) -> Start:
            return Start(messages=list(prompt.messages))

        async def step(self, state: Any, action: Action) -> Step:
            return Step(observations=[{"role": "user", "content": FOLLOW_UP}], state=state)

    return ChatEnv()


def build(args: argparse.Namespace) -> tuple[Any, Any]:
    """The tokenizer and the tiny random model (``--hidden``, ``--layers``: by default the shape of the runs'
    tiny model, ~1 M parameters; 4 heads, context 1024)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.rollout.endpoint_harness import CONTEXT, tokenizer

    tok = tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(  # the shape of services/tasks/tiny_model.py, a context of 1024
        vocab_size=len(tok), hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=CONTEXT, pad_token_id=0, eos_token_id=tok.eos_token_id, initializer_range=0.1,
        tie_word_embeddings=False)).eval()
    return tok, model


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile ``q`` (0-100) of ``xs``."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))]


class Bench:
    def __init__(self, args: argparse.Namespace, tok: Any, engine: Any, endpoint: Any, conn: Any) -> None:
        from services.rollout.config import AgentSection
        from services.rollout.episode import EpisodeLoop

        self.args, self.tok, self.engine, self.endpoint, self.conn = args, tok, engine, endpoint, conn
        self.timed = TimedEngine(engine)
        self.loop = EpisodeLoop(self.timed, tok, AgentSection(max_turns=args.turns, max_total_tokens=1_000_000))
        self.env = chat_env()
        self.probe = StepProbe(engine)
        self.profile = cProfile.Profile() if args.profile else None

    async def native(self, n: int) -> tuple[dict[str, Any], list[list[int]]]:
        from services.lib.engine.base import SamplingParams
        from services.tasks.base import Prompt

        self.timed.latencies = []

        async def episode(i: int) -> tuple[list[int], int]:
            text = PROMPT.format(i=i)
            prompt = Prompt(id=f"bench/{i}", text=text, messages=[{"role": "user", "content": text}])
            ids = self.env.format_prompt(self.tok, prompt)
            out = await self.loop.run(self.env, prompt, ids, SamplingParams(max_new_tokens=self.args.max_tokens,
                                                                            temperature=1.0, seed=i))
            gen = [t for turn in out.turns if turn.role == "assistant" for t in turn.token_ids]
            if out.finish_reason != "turn_limit" or len(out.assistant_texts) != self.args.turns:
                raise BenchError(f"native episode {i} ended {out.finish_reason!r} ({out.error}) after "
                                 f"{len(out.assistant_texts)} turns; expected turn_limit after {self.args.turns}")
            return ids + [t for turn in out.turns for t in turn.token_ids], len(gen)

        t0 = time.perf_counter()
        done = await asyncio.gather(*(episode(i) for i in range(n)))
        wall = time.perf_counter() - t0
        return {"wall_s": wall, "latencies": list(self.timed.latencies), "tokens": sum(k for _, k in done)}, \
            [seq for seq, _ in done]

    async def via_endpoint(self, n: int, profile: bool = False) -> tuple[dict[str, Any], list[list[int]]]:
        sessions = [self.endpoint.sessions.open(session_id=f"bench-{n}-{i}-{time.monotonic_ns()}") for i in range(n)]
        job = {"base_url": self.endpoint.base_url, "sessions": [s.id for s in sessions], "turns": self.args.turns,
               "max_tokens": self.args.max_tokens}
        if profile and self.profile is not None:
            self.profile.enable()
        try:
            self.conn.send(job)
            got = await asyncio.to_thread(self.conn.recv)
        finally:
            if profile and self.profile is not None:
                self.profile.disable()
        seqs = []
        for i, s in enumerate(sessions):
            segments = self.endpoint.sessions.close(s.id).close()
            if "error" not in got and (len(segments) != 1 or len(s.calls) != self.args.turns):
                raise BenchError(f"endpoint session {i}: {len(s.calls)} calls in {len(segments)} segments; "
                                 f"expected {self.args.turns} calls continuing one sequence")
            seqs.append(segments[0].token_ids if segments else [])
        if "error" in got:
            raise BenchError(f"the agents failed: {got['error']}")
        return got, seqs

    async def level(self, n: int) -> dict[str, Any]:
        """One concurrency level: an untimed round per side, then ``--rounds`` timed rounds, order alternating."""
        sides = ("native", "endpoint")
        figures: dict[str, dict[str, Any]] = {s: {"wall_s": 0.0, "latencies": [], "tokens": 0, "steps": 0, "rows": 0,
                                                  "cpu_s": 0.0, "client_cpu_s": 0.0, "round_rates": []}
                                              for s in sides}
        same = compared = 0
        for r in range(self.args.rounds + 1):
            seqs: dict[str, list[list[int]]] = {}
            for side in sides if r % 2 == 0 else sides[::-1]:
                self.probe.take()
                c0 = time.process_time()  # the worker process: event loop and engine threads
                if side == "native":
                    got, seqs[side] = await self.native(n)
                else:
                    got, seqs[side] = await self.via_endpoint(n)
                steps, rows = self.probe.take()
                cpu = time.process_time() - c0
                if r == 0:
                    continue  # untimed: templates compile, connections open, the allocator warms
                f = figures[side]
                f["wall_s"] += got["wall_s"]
                f["latencies"] += got["latencies"]
                f["tokens"] += got["tokens"]
                f["steps"] += steps
                f["rows"] += rows
                f["cpu_s"] += cpu
                f["client_cpu_s"] += got.get("client_cpu_s", 0.0)
                f["round_rates"].append(got["tokens"] / got["wall_s"])
                print(f"{n} sessions, round {r}: {side}: {got['tokens'] / got['wall_s']:.0f} tok/s, "
                      f"{rows / max(steps, 1):.1f} rows/step", file=sys.stderr, flush=True)
            if r:
                compared += n
                same += sum(a == b for a, b in zip(seqs["native"], seqs["endpoint"], strict=True))
        if self.profile is not None:  # one more endpoint round, profiled, untimed (cProfile slows the loop)
            await self.via_endpoint(n, profile=True)
        out: dict[str, Any] = {}
        for side, f in figures.items():
            calls = len(f["latencies"])
            if calls != n * self.args.turns * self.args.rounds:
                raise BenchError(f"{side}: {calls} calls timed, expected {n * self.args.turns * self.args.rounds}")
            out[side] = {"calls": calls, "tokens": f["tokens"],
                         "tokens_per_s": round(f["tokens"] / f["wall_s"], 2),
                         "latency_ms_p50": round(1e3 * percentile(f["latencies"], 50), 3),
                         "latency_ms_p99": round(1e3 * percentile(f["latencies"], 99), 3),
                         "latency_ms_mean": round(1e3 * statistics.fmean(f["latencies"]), 3),
                         "rows_per_step": round(f["rows"] / max(f["steps"], 1), 2), "decode_steps": f["steps"],
                         "worker_cpu_ms_per_call": round(1e3 * f["cpu_s"] / calls, 3),
                         "worker_cpu_us_per_token": round(1e6 * f["cpu_s"] / max(f["tokens"], 1), 2),
                         "rounds_tokens_per_s": [round(x, 2) for x in f["round_rates"]]}
            if side == "endpoint":
                out[side]["client_cpu_ms_per_call"] = round(1e3 * f["client_cpu_s"] / calls, 3)
        out["endpoint_over_native"] = {
            "tokens_per_s": round(out["endpoint"]["tokens_per_s"] / out["native"]["tokens_per_s"], 4),
            "latency_p50": round(out["endpoint"]["latency_ms_p50"] / out["native"]["latency_ms_p50"], 4),
            "tokens_per_s_median_of_rounds": round(statistics.median(
                e / n_ for e, n_ in zip(figures["endpoint"]["round_rates"], figures["native"]["round_rates"],
                                        strict=True)), 4),
            "worker_cpu_per_token": round(out["endpoint"]["worker_cpu_us_per_token"]
                                          / out["native"]["worker_cpu_us_per_token"], 4)}
        out["same_sequences"] = round(same / compared, 4)
        return out

    def profile_summary(self, top: int = 12) -> dict[str, Any]:
        if self.profile is None:
            return {}
        stats = pstats.Stats(self.profile)
        own: dict[str, float] = {}
        total = idle = 0.0
        for (file, line, name), (_, _, tottime, _, _) in stats.stats.items():  # type: ignore[attr-defined]
            key = f"{file}:{line}({name})"
            if any(s in key for s in IDLE):
                idle += tottime
                continue
            own[key] = tottime
            total += tottime
        parts: dict[str, float] = {}
        for key, t in own.items():
            part = next((p for p, subs in PROFILE_PARTS if any(s in key for s in subs)), "other")
            parts[part] = parts.get(part, 0.0) + t
        short = {k.split("site-packages/")[-1].split("/work/")[-1]: v for k, v in own.items()}
        return {"busy_s": round(total, 3), "idle_s": round(idle, 3),
                "parts": {p: round(t / total, 3) for p, t in sorted(parts.items(), key=lambda kv: -kv[1])},
                "top": {k: round(v / total, 3) for k, v in sorted(short.items(), key=lambda kv: -kv[1])[:top]}}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from services.lib.engine.config import TorchEngineConfig
    from services.lib.engine.torch_engine import TorchEngine
    from services.rollout.config import EndpointSection
    from services.rollout.endpoint import Endpoint

    tok, model = build(args)
    engine = TorchEngine.from_model(model, tok, TorchEngineConfig(max_batch_size=args.max_batch_size,
                                                                  num_threads=args.threads), seed=0)
    await engine.start()
    endpoint = Endpoint(engine, tok, EndpointSection(enabled=True, max_sessions=max(args.sessions) * 2), MODEL)
    await endpoint.start()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=client_main, args=(child,), name="bench-agents", daemon=True)
    proc.start()
    bench = Bench(args, tok, engine, endpoint, parent)
    out: dict[str, Any] = {"sessions": args.sessions, "turns": args.turns, "max_tokens": args.max_tokens,
                           "rounds": args.rounds, "hidden": args.hidden, "layers": args.layers,
                           "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 3),
                           "max_batch_size": args.max_batch_size, "threads": args.threads, "cpus": os.cpu_count()}
    try:
        out["levels"] = {}
        for n in args.sessions:
            out["levels"][str(n)] = await bench.level(n)
            print(f"{n} sessions: {json.dumps(out['levels'][str(n)])}", file=sys.stderr, flush=True)
        out["endpoint_errors"] = endpoint.counters["errors"]
    finally:
        parent.send(None)
        await asyncio.to_thread(proc.join, 30)
        await bench.loop.close()
        await endpoint.stop()
        await engine.stop()
    if args.profile:
        out["profile"] = bench.profile_summary()
    out["loadavg_1m"] = round(os.getloadavg()[0], 2)
    return out


def table(figures: dict[str, Any]) -> str:
    lines = [f"{figures['turns']} turns x {figures['max_tokens']} max tokens per call, {figures['params_m']} M "
             f"params, {figures['rounds']} rounds",
             f"{'sessions':>8} {'side':>9} {'tok/s':>9} {'p50 ms':>9} {'p99 ms':>9} {'rows/step':>9}"]
    for n, level in figures["levels"].items():
        for side in ("native", "endpoint"):
            f = level[side]
            lines.append(f"{n:>8} {side:>9} {f['tokens_per_s']:>9.0f} {f['latency_ms_p50']:>9.1f} "
                         f"{f['latency_ms_p99']:>9.1f} {f['rows_per_step']:>9.1f}")
        r = level["endpoint_over_native"]
        lines.append(f"{n:>8} endpoint/native: tokens/s x{r['tokens_per_s']:.3f} (median of rounds "
                     f"x{r['tokens_per_s_median_of_rounds']:.3f}), p50 latency x{r['latency_p50']:.3f}, worker CPU "
                     f"per token x{r['worker_cpu_per_token']:.3f}, same sequences {level['same_sequences']:.0%}")
    if figures.get("profile"):
        lines.append("endpoint profile (event loop, busy time): " + ", ".join(
            f"{p} {s:.0%}" for p, s in figures["profile"]["parts"].items()))
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("--sessions", type=int, nargs="+", default=[64, 256], help="concurrent sessions, per level")
    ap.add_argument("--turns", type=int, default=5, help="model calls per session (>= 2)")
    ap.add_argument("--max-tokens", type=int, default=32, help="max_tokens of every call")
    ap.add_argument("--rounds", type=int, default=2, help="timed rounds per side and level (after one untimed)")
    ap.add_argument("--hidden", type=int, default=128, help="the model's hidden size (4 heads)")
    ap.add_argument("--layers", type=int, default=4, help="the model's layers")
    ap.add_argument("--max-batch-size", type=int, default=128, help="the torch engine's max_batch_size")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: best on a shared 2-core machine)")
    ap.add_argument("--profile", action="store_true", help="cProfile the worker's event loop in the endpoint rounds")
    ap.add_argument("--quick", action="store_true", help="4 sessions, 2 turns, 1 round, a smaller model: seconds")
    args = ap.parse_args(argv)
    if args.quick:
        args.sessions, args.turns, args.rounds, args.max_tokens, args.hidden, args.layers = [4], 2, 1, 8, 64, 2
    if args.turns < 2 or args.rounds < 1 or min(args.sessions) < 1 or args.max_tokens < 1:
        ap.error("--turns must be at least 2; --rounds, --sessions and --max-tokens at least 1")
    return args


if __name__ == "__main__":
    result = asyncio.run(run(parse_args()))
    print(table(result))
    print(json.dumps(result))
