"""Where the learner's step should run: a worker thread of the trainer (as now) or its own process.

The trainer runs ``Learner.step`` with ``asyncio.to_thread`` while its event loop consumes trajectories
over NATS. torch releases the GIL inside its kernels, but a step on the default example's ~1 M-parameter
model is largely Python (module calls, autograd bookkeeping), so the step and the loop may compete for
the GIL. Three placements, on the default example's model, config and batch size, are timed side by side:

(a) ``thread-idle``: ``Learner.step`` in a worker thread, the event loop idle (the step's own cost);
(b) ``thread-busy``: the same while the loop does the trainer's per-message work at ``--msgs-per-s``:
    decode an encoded ``ScoredGroup`` (``proto.codec``), open the consumer span the trainer opens per
    message (``services.runtime.tracing``, set up as a service does, writing its trace file to a
    temporary run directory, one group in ten sampled), and publish an ``OutcomeBatch`` to a real
    nats-server JetStream stream with ``services.runtime.bus.publish`` (awaiting its ack);
(c) ``process-busy``: the same Learner in a child process (multiprocessing, 'spawn'; it loads the same
    config and model dir), each step's batch sent msgpack-encoded over a pipe and its metrics sent back,
    then the weights (``learner.state_dict()``, ``torch.save`` bytes), which the service needs every step
    to publish; the parent's loop does the same per-message work as (b).

Config: ``examples/addition.toml`` as the launcher reads it (``RunFile``: its ``[services.trainer]``, with
``devices.num_threads = 1``, its ``[model]`` and ``[task]``); model: ``tiny-addition`` (built and cached
locally); batch: 16 groups x 8 samples of
addition prompts, completions tokenized by the model's tokenizer (right or wrong sums, so each group mixes
rewards 1 and 0) with made-up behaviour logprobs. The default rate, 64 groups/s, is what the example
produces (16 groups per step at ~4 steps/s).

Each placement warms up ``--warmup`` steps on a fresh Learner, then times ``--steps``; ``--rounds``
alternate the order of the placements because the machine is shared. Per placement: ``step_s`` is the
step as the service waits for it (thread hand-off, or the pipe both ways, included), median and mean;
``learner_s`` the learner's own ``time/step_s``; ``weights_s`` getting the weights into the parent (a
thread: ``state_dict()``; the process: serialise, pipe, load); ``msgs_per_s`` the rate the loop achieved
while steps ran (below the target: the loop fell behind) and ``late_ms`` how late messages were handled on
average. Ratios: thread-busy/thread-idle (the loop's cost to the step), process-busy/thread-busy (<1: the
process is faster), the same with the weights included.

    .venv/bin/python bench/learner_placement.py --rounds 2

Progress goes to stderr; the last stdout line is one JSON object of the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import logging
import multiprocessing as mp
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from proto import codec  # noqa: E402
from proto.accounting import OutcomeBatch, TrajectoryOutcome  # noqa: E402
from proto.rollouts import Rollout, Turn  # noqa: E402
from proto.trajectories import ScoredGroup, ScoredTrajectory  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "addition.toml"
SUBJECT = "rlbus.bench.outcomes"
PLACEMENTS = ("thread-idle", "thread-busy", "process-busy")
log = logging.getLogger("rlbus.bench.learner_placement")


def run_file(example: Path = EXAMPLE) -> Any:
    """The example as the launcher reads it (a ``RunFile``, defaults filled in, no ``RLBUS__`` variables)."""
    from bench._rlbus_runs import example_run_file

    return example_run_file(example)


def make_learner(example: Path, model_dir: Path) -> Any:
    """The trainer's Learner on the example's ``[services.trainer]``, training in its ``[model] dtype``."""
    from services.trainer import devices
    from services.trainer.learner import Learner

    runfile = run_file(example)
    cfg = runfile.services.trainer
    return Learner(cfg, model_dir, devices.resolve(cfg, dtype=runfile.model.dtype))


def make_batch(runfile: Any, tokenizer: Any, step: int) -> list[ScoredTrajectory]:
    """Step ``step``'s batch: ``groups_per_step`` prompts of the run file's ``[task]`` x ``group_size``
    tokenized completions (sums, right or wrong: the addition task's answers)."""
    from bench._offline_eval import run_task

    cfg, task_name = runfile.services.trainer, runfile.task.name
    task = run_task(runfile)
    rng = random.Random(step)
    prompts = task.train_prompts(seed=0, start=step * cfg.groups_per_step)
    out = []
    for g in range(cfg.groups_per_step):
        prompt = next(prompts)
        prompt_ids = task.format_prompt(tokenizer, prompt)
        answer = int(prompt.answer or 0)
        for i in range(cfg.group_size):
            right = i % 3 == 0 or rng.random() < 0.3  # every group mixes right (1) and wrong (0) sums
            text = str(answer if right else answer + rng.choice([-11, -10, -1, 1, 10]))
            ids = list(tokenizer.encode(text, add_special_tokens=False))[: cfg.sampling.max_new_tokens - 1]
            ids.append(tokenizer.eos_token_id)
            turn = Turn(role="assistant", token_ids=ids, logprobs=[-rng.uniform(0.01, 2.5) for _ in ids],
                        versions=[step] * len(ids), text=text)
            rollout = Rollout(run_id="bench", task=task_name, group_id=f"s{step}g{g}", prompt_id=prompt.id,
                              sample_index=i, group_size=cfg.group_size, prompt_ids=prompt_ids, turns=[turn],
                              finish_reason="eos", policy_version=step, prompt_text=prompt.text)
            out.append(ScoredTrajectory(run_id="bench", rollout=rollout, reward=1.0 if right else 0.0))
    return out


# --- the child process ------------------------------------------------------------------------------


def child_main(conn: Any, example: str, model_dir: str) -> None:
    """Serve steps: receive an encoded batch, step, send the metrics, then the weights as bytes."""
    import torch

    learner = make_learner(Path(example), Path(model_dir))
    conn.send("ready")
    while (data := conn.recv_bytes()) != b"stop":
        metrics = learner.step(codec.decode(data, list[ScoredTrajectory], max_bytes=None))
        conn.send(metrics)
        buf = io.BytesIO()
        torch.save(learner.state_dict(), buf)
        conn.send_bytes(buf.getbuffer())
    conn.close()


class ChildLearner:
    """The parent's handle on a Learner in a spawned process (the same ``step``/``state_dict`` calls)."""

    def __init__(self, example: Path, model_dir: Path) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=child_main, args=(child, str(example), str(model_dir)), daemon=True)
        self.proc.start()
        child.close()
        if self.conn.recv() != "ready":
            raise RuntimeError("the learner process did not start")

    def step(self, batch: list[ScoredTrajectory]) -> dict[str, float]:
        self.conn.send_bytes(codec.encode(batch))
        metrics: dict[str, float] = self.conn.recv()
        return metrics

    def state_dict(self) -> dict[str, Any]:
        import torch

        return torch.load(io.BytesIO(self.conn.recv_bytes()), weights_only=True)

    def close(self) -> None:
        self.conn.send_bytes(b"stop")
        self.proc.join(timeout=30)


# --- the event loop's per-message work ------------------------------------------------------------


def encoded_groups(batch: list[ScoredTrajectory], group_size: int) -> list[tuple[bytes, dict[str, str]]]:
    """The batch as the ScoredGroup messages a judge publishes, with trace headers (one group in ten sampled)."""
    out = []
    for k in range(0, len(batch), group_size):
        part = batch[k:k + group_size]
        msg = ScoredGroup.of(part)
        flags = "01" if (k // group_size) % 10 == 0 else "00"
        headers = {"traceparent": f"00-{random.getrandbits(128):032x}-{random.getrandbits(64):016x}-{flags}"}
        out.append((codec.encode(msg), headers))
    return out


class Pump:
    """Handles messages at ``rate`` per second on the event loop until stopped; counts and lateness."""

    def __init__(self, js: Any, messages: list[tuple[bytes, dict[str, str]]], rate: float) -> None:
        self.js, self.messages, self.rate = js, messages, rate
        self.done, self.late_s = 0, 0.0
        self.task: asyncio.Task[None] | None = None

    async def handle(self, data: bytes, headers: dict[str, str]) -> None:
        from services.runtime import bus, tracing

        with tracing.span(f"handle {SUBJECT}", kind="consumer", headers=headers):
            group = codec.decode(data, ScoredGroup)
            outcomes = [TrajectoryOutcome(run_id="bench", trajectory_id=t.msg_id, group_id=group.group_id,
                                          outcome="trained", step=1, version=1, sample_version=t.rollout.min_version(),
                                          batch_index=i) for i, t in enumerate(group.records())]
            await bus.publish(self.js, SUBJECT, OutcomeBatch(run_id="bench", outcomes=outcomes))

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time()
        while True:
            due += 1.0 / self.rate
            if (wait := due - loop.time()) > 0:
                await asyncio.sleep(wait)
            self.late_s += max(0.0, loop.time() - due)
            data, headers = self.messages[self.done % len(self.messages)]
            await self.handle(data, headers)
            self.done += 1

    def snapshot(self) -> tuple[int, float, float]:
        return self.done, self.late_s, time.perf_counter()


async def measure(placement: str, learner: Any, batches: list[list[ScoredTrajectory]], warmup: int,
                  pump: Pump | None) -> dict[str, Any]:
    task = asyncio.create_task(pump.run()) if pump else None
    step_s, learner_s, weights_s = [], [], []
    mark = (0, 0.0, 0.0)
    for k, batch in enumerate(batches):
        if k == warmup and pump:
            mark = pump.snapshot()
        t0 = time.perf_counter()
        metrics = await asyncio.to_thread(learner.step, batch)
        t1 = time.perf_counter()
        await asyncio.to_thread(learner.state_dict)
        t2 = time.perf_counter()
        if k >= warmup:
            step_s.append(t1 - t0)
            weights_s.append(t2 - t1)
            learner_s.append(metrics["time/step_s"])
    row: dict[str, Any] = {"placement": placement, "step_s": step_s, "learner_s": learner_s, "weights_s": weights_s}
    if pump and task:
        done, late, t_end = pump.snapshot()
        if task.done():  # the pump failed: its error, not a rate of 0
            task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        n = done - mark[0]
        row["msgs_per_s"] = n / (t_end - mark[2])
        row["late_ms"] = 1000 * (late - mark[1]) / max(n, 1)
    log.info("%-12s step %.4f s (median), weights %.4f s%s", placement, statistics.median(step_s),
             statistics.median(weights_s), f", loop {row['msgs_per_s']:.1f} msg/s" if pump else "")
    return row


async def run_round(order: list[str], args: argparse.Namespace, model_dir: Path, js: Any,
                    batches: list[list[ScoredTrajectory]], messages: list[tuple[bytes, dict[str, str]]]) -> list[dict]:
    rows = []
    for placement in order:
        if placement == "process-busy":
            learner: Any = await asyncio.to_thread(ChildLearner, args.example, model_dir)
        else:
            learner = await asyncio.to_thread(make_learner, args.example, model_dir)
        pump = Pump(js, messages, args.msgs_per_s) if placement.endswith("busy") else None
        try:
            rows.append(await measure(placement, learner, batches, args.warmup, pump))
        finally:
            if isinstance(learner, ChildLearner):
                learner.close()
    return rows


def summarise(rows: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"placements": {}}
    for placement in PLACEMENTS:
        mine = [r for r in rows if r["placement"] == placement]
        steps = [s for r in mine for s in r["step_s"]]
        weights = [s for r in mine for s in r["weights_s"]]
        both = [s + w for r in mine for s, w in zip(r["step_s"], r["weights_s"], strict=True)]
        p: dict[str, Any] = {
            "step_s_median": statistics.median(steps), "step_s_mean": statistics.mean(steps),
            "step_s_stdev": statistics.stdev(steps) if len(steps) > 1 else 0.0,
            "step_s_round_medians": [statistics.median(r["step_s"]) for r in mine],
            "learner_s_median": statistics.median(s for r in mine for s in r["learner_s"]),
            "weights_s_median": statistics.median(weights), "weights_s_mean": statistics.mean(weights),
            "step_with_weights_s_median": statistics.median(both), "steps": len(steps)}
        if "msgs_per_s" in mine[0]:
            p["msgs_per_s"] = statistics.mean(r["msgs_per_s"] for r in mine)
            p["late_ms"] = statistics.mean(r["late_ms"] for r in mine)
        out["placements"][placement] = {k: round(v, 5) if isinstance(v, float) else v for k, v in p.items()}
    pl = out["placements"]
    out["ratios"] = {
        "thread_busy_over_idle": round(pl["thread-busy"]["step_s_median"] / pl["thread-idle"]["step_s_median"], 4),
        "process_over_thread_busy": round(pl["process-busy"]["step_s_median"] / pl["thread-busy"]["step_s_median"], 4),
        "process_over_thread_busy_with_weights": round(pl["process-busy"]["step_with_weights_s_median"]
                                                       / pl["thread-busy"]["step_with_weights_s_median"], 4)}
    out["config"] = {"steps": args.steps, "warmup": args.warmup, "rounds": args.rounds,
                     "msgs_per_s_target": args.msgs_per_s, "example": str(args.example)}
    return out


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    import nats

    from bench._rlbus_runs import example_model_dir
    from services.lib.model_io import load_policy
    from services.runtime import tracing
    from services.runtime.natsd import EmbeddedNats

    runfile = run_file(args.example)
    model_dir = example_model_dir(runfile, seed=0)
    _, tokenizer = load_policy(model_dir, dtype="float32", device="cpu")
    batches = [make_batch(runfile, tokenizer, k) for k in range(args.warmup + args.steps)]
    messages = [m for b in batches for m in encoded_groups(b, runfile.services.trainer.group_size)]
    root = Path(tempfile.mkdtemp(prefix="rlbus-bench-placement-"))
    tracing.setup("trainer", run_dir=root)  # as a service: sampled spans go to the run's trace file
    server = EmbeddedNats(root / "nats", port=None).start()
    nc = await nats.connect(server.url)
    try:
        js = nc.jetstream()
        await js.add_stream(name="BENCH_OUTCOMES", subjects=[SUBJECT], max_msgs=100_000)
        rows: list[dict[str, Any]] = []
        for r in range(args.rounds):
            order = list(PLACEMENTS) if r % 2 == 0 else list(reversed(PLACEMENTS))
            log.info("round %d: %s", r, " ".join(order))
            rows += await run_round(order, args, model_dir, js, batches, messages)
    finally:
        await nc.close()
        server.stop()
        tracing.shutdown()
    return summarise(rows, args)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20, help="timed steps per placement and round (default 20)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first, on each fresh Learner (default 2)")
    p.add_argument("--rounds", type=int, default=2, help="rounds, the placements' order alternating (default 2)")
    p.add_argument("--msgs-per-s", type=float, default=64.0,
                   help="ScoredGroup messages the loop handles per second in the busy placements "
                        "(default 64: the example's 16 groups per step at ~4 steps/s)")
    p.add_argument("--example", type=Path, default=EXAMPLE, help="run file whose [model], [task] and [services.trainer] are used")
    p.add_argument("--quick", action="store_true", help="a short real run: 3 steps, 1 warm-up, 1 round")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.rounds = 3, 1, 1
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    figures = asyncio.run(bench(args))
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
