"""A rollout worker stops on SIGTERM while it waits for its first weight version (no trainer yet): it
used to wait out ``initial_weights_timeout_s`` (600 s by default) before it saw the stop."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import nats

from proto import catalog, codec
from proto.membership import Heartbeat
from services.runtime import bus
from tests.conftest import run_file, wait_for

ROOT = Path(__file__).resolve().parents[2]


def member_state(url: str, key: str) -> str | None:
    async def go() -> str | None:
        nc = await nats.connect(url)
        try:
            js = nc.jetstream()
            if key not in await bus.kv_keys(js, catalog.MEMBERS.bucket, key.rsplit(".", 1)[0] + "."):
                return None
            kv = await js.key_value(catalog.MEMBERS.bucket)
            return codec.decode((await kv.get(key)).value, Heartbeat).state
        except Exception:  # the bucket is not there yet, or the entry was just deleted
            return None
        finally:
            await nc.close()
    return asyncio.run(go())


def test_sigterm_while_waiting_for_the_first_weights(tmp_path, nats_url, loop_model_dir):
    cfg = run_file(tmp_path, loop_model_dir, run_id="stopwait", nats_url=nats_url, common={"heartbeat_s": 1.0},
                   trainer={}, rollout={"initial_weights_timeout_s": 600.0})
    log = tmp_path / "rollout.log"
    proc = subprocess.Popen([sys.executable, "-m", "services.launcher.cli", "service", "rollout", "--config",
                             str(cfg), "--instance", "rollout-0"], cwd=ROOT, stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        # running (its engine started, its heartbeat published): it now waits for a version nobody sends
        wait_for(lambda: member_state(nats_url, "stopwait.rollout.rollout-0") == "running", 180,
                 "the rollout worker's running heartbeat", interval=0.5)
        t0 = time.monotonic()
        proc.terminate()
        code = proc.wait(120)  # generous on a loaded machine; the bug made it 600 s
        stop_s = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 0, log.read_text()[-2000:]
    assert "serving the local weights" not in log.read_text()  # it stopped, it did not give up waiting
    print(f"stopped {stop_s:.1f} s after SIGTERM")
