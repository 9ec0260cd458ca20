"""A short `rlbus run` across separate processes: steps advance, every trajectory is accounted for."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import nats
import pytest

from proto import catalog
from services.launcher.accounting import read_channel
from services.launcher.status import collect, format_status
from services.lib.weights.objstore import ObjectStoreBlobs
from services.runtime.natsd import EmbeddedNats
from tests.conftest import run_file

pytestmark = pytest.mark.slow


def test_short_run_end_to_end(tmp_path, loop_model_dir):
    run_dir = tmp_path / "run"
    cfg = run_file(tmp_path, loop_model_dir, run_id="e2e",
                   services={"trainer": 1, "rollout": 1, "judge": 2, "weightsync": 1},
                   trainer={"groups_per_step": 4, "total_steps": 6, "max_staleness": 1,
                            "checkpoint_every": 3, "eval": {"every": 3, "prompts": 16}},
                   rollout={"max_tickets": 16}, weights={"type": "store", "encoding": {"anchor_every": 2}})
    r = subprocess.run([sys.executable, "-m", "services.launcher.cli", "run", str(cfg)], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "run finished at step 6" in r.stderr

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["step"] == 6 and summary["version"] == 6
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    versions = [m["trainer/version"] for m in metrics if "trainer/version" in m]
    assert versions == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    peaks = [m["trainer/in_flight_peak"] for m in metrics if "trainer/in_flight_peak" in m]
    assert max(peaks) <= (1 + 1) * 4  # (max_staleness + 1) * groups_per_step
    evals = [m for m in metrics if "eval/reward" in m]
    # one round at the start and after every 3 steps; a round is reported when its last sample is back, so an
    # earlier round's straggler may be reported after a later round (the order of completion is not promised)
    assert sorted(e["step"] for e in evals) == [0, 3, 6]
    assert (run_dir / "reward_curve.png").stat().st_size > 1000

    # the final model is a Hugging Face directory that loads
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run_dir / "final_model", local_files_only=True)
    assert sum(p.numel() for p in model.parameters()) > 100_000

    # accounting, from the run's own (file-stored) streams
    async def accounting():
        with EmbeddedNats(run_dir / "nats", port=None) as server:
            nc = await nats.connect(server.url)
            js = nc.jetstream()
            trajectories = await read_channel(js, catalog.TRAJECTORIES, "e2e")
            outcomes = await read_channel(js, catalog.OUTCOMES, "e2e")
            ci = await js.consumer_info("TRAJECTORIES", "trainer-e2e")
            stored = await ObjectStoreBlobs(nc).list("e2e/")
            status = await collect(nc, "e2e")
            await nc.close()
            return trajectories, outcomes, ci, stored, status

    trajectories, outcomes, ci, stored, status = asyncio.run(accounting())
    # `rlbus status` reports the newest version and the trainer's state
    assert status["weights"]["version"] == 6 and status["weights"]["transport"] == "store (objstore)", status
    assert status["trainer"] == {"state": "finished", "step": 6, "version": 6}, status
    assert "latest weight version: v6 in the store (objstore)" in format_status(status)
    # weightsync's retention ran: anchors at least every 2nd version, the last 2 anchors (and the deltas
    # after them) are kept, so version 0 was collected once version 4 existed
    kept = sorted({int(name.split("/")[1][1:]) for name in stored})
    assert kept and kept[-1] == 6 and 0 not in kept, kept
    by_id = {}
    for o in outcomes:
        by_id.setdefault(o.trajectory_id, []).append(o)
    assert all(len(v) == 1 for v in by_id.values()), "a trajectory got two outcomes"
    published = {t.msg_id for t in trajectories}
    assert set(by_id) <= published
    trained = [o for o in outcomes if o.outcome == "trained"]
    dropped = [o for o in outcomes if o.outcome == "dropped"]
    assert len(trained) == 6 * 4 * 4  # steps x groups x group size
    assert all(o.reason.startswith("stale") or "dropped" in o.reason for o in dropped)
    pending = published - set(by_id)
    # whatever has no outcome is still held by the trainer's durable consumer: nothing vanished
    assert len({p.rsplit("-s", 2)[0] for p in pending}) == ci.num_ack_pending + ci.num_pending  # a message per group
    assert len(trajectories) == len(trained) + len(dropped) + sum(o.outcome == "eval" for o in outcomes) + len(pending)
