"""Gang start: all at once or not at all, per run, on a shared bus."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import nats

from services.runtime import bus, gang
from tests.conftest import wait_for_async


def start(cfg_path, instance: str, run_id: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "services.launcher.cli", "service", "echo", "--config",
                             str(cfg_path), "--instance", instance, "--run-id", run_id],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def write_cfg(tmp_path, nats_url: str, name: str, quorum: int, timeout: float):
    cfg = tmp_path / f"{name}.toml"
    cfg.write_text(f'[nats]\nurl = "{nats_url}"\n[common]\nheartbeat_s = 0.3\n'
                   f"[gang]\nroles = {{ echo = {quorum} }}\ntimeout_s = {timeout}\n")
    return cfg


async def test_quorum_admits_and_missing_quorum_fails_without_blocking_other_runs(nats_url, tmp_path):
    # run A needs 2 echo members and gets 2; run B needs 3 and gets 1: A is admitted, B fails naming the role
    cfg_a = write_cfg(tmp_path, nats_url, "a", 2, 60)
    cfg_b = write_cfg(tmp_path, nats_url, "b", 3, 4)
    b1 = start(cfg_b, "b-0", "runB")
    a1 = start(cfg_a, "a-0", "runA")
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    await bus.provision_all(js)
    runs_kv = await js.key_value("rlbus_runs")
    try:
        await asyncio.sleep(2.0)  # a single member of A must not be admitted
        assert await gang.read_state(runs_kv, "runA") is None
        a2 = start(cfg_a, "a-1", "runA")
        state_a = await wait_for_async(lambda: gang.read_state(runs_kv, "runA"), 20, "run A's gang state")
        assert state_a.state == "admitted"
        assert sorted(state_a.members["echo"]) == ["a-0", "a-1"]

        out_b = await asyncio.to_thread(b1.communicate, timeout=60)
        assert b1.returncode == gang.GANG_FAILED_EXIT, out_b[0]
        state_b = await gang.read_state(runs_kv, "runB")
        assert state_b.state == "failed" and state_b.missing == {"echo": 2}
        assert "echo needs 2 more" in out_b[0]
        # A is running: both members still up
        assert a1.poll() is None and a2.poll() is None
    finally:
        for p in (a1, b1):
            if p.poll() is None:
                p.terminate()
        if "a2" in locals() and a2.poll() is None:
            a2.terminate()
        for p in [a1, b1] + ([a2] if "a2" in locals() else []):
            p.wait(30)
        await nc.close()
