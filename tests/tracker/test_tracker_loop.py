"""A short real `rlbus run` with the tracker on: what TensorBoard and W&B (offline) hold equals what the
METRICS stream holds, the completions table comes from the trained trajectories, and a dead backend
(a second TensorBoard writer pointed at a directory that cannot exist) neither stops nor slows the run."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import nats
import numpy as np
import pytest

from proto.metrics import MetricsReport
from services.launcher.accounting import read_all
from services.runtime.natsd import EmbeddedNats, free_port
from tests.conftest import run_file
from tests.tracker import readers

pytestmark = pytest.mark.slow


def test_short_run_with_the_tracker(tmp_path, loop_model_dir):
    run_dir = tmp_path / "run"
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("no directory can be made under a file")
    cfg = run_file(tmp_path, loop_model_dir, run_id="trk-loop",
                   services={"trainer": 1, "rollout": 1, "judge": 1, "tracker": 1},
                   trainer={"groups_per_step": 4, "total_steps": 4, "max_staleness": 1,
                            "eval": {"every": 2, "prompts": 8}},
                   rollout={"max_tickets": 16},
                   extra=f"""
[services.tracker]
rows_per_step = 5
backends = [{{ type = "tensorboard" }}, {{ type = "wandb" }}, {{ type = "tensorboard", dir = "{blocker / 'tb'}" }}]
""")
    # no network: W&B offline, and anything that tried a server would meet a closed port
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_BASE_URL": f"http://127.0.0.1:{free_port()}"}
    r = subprocess.run([sys.executable, "-m", "services.launcher.cli", "run", str(cfg)], capture_output=True,
                       text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "run finished at step 4" in r.stderr
    tracker_log = (run_dir / "logs" / "tracker-0.log").read_text()
    assert "tracker backend tensorboard-2 could not start (NotADirectoryError" in tracker_log, tracker_log[-3000:]

    async def metrics() -> list[MetricsReport]:
        with EmbeddedNats(run_dir / "nats", port=None) as server:
            nc = await nats.connect(server.url)
            reps = await read_all(nc.jetstream(), "METRICS", "rlbus.trk-loop.metrics.*", MetricsReport)
            await nc.close()
            return reps

    reports = asyncio.run(metrics())
    (final,) = [rep.values for rep in reports if rep.service == "tracker"][-1:]
    assert final["tracker/tensorboard-2/written"] == 0 and final["tracker/tensorboard-2/dropped"] > 0
    assert final["tracker/tensorboard/dropped"] == 0 and final["tracker/wandb/dropped"] == 0
    assert final["tracker/tensorboard/written"] == final["tracker/tensorboard-2/dropped"]
    last_trainer = max(i for i, rep in enumerate(reports) if rep.service == "trainer")
    # every report stored up to the trainer's last one must be in the event file, value for value, in
    # stream order (reports other services sent while stopping may come after: a prefix is checked)
    expected: dict[str, list[np.float32]] = {}
    trainer_steps: dict[str, list[tuple[int, np.float32]]] = {}
    for rep in reports[: last_trainer + 1]:
        for tag, value in rep.values.items():
            if tag.startswith("tracker/"):
                continue  # the tracker's own last report is sent after its backends closed
            expected.setdefault(tag, []).append(np.float32(value))
            if rep.service == "trainer":
                trainer_steps.setdefault(tag, []).append((rep.step, np.float32(value)))
    scalars = readers.tb_scalars(readers.tensorboard(run_dir / "tensorboard"))
    assert "train/reward_mean" in expected and "eval/reward" in expected
    for tag, values in expected.items():
        got = [v for _, v in scalars.get(tag, [])]
        assert got[: len(values)] == values, tag
    for tag, pairs in trainer_steps.items():
        assert [p for p in scalars[tag] if p[0] >= 0][: len(pairs)] == pairs, tag
    assert [s for s, _ in scalars["trainer/version"]] == [1, 2, 3, 4]

    texts = readers.tb_texts(readers.tensorboard(run_dir / "tensorboard"))
    assert [s for s, _ in texts] == [1, 2, 3, 4]
    for _, text in texts:
        lines = text.splitlines()
        assert "| staleness |" in lines[0] and "score/" in lines[0] and len(lines) == 2 + 5, text

    wb = readers.wandb_offline_run(run_dir)
    history = readers.wandb_history(wb)
    trainer_rewards = [(s, float(v)) for s, v in trainer_steps["train/reward_mean"]]
    got = [(h["_step"], h["train/reward_mean"]) for h in history if "train/reward_mean" in h]
    assert [(s, pytest.approx(v, rel=1e-6)) for s, v in got] == trainer_rewards
    tables = readers.wandb_tables(wb)
    assert len(tables) == 4 and all(len(t["data"]) == 5 and "staleness" in t["columns"] for t in tables)
    assert {row[0] for t in tables for row in t["data"]} == {1, 2, 3, 4}
    # staleness as the trainer measures it: nothing older than max_staleness (1) is ever trained
    assert {row[t["columns"].index("staleness")] for t in tables for row in t["data"]} <= {0, 1}
