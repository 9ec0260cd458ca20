"""LoRA adapter versions through the direct weight transports: a torch.distributed broadcast to an engine in
its own process, and the in-process hand-over of a colocated trainer+rollout. The adapters travel as any
state dict does; the engine merges them (its log names the adapted tensors it loaded) and generates with
each new version."""

from __future__ import annotations

import asyncio
import json

import nats
import pytest

from proto import catalog
from services.launcher.accounting import read_channel
from services.runtime.natsd import EmbeddedNats
from tests.loop.test_transports_in_loop import _run_three_steps

LAYOUTS = {
    "broadcast": ({"trainer": 1, "rollout": 1, "judge": 1},
                  {"type": "broadcast", "backend": "gloo", "timeout_s": 120}),
    "inproc": ({"trainer+rollout": 1, "judge": 1}, {"type": "inproc"}),
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_lora_versions_through_a_direct_transport(tmp_path, loop_model_dir, kind):
    services, transport = LAYOUTS[kind]
    run_id = f"lora-{kind}"
    logs = _run_three_steps(tmp_path, loop_model_dir, run_id, services, weights=transport,
                            trainer_extra={"lora": {"r": 4, "alpha": 8.0}, "optim": {"lr": 1e-2}})
    run_dir = tmp_path / "run"
    assert json.loads((run_dir / "summary.json").read_text())["step"] == 3
    engine_log = logs["rollout-0.log" if kind == "broadcast" else "trainer+rollout-0.log"]
    # every linear layer of the tiny model's 4 decoder layers adapted: 7 merged tensors per layer
    assert "applied weights version 3 (28 tensors" in engine_log, engine_log[-2000:]

    async def read():
        with EmbeddedNats(run_dir / "nats", port=None) as server:
            nc = await nats.connect(server.url)
            try:
                return await read_channel(nc.jetstream(), catalog.TRAJECTORIES, run_id)
            finally:
                await nc.close()

    token_versions = {v for t in asyncio.run(read()) for turn in t.rollout.turns for v in turn.versions}
    assert {0, 1, 2} <= token_versions, token_versions
