"""The default example on one NATS server vs a local 3-node JetStream cluster with R3 streams, and the
time the loop takes to step again after a NATS node is SIGKILLed.

    .venv/bin/python bench/nats_cluster.py --steps 60 --rounds 2

Throughput: ``rlbus run addition`` to ``--steps`` trainer steps, alternately on one server
(``launcher.nats_cluster = 0``, ``nats.replicas = 1``) and on a cluster (``launcher.nats_cluster = 3``:
every stream, bucket and object store R3), ``--rounds`` times each, so a machine getting busier does not
favour one side. The figure is the trainer's mean seconds per step (``metrics.jsonl``), start-up excluded.

Recovery: the same example under an in-process supervisor; once it steps steadily, the NATS node leading
the TRAJECTORIES stream is SIGKILLed (cluster: left down for ``--down-s`` seconds, then restarted; one
server: restarted after ``--down-s``, the only way back). ``recovery_s`` is the time from the kill to the
next trainer step, beside the median step interval before the kill. The last line is JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._rlbus_runs import EXAMPLE, read_metrics, run_rlbus  # noqa: E402

log = logging.getLogger("rlbus.bench.nats_cluster")


def step_times(metrics: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["time"]) for r in read_metrics(metrics) if "trainer/version" in r] \
        if metrics.is_file() else []


def wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while (value := predicate()) is None or value is False:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout:.0f}s")
        time.sleep(0.2)  # polling a metrics file another process writes
    return value


def recovery(root: Path, nodes: int, down_s: float, warm_steps: int) -> dict[str, float]:
    from services.launcher.supervisor import Supervisor
    from services.runtime import bus

    run_dir = root / f"recovery-{nodes}"
    overrides = [f'run.dir="{run_dir}"', f'run.id="recovery{nodes}"', "services.trainer.total_steps=100000",
                 "services.trainer.max_wall_s=0.0", "services.trainer.eval.every=0",
                 "services.trainer.eval.prompts=16", f"launcher.nats_cluster={nodes if nodes > 1 else 0}"]
    sup = Supervisor(str(EXAMPLE), overrides, quiet=True)
    metrics = run_dir / "metrics.jsonl"
    try:
        sup.start()
        sup.start_heartbeat_monitor()
        threading.Thread(target=sup.wait, name="supervisor", daemon=True).start()
        wait(lambda: len(step_times(metrics)) >= warm_steps or None, 900, f"{warm_steps} steps")
        times = [t for _, t in step_times(metrics)]
        interval = statistics.median(b - a for a, b in zip(times[-6:], times[-5:], strict=False))
        step = step_times(metrics)[-1][0]
        if nodes > 1:
            async def leader() -> str:
                nc = await bus.connect(sup.nats_section(), "bench")
                name = (await nc.jetstream().stream_info("TRAJECTORIES")).cluster.leader
                await nc.close()
                return name

            name = asyncio.run(leader())
            victim = next(i for i in range(nodes) if name.endswith(f"-n{i}"))
            t_kill = time.time()
            sup.nats.kill(victim)
            killed = time.monotonic()
        else:
            t_kill = time.time()
            sup.nats.kill()
            killed = time.monotonic()
        restarted = False
        while True:
            after = next((t for s, t in step_times(metrics) if s > step and t > t_kill), None)
            if after is not None:
                break
            if not restarted and time.monotonic() - killed >= down_s:
                if nodes > 1:
                    sup.nats.restart(victim)
                else:
                    sup.nats.start()
                restarted = True
            if time.monotonic() - killed > 600:
                raise TimeoutError("no step within 600 s of the kill")
            time.sleep(0.2)  # polling the metrics file
        stepped_while_down = not restarted
        if not restarted:
            sup.nats.restart(victim)
        return {"recovery_s": round(after - t_kill, 2), "step_interval_s": round(interval, 2),
                "stepped_while_node_down": stepped_while_down}
    finally:
        sup.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--down-s", type=float, default=10.0, help="seconds a killed node stays down")
    ap.add_argument("--warm-steps", type=int, default=8, help="steps before the kill")
    ap.add_argument("--skip-throughput", action="store_true")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    root = Path(tempfile.mkdtemp(prefix="rlbus-bench-cluster-"))
    base = {"services.trainer.total_steps": args.steps, "services.trainer.max_wall_s": 0.0,
            "services.trainer.eval.every": 0, "services.trainer.eval.prompts": 16,
            "services.trainer.checkpoint_every": 0}
    s_per_step: dict[str, list[float]] = {"single": [], "r3": []}
    if not args.skip_throughput:
        for r in range(args.rounds):
            order = ["single", "r3"] if r % 2 == 0 else ["r3", "single"]
            for side in order:
                keys = dict(base)
                if side == "r3":
                    keys["launcher.nats_cluster"] = 3
                res = run_rlbus(f"{side}-{r}", root / f"{side}-{r}", keys)
                s_per_step[side].append(res.stats["s_per_step"])
                log.info("%s round %d: %.3f s/step", side, r, res.stats["s_per_step"])
    out: dict[str, object] = {"steps": args.steps, "rounds": args.rounds}
    if s_per_step["single"]:
        single, r3 = statistics.median(s_per_step["single"]), statistics.median(s_per_step["r3"])
        out.update({"s_per_step": s_per_step, "steps_per_s_single": round(1 / single, 3),
                    "steps_per_s_r3": round(1 / r3, 3), "r3_slowdown": round(r3 / single, 3)})
    out["recovery_single_server"] = recovery(root, 1, args.down_s, args.warm_steps)
    out["recovery_r3_leader_kill"] = recovery(root, 3, args.down_s, args.warm_steps)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
