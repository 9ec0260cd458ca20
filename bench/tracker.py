"""The cost of the tracker: the default example (``examples/addition.toml``) with the tracker off vs on
(TensorBoard + W&B offline, a completions table every step), the same steps, alternating in one
invocation (this machine is shared: pairs, not single runs); then how fast a tracker follows a finished
run's streams from their start.

* off: the example's services;
* on: the same plus ``tracker = 1`` with backends TensorBoard and W&B (``WANDB_MODE=offline``).

Figures: seconds per trainer step (trainer clock, first to last step) of each run, and ``overhead``, the
mean of on/off over the pairs; ``after_the_fact_s``: a fresh tracker (new durable consumers, TensorBoard
only) on a copy of the last "on" run's NATS store, from start until its own report says every step's
table is written, with the messages it read and their rate. Last stdout line: one JSON object.

    python bench/tracker.py                       # 2 pairs of 100 steps
    python bench/tracker.py --steps 20 --pairs 1 --quick-check   # a smoke run (figure not meaningful)
    python bench/tracker.py --follow runs/addition --steps N      # only following a finished N-step run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._rlbus_runs import run_rlbus  # noqa: E402


async def follow_after_the_fact(nats_dir: Path, run_id: str, steps: int, out_dir: Path) -> dict[str, float]:
    """A fresh tracker on a finished run's streams: seconds until every step's table is written."""
    import nats

    from proto import codec
    from proto.metrics import MetricsReport
    from services.launcher import registry
    from services.runtime import service
    from services.runtime.config import load_service_config
    from services.runtime.natsd import EmbeddedNats
    from services.tracker.config import TrackerConfig

    with EmbeddedNats(nats_dir, port=None) as server:
        nc = await nats.connect(server.url)
        js = nc.jetstream()
        stored = 0
        for stream in ("METRICS", "TRAJECTORIES", "OUTCOMES"):
            await js.delete_consumer(stream, f"tracker-{run_id}")  # the run's own tracker already read it all
            stored += (await js.stream_info(stream)).state.messages
        out_dir.mkdir(parents=True, exist_ok=True)
        cfg = out_dir / "after.toml"
        cfg.write_text(f'[run]\nid = "{run_id}"\ndir = "{out_dir}"\n[nats]\nurl = "{server.url}"\n'
                       "[services.tracker]\nreport_every_s = 0.5\ntable_after_s = 1.0\n")
        loaded = load_service_config("tracker", TrackerConfig, cfg, env={})
        stop = asyncio.Event()
        done = asyncio.Event()

        async def on_report(m) -> None:  # the tracker's own reports say how far it got
            rep = codec.decode(m.data, MetricsReport, max_bytes=None)
            if rep.instance == "after-0" and rep.values.get("tracker/tables", 0) >= steps:
                done.set()

        sub = await nc.subscribe(f"rlbus.{run_id}.metrics.tracker", cb=on_report)
        t0 = time.monotonic()
        task = asyncio.create_task(service.serve("tracker", registry.load("tracker")[1], loaded, "after-0",
                                                 stop=stop))
        finished = asyncio.create_task(done.wait())
        await asyncio.wait({task, finished}, return_when=asyncio.FIRST_COMPLETED)
        if not done.is_set():
            raise RuntimeError(f"the tracker stopped early with code {task.result()}")
        seconds = time.monotonic() - t0
        stop.set()
        await task
        await sub.unsubscribe()
        await nc.close()
    return {"after_the_fact_s": round(seconds, 2), "messages": stored, "messages_per_s": round(stored / seconds, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--quick-check", action="store_true", help="say the figure is not meaningful (smoke run)")
    parser.add_argument("--follow", type=Path, metavar="RUN_DIR",
                        help="only follow this finished run (its nats/ is copied; --steps: its step count)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    if args.follow is not None:
        with tempfile.TemporaryDirectory() as tmp:
            shutil.copytree(args.follow / "nats", Path(tmp) / "nats-copy")
            run_id = json.loads((args.follow / "config.resolved.json").read_text())["run"]["id"]
            after = asyncio.run(follow_after_the_fact(Path(tmp) / "nats-copy", run_id, args.steps, Path(tmp) / "a"))
        print(json.dumps({**after, "steps": args.steps, "load_average": [round(x, 2) for x in os.getloadavg()]}))
        return
    common = {"services.trainer.total_steps": args.steps, "services.trainer.max_wall_s": 0,
              "services.trainer.eval.every": 0, "services.trainer.checkpoint_every": 0}
    per_step: dict[str, list[float]] = {"on": [], "off": []}
    after: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        last_on = None
        for pair in range(args.pairs):
            for side in (("off", "on") if pair % 2 == 0 else ("on", "off")):
                overrides = dict(common)
                env = {}
                if side == "on":
                    overrides["launcher.services.tracker"] = 1
                    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true",
                           "RLBUS__SERVICES__TRACKER__BACKENDS": '[{ type = "tensorboard" }, { type = "wandb" }]'}
                result = run_rlbus(f"tracker-{side}-{pair}", Path(tmp) / f"{side}-{pair}", overrides, env=env)
                per_step[side].append(result.stats["s_per_step"])
                if side == "on":
                    last_on = result
                print(f"pair {pair + 1} {side:3s}: {result.stats['steps']} steps, {result.stats['s_per_step']:.4f} "
                      f"s/step", file=sys.stderr)
        assert last_on is not None
        copy = Path(tmp) / "nats-copy"
        shutil.copytree(last_on.run_dir / "nats", copy)
        run_id = json.loads((last_on.run_dir / "config.resolved.json").read_text())["run"]["id"]
        after = asyncio.run(follow_after_the_fact(copy, run_id, args.steps, Path(tmp) / "after"))
    ratios = [on / off for on, off in zip(per_step["on"], per_step["off"], strict=True)]
    print(json.dumps({
        "overhead": round(statistics.mean(ratios), 4), "ratios": [round(r, 4) for r in ratios],
        "s_per_step_on": per_step["on"], "s_per_step_off": per_step["off"], "steps": args.steps,
        "pairs": args.pairs, **after, "meaningful": not args.quick_check,
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }))


if __name__ == "__main__":
    main()
