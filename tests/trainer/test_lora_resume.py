"""A LoRA trainer service restarts like a full one: from the kept adapter version of its saved state (the store
transport keeps adapter versions), then from its adapter checkpoint onto the base model.

The real trainer service against a real nats-server, tiny model, store transport; rollout and judge are
played by the stand-in of ``test_resume.py`` (it answers every prompt ticket with scored trajectories).
"""

from __future__ import annotations

import asyncio
import json

import msgspec
import nats
import pytest

from services.launcher import registry
from services.lib.weights.index import VersionIndex
from services.lib.weights.lora_merge import ADAPTER_KEY
from services.runtime import service
from services.trainer.config import LoraConfig
from tests.conftest import wait_for_async
from tests.trainer.test_resume import RUN, _saved_state, _stand_in
from tests.trainer.test_resume import _config as resume_config


def _config(tmp_path, nats_url, model_dir, total_steps: int):
    """``test_resume``'s trainer config (no checkpoints but the final one) with LoRA."""
    loaded = resume_config(tmp_path, nats_url, model_dir, total_steps, 0)
    loaded.service = msgspec.structs.replace(loaded.service, optim=msgspec.structs.replace(loaded.service.optim, lr=1e-2),
                                             lora=LoraConfig(r=4, alpha=8.0))
    return loaded


@pytest.mark.slow
async def test_a_lora_trainer_resumes_from_its_kept_adapter_version_then_its_checkpoint(nats_url, tmp_path,
                                                                                        loop_model_dir):
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    await _stand_in(nc, [])
    factory = registry.load("trainer")[1]

    # 1. train, stop after step 2 without a checkpoint: the saved state and the kept adapter versions remain
    stop = asyncio.Event()
    first = asyncio.create_task(service.serve("trainer", factory, _config(tmp_path, nats_url, loop_model_dir, 10),
                                              "trainer-0", stop=stop))

    async def at_step_2() -> bool:
        assert not first.done(), "the trainer stopped before step 2"
        st = await _saved_state(js)
        return st is not None and st.step >= 2

    await wait_for_async(at_step_2, 240, "the trainer's saved state to reach step 2")
    stop.set()
    assert await asyncio.wait_for(first, 60) == 0
    stopped = await _saved_state(js)
    kept = await VersionIndex(nc, RUN).manifest(stopped.version)
    assert kept is not None and ADAPTER_KEY in {t.name for t in kept.tensors}  # what the store keeps: adapters

    # 2. restart: it loads the kept adapter version into a fresh base model and takes one more step
    code = await asyncio.wait_for(service.serve("trainer", factory,
                                                _config(tmp_path, nats_url, loop_model_dir, stopped.step + 1),
                                                "trainer-1"), 240)
    assert code == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["step"] == stopped.step + 1 and summary["version"] == stopped.version + 1
    ckpt_dir = tmp_path / "run" / "checkpoints"
    assert (ckpt_dir / (ckpt_dir / "latest").read_text().strip() / "adapter" / "adapter_config.json").is_file()

    # 3. restart again with a larger budget: from the final adapter checkpoint, onto the base model
    code = await asyncio.wait_for(service.serve("trainer", factory,
                                                _config(tmp_path, nats_url, loop_model_dir, stopped.step + 2),
                                                "trainer-2"), 240)
    assert code == 0
    again = await _saved_state(js)
    assert again is not None and again.step == stopped.step + 2 and again.state == "finished"
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["final_adapter"]
    await nc.close()
