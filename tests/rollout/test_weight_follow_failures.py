"""A weight version the engine cannot apply no longer silently stops weight-following: the rollout says it is
unhealthy (heartbeat gauge ``rollout/weights_unhealthy``, ``rlbus status --healthy`` fails naming it), logs the
failure once, retries a bounded number of times and then ends with exit code 1 so that its supervisor
restarts it. A failure that clears (a transient one) makes it healthy again."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import nats
import torch

from proto import catalog, codec
from proto.membership import Heartbeat
from services.launcher.status import healthy_here, unhealthy
from services.lib.engine.base import WeightUpdateError
from services.lib.engine.config import TorchEngineConfig
from services.lib.engine.torch_engine import TorchEngine
from services.lib.model_io import load_policy
from services.lib.weights.client import WeightPublisher
from services.lib.weights.objstore import ObjectStoreBlobs
from services.lib.weights.transport import make_receiver
from services.rollout.config import RolloutConfig
from services.rollout.service import RolloutService
from services.runtime.config import CommonSection, Loaded, ModelSection, NatsSection, RunSection
from services.runtime.weights_config import EncodingConfig, StoreTransportConfig
from tests.conftest import run_file, wait_for

ROOT = Path(__file__).resolve().parents[2]


def heartbeat(url: str, key: str) -> Heartbeat | None:
    async def go() -> Heartbeat | None:
        nc = await nats.connect(url)
        try:
            kv = await nc.jetstream().key_value(catalog.MEMBERS.bucket)
            return codec.decode((await kv.get(key)).value, Heartbeat)
        except Exception:  # the bucket or the key is not there (yet, or any more)
            return None
        finally:
            await nc.close()
    return asyncio.run(go())


async def publish(url: str, run_id: str, state: dict[str, torch.Tensor], version: int) -> None:
    nc = await nats.connect(url)
    try:
        pub = WeightPublisher(nc, run_id, ObjectStoreBlobs(nc), encoding=EncodingConfig(anchor_every=1))
        await pub.publish(state, version=version)
    finally:
        await nc.close()


def test_a_version_that_cannot_be_applied_makes_the_rollout_unhealthy_then_exit_1(tmp_path, nats_url,
                                                                                   loop_model_dir):
    run_id = "wfail"
    cfg = run_file(tmp_path, loop_model_dir, run_id=run_id, nats_url=nats_url, common={"heartbeat_s": 0.5},
                   trainer={}, rollout={"initial_weights_timeout_s": 600.0, "max_weight_failures": 2,
                                        "weight_retry_s": 10.0})
    model, _ = load_policy(loop_model_dir)
    good = {k: v.detach().clone() for k, v in model.state_dict().items()}
    log = tmp_path / "rollout.log"
    proc = subprocess.Popen([sys.executable, "-m", "services.launcher.cli", "service", "rollout", "--config",
                             str(cfg), "--instance", "rollout-0"], cwd=ROOT, stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    key = f"{run_id}.rollout.rollout-0"
    try:
        asyncio.run(publish(nats_url, run_id, good, 0))
        wait_for(lambda: (hb := heartbeat(nats_url, key)) is not None and hb.metrics.get("rollout/weight_version")
                 == 0.0, 180, "the rollout to apply version 0", interval=0.5)
        # version 1 names a tensor the model does not have: the engine refuses it, every time
        asyncio.run(publish(nats_url, run_id, {**good, "model.not_a_layer.weight": torch.zeros(3)}, 1))
        hb = wait_for(lambda: (h := heartbeat(nats_url, key)) is not None
                      and h.metrics.get("rollout/weights_unhealthy") == 1.0 and h, 60,
                      "the rollout's heartbeat to say it is unhealthy", interval=0.2)
        assert hb.state == "running" and hb.metrics["rollout/weight_apply_failures"] == 1.0
        member = {"service": "rollout", "instance": "rollout-0", "state": hb.state, "host": hb.host,
                  "pid": hb.pid, "age_s": 0.0, "metrics": hb.metrics}
        ok, why = healthy_here({"run_id": run_id, "members": [member]}, "rollout", 60.0, host=hb.host)
        assert not ok and "reports itself unhealthy (rollout/weights_unhealthy)" in why
        assert unhealthy(member) == ["rollout/weights_unhealthy"]
        # the retry (10 s later) fails too: max_weight_failures = 2 reached, the process ends with 1
        code = proc.wait(180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert code == 1, text[-3000:]
    assert text.count("applying weights version 1 failed") == 1, text[-3000:]  # logged once, not per retry
    assert "not_a_layer" in text
    assert "applying weights failed 2 times in a row (max_weight_failures)" in text
    assert "stopping so that the rollout is restarted" in text


class FailingOnce(TorchEngine):
    """The torch engine whose first weight update fails as staging into a full /dev/shm would (a transient
    failure); later ones apply."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.failed = 0

    async def update_weights(self, state_dict, version):
        if not self.failed:
            self.failed += 1
            raise WeightUpdateError("staging dir /dev/shm has 0.0 MiB free")
        await super().update_weights(state_dict, version)


class Ctx:
    """The parts of ServiceContext the weight follower touches."""

    def __init__(self) -> None:
        self.gauges: dict[str, float] = {}
        self.stop = asyncio.Event()


async def test_a_failure_that_clears_is_retried_and_the_rollout_is_healthy_again(nats_url, loop_model_dir):
    run_id = "wretry"
    model, _ = load_policy(loop_model_dir)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state["lm_head.weight"] = -state["lm_head.weight"]
    nc = await nats.connect(nats_url)
    pub = WeightPublisher(nc, run_id, ObjectStoreBlobs(nc), encoding=EncodingConfig(anchor_every=1))
    await pub.publish(state, version=3)
    loaded = Loaded(run=RunSection(id=run_id), nats=NatsSection(url=nats_url), common=CommonSection(),
                    model=ModelSection(name=str(loop_model_dir)),
                    service=RolloutConfig(max_weight_failures=3, weight_retry_s=0.05))
    svc = RolloutService(loaded)
    svc.engine = FailingOnce(TorchEngineConfig(), loop_model_dir)
    await svc.engine.start()
    receiver = make_receiver(StoreTransportConfig(recheck_s=0.2), nc, run_id)
    ctx = Ctx()
    follower = asyncio.create_task(svc.follow_weights(ctx, receiver))
    try:
        await asyncio.wait_for(svc.first_weights.wait(), 60)
        assert svc.engine.version == 3 and svc.engine.failed == 1
        assert torch.equal(svc.engine._model.lm_head.weight.detach(), state["lm_head.weight"])
        assert ctx.gauges["rollout/weights_unhealthy"] == 0.0 and ctx.gauges["rollout/weight_apply_failures"] == 1
        assert svc.weight_failures == 0 and svc.weights_failure is None and not ctx.stop.is_set()
        assert not follower.done()  # still following
    finally:
        follower.cancel()
        await asyncio.wait({follower})
        await receiver.close()
        await svc.engine.stop()
        await nc.close()
