"""``rlbus run``'s live progress display and the reward-curve plot.

The display is a tap on the run's METRICS stream and its state key: it needs
nothing from the services but what they publish anyway.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from proto import catalog, codec
from proto.metrics import MetricsReport
from services.runtime import bus


class Progress:
    """Latest values from every service, printed as one line per trainer step."""

    def __init__(self, total_steps: int | None, out: TextIO = sys.stderr) -> None:
        self.total_steps = total_steps
        self.out = out
        self.values: dict[str, float] = {}
        self.eval_reward: float | None = None
        self.first_eval: float | None = None
        self.started = time.monotonic()
        self.state: dict[str, Any] = {}

    def update(self, rep: MetricsReport) -> str | None:
        self.values.update(rep.values)
        if "eval/reward" in rep.values:
            self.eval_reward = rep.values["eval/reward"]
            if self.first_eval is None:
                self.first_eval = self.eval_reward
            return self.line(rep.step, eval_line=True)
        if rep.service == "trainer" and rep.step >= 0:
            return self.line(rep.step)
        return None

    def line(self, step: int, eval_line: bool = False) -> str:
        v = self.values
        total = f"/{self.total_steps}" if self.total_steps else ""
        ev = "  -  " if self.eval_reward is None else f"{100 * self.eval_reward:5.1f}"
        text = (f"step {step:>4}{total}  eval {ev}%  train {100 * v.get('train/reward_mean', 0):5.1f}%  "
                f"staleness {v.get('trainer/staleness_mean', 0):.2f}  dropped {int(v.get('trainer/dropped_total', 0))}  "
                f"tok/s {v.get('rollout/tokens_per_s', 0):7.0f}  pending {int(v.get('rollout/pending_requests', 0)):4d}  "
                f"{time.monotonic() - self.started:6.0f}s")
        return ("[eval] " if eval_line else "       ") + text


async def follow(nats_url: str, run_id: str, total_steps: int | None, stop: asyncio.Event,
                 out: TextIO = sys.stderr, extending: bool = False) -> dict[str, Any]:
    """Print progress until the run's state says finished/failed or ``stop`` is set; return the final state.
    ``extending``: the run had finished before (``rlbus run --resume``): its old terminal state is not the end."""
    from services.runtime.config import NatsSection

    nc = await bus.connect(NatsSection(url=nats_url), "rlbus-run-progress")
    js = nc.jetstream()
    await bus.provision_all(js)
    progress = Progress(total_steps, out)

    async def on_metrics(m: Any) -> None:
        try:
            rep = codec.decode(m.data, MetricsReport, max_bytes=None)
        except codec.DecodeError:
            return
        line = progress.update(rep)
        if line:
            print(line, file=out, flush=True)

    sub = await nc.subscribe(catalog.METRICS.wildcard(run_id), cb=on_metrics)
    kv = await bus.ensure_kv(js, catalog.RUNS)
    watcher = await kv.watch(f"{run_id}.state")
    final: dict[str, Any] = {}
    seen_running = False
    stop_task = asyncio.create_task(stop.wait(), name="progress-stop")
    try:
        while not stop.is_set():
            upd = asyncio.create_task(watcher.updates(timeout=3600), name="progress-state")
            done, _ = await asyncio.wait({upd, stop_task}, return_when=asyncio.FIRST_COMPLETED)
            if upd not in done:
                upd.cancel()
                break
            try:
                entry = upd.result()
            except Exception:
                continue
            if entry is None or entry.value is None:
                continue
            try:
                state = codec.msgspec.msgpack.decode(entry.value)
            except codec.msgspec.DecodeError:
                continue  # not a state record: skipped (only the trainer and the launcher may write the key)
            if not isinstance(state, dict):
                continue
            if state.get("state") == "running":
                seen_running = True
            # the watch starts with the stored state: a finished run being extended (--resume) says
            # "finished" until its trainer is up again, which it does by saving "running" first
            elif state.get("state") in ("finished", "failed") and (seen_running or not extending):
                final = state
                break
    finally:
        stop_task.cancel()
        await sub.unsubscribe()
        await watcher.stop()
        await nc.close()
    final["first_eval"] = progress.first_eval
    final["last_eval"] = progress.eval_reward
    return final


def plot_rewards(metrics_path: Path, out_png: Path) -> Path | None:
    """Eval and train reward against wall time and step, as a PNG."""
    if not metrics_path.is_file():
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    evals, trains = [], []
    for line in metrics_path.read_text().splitlines():
        rec = json.loads(line)
        if "eval/reward" in rec:
            evals.append((rec["step"], rec["elapsed_s"], 100 * rec["eval/reward"]))
        if "train/reward_mean" in rec:
            trains.append((rec["step"], rec["elapsed_s"], 100 * rec["train/reward_mean"]))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for ax, idx, label in ((a1, 0, "trainer step"), (a2, 1, "seconds since training started")):
        if trains:
            ax.plot([t[idx] for t in trains], [t[2] for t in trains], alpha=0.4, label="train reward (batch)")
        if evals:
            ax.plot([e[idx] for e in evals], [e[2] for e in evals], "o-", label="held-out eval reward")
        ax.set_xlabel(label)
        ax.set_ylabel("reward (%)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("rlbus: reward")
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png
