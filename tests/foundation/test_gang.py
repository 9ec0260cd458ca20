"""Gang start: all at once or not at all, per run, on a shared bus."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import nats
import nats.errors

from proto import catalog, codec, membership
from services.runtime import bus, gang
from tests.conftest import wait_for_async


def start(cfg_path, instance: str, run_id: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "services.launcher.cli", "service", "echo", "--config",
                             str(cfg_path), "--instance", instance, "--run-id", run_id],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


async def waited_through_heartbeats(js, run_id: str, instance: str, count: int, timeout: float = 120.0) -> None:
    """Return once ``instance`` of the echo service has published ``count`` heartbeats in state ``waiting``
    (a KV watch on its membership key: each of its heartbeats is one update), or as soon as it stops waiting."""
    kv = await js.key_value(catalog.MEMBERS.bucket)
    watcher = await kv.watch(membership.member_key(run_id, "echo", instance))
    seen = 0
    deadline = time.monotonic() + timeout
    try:
        while seen < count:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"{instance} published {seen} of {count} 'waiting' heartbeats in {timeout:g}s")
            try:
                entry = await watcher.updates(timeout=left)
            except nats.errors.TimeoutError:
                continue
            if entry is None or not entry.value:
                continue  # the end of the initial values, or a deletion
            state = codec.decode(entry.value, membership.Heartbeat, max_bytes=None).state
            if state == "waiting":
                seen += 1
            elif state != "starting":
                return  # it stopped waiting (admitted or failed): the caller's assertion says which
    finally:
        await watcher.stop()


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
    try:
        # a single member of A must not be admitted: a-0 waits through several of its own heartbeats (every
        # 0.3 s), so through more than one quorum check of its barrier (every 0.5 s), and A is still undecided
        await waited_through_heartbeats(js, "runA", "a-0", 5)
        assert await gang.read_state(js, "runA") is None
        a2 = start(cfg_a, "a-1", "runA")
        state_a = await wait_for_async(lambda: gang.read_state(js, "runA"), 20, "run A's gang state")
        assert state_a.state == "admitted"
        assert sorted(state_a.members["echo"]) == ["a-0", "a-1"]

        out_b = await asyncio.to_thread(b1.communicate, timeout=60)
        assert b1.returncode == gang.GANG_FAILED_EXIT, out_b[0]
        state_b = await gang.read_state(js, "runB")
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
