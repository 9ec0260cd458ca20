"""``rlbus replay step N``: after a real run (every service its own process, CPU, one thread), each train step
is rebuilt from the run directory alone — batch in order from the stored streams, the weights it started
from out of the run's weight store — and its loss and gradient norm recomputed bit-identically; a step
whose weights retention removed, or one never recorded, is refused with what exactly is missing."""

from __future__ import annotations

import subprocess
import sys

import pytest

from services.launcher.replay import ReplayError, replay_step
from tests.conftest import run_file


@pytest.mark.slow
def test_recorded_steps_recompute_bit_identically(tmp_path, loop_model_dir):
    cfg = run_file(tmp_path, loop_model_dir, run_id="replayed", services={"trainer": 1, "rollout": 1, "judge": 1},
                   trainer={"groups_per_step": 3, "total_steps": 3, "max_staleness": 1,
                            "eval": {"prompts": 4}},
                   rollout={"max_tickets": 8})
    r = subprocess.run([sys.executable, "-m", "services.launcher.cli", "run", str(cfg)], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    run_dir = tmp_path / "run"
    for step in (1, 3):  # from the initial model, and from a version fetched out of the weight store
        result = replay_step(run_dir, step)
        assert result.samples == 3 * 4
        assert set(result.recorded) == {"losses/total", "losses/policy", "optim/grad_norm"}
        assert result.identical, result.report()
    out = subprocess.run([sys.executable, "-m", "services.launcher.cli", "replay", "step", "2", "--run-dir",
                          str(run_dir)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.count("identical") == 3, (out.stdout, out.stderr[-2000:])

    with pytest.raises(ReplayError, match="records no train step 9"):
        replay_step(run_dir, 9)
    # retention: a version the weight store no longer holds is named as missing
    import asyncio

    import nats

    from services.lib.weights.transport import store_subscriber
    from services.runtime.natsd import EmbeddedNats
    from services.runtime.weights_config import StoreTransportConfig

    async def forget_version_1() -> None:
        with EmbeddedNats(run_dir / "nats", port=None) as server:
            nc = await nats.connect(server.url)
            sub = store_subscriber(StoreTransportConfig(), nc, "replayed")
            await sub.ensure()
            await sub.index.delete_manifest(1)
            await nc.close()

    asyncio.run(forget_version_1())
    with pytest.raises(ReplayError, match=r"weight version 1, which step 2 started from .*, is not in the run's weight store"):
        replay_step(run_dir, 2)
