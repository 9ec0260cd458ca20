"""The trainer reports the dataset task's skipped rows (``task/skipped_rows``) once it has built the prompts:
in its metrics file and on the bus. Real trainer service, real nats-server, the tiny model."""

from __future__ import annotations

import asyncio
import json

import nats

from proto.metrics import MetricsReport
from services.launcher import registry
from services.launcher.accounting import read_all
from services.runtime import service
from services.runtime.config import load_service_config
from tests.conftest import wait_for_async

RUN = "skipped"


async def test_the_trainer_reports_the_dataset_tasks_skipped_rows(nats_url, tmp_path, loop_model_dir):
    data = tmp_path / "train.jsonl"
    rows = [{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in range(10, 30)]
    rows[3] = {"question": "no prompt field"}  # skipped: missing field
    rows[7] = {"prompt": ["not", "messages"], "answer": "1"}  # skipped: wrong type
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\nnot json at all\n")  # skipped: unreadable row
    cfg = tmp_path / "run.toml"
    cfg.write_text(f"""
[run]
id = "{RUN}"
dir = "{tmp_path / 'run'}"
[nats]
url = "{nats_url}"
[model]
name = "{loop_model_dir}"
[task]
name = "dataset"
options = {{ path = "{data}", max_new_tokens = 4, reward = ["exact_match"] }}
[services.trainer]
groups_per_step = 1
group_size = 2
checkpoint_every = 0
eval = {{ every = 0 }}
devices = {{ num_threads = 1 }}
""")
    cfg_cls, factory = registry.load("trainer")
    stop = asyncio.Event()
    trainer = asyncio.create_task(service.serve("trainer", factory, load_service_config("trainer", cfg_cls, cfg),
                                                "trainer-0", stop=stop))
    metrics_file = tmp_path / "run" / "metrics.jsonl"

    def reported() -> list[dict]:
        if not metrics_file.is_file():
            return []
        return [r for r in map(json.loads, metrics_file.read_text().splitlines()) if "task/skipped_rows" in r]

    nc = await nats.connect(nats_url)
    try:
        (record,) = await wait_for_async(reported, 180, "task/skipped_rows in metrics.jsonl")
        on_bus = await wait_for_async(
            lambda: _with_key(read_all(nc.jetstream(), "METRICS", f"rlbus.{RUN}.metrics.>", MetricsReport)), 60,
            "task/skipped_rows on the bus")
    finally:
        stop.set()
        code = await asyncio.wait_for(trainer, 120)
        await nc.close()
    assert code == 0
    assert record["task/skipped_rows"] == 3.0 and record["step"] == 0
    assert [m.values["task/skipped_rows"] for m in on_bus] == [3.0]


async def _with_key(reports):
    return [m for m in await reports if "task/skipped_rows" in m.values]
