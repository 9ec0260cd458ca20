"""Leases, orphan reaping after a crash, clean shutdown, refusing to start without the prerequisites."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time

import pytest
from sbx_helpers import RUN, make_config, new_sandbox, sh

from proto import sandbox as api
from services.sandbox.backend import BackendUnavailable
from services.sandbox.bwrap import BwrapBackend
from services.sandbox.overlay import mounts_under
from tests.conftest import wait_for_async

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


async def test_lease_expiry_destroys_the_sandbox(backend, events):
    sid = await new_sandbox(backend, lease_ttl_s=0.3)
    await sh(backend, sid, "sleep 60", detach=True)
    tree = backend.sandboxes[sid].tree
    await events.wait_for(sid, "destroyed")
    kinds = events.kinds(sid)  # the lease may expire while the exec starts (an exec server's first start is slow)
    assert kinds[-1] == "destroyed" and kinds.index("lease_expired") < len(kinds) - 1
    assert events.of(sid, "destroyed")[0].detail.reason == "lease_expired"
    # its processes' exit, cgroup and volume are waited for in the background (the destroy does not wait)
    await wait_for_async(lambda: sid not in backend.sandboxes and mounts_under(tree.dir) == []
                         and not os.path.exists(tree.dir), 60, "the sandbox released, its mounts and directory gone")


async def test_renewing_the_lease_keeps_the_sandbox(backend, events):
    # a 5 s lease renewed by a client every ~0.25 s (its renewal period) until well past the first expiry:
    # generous on a loaded machine, and the sandbox outlives the lease it started with
    ttl = 5.0
    sid = await new_sandbox(backend, lease_ttl_s=ttl)
    first = (await backend.list(api.ListRequest(run_id=RUN))).sandboxes[0].lease_expires_at
    renewed = first
    while (now := time.time()) < first + 1.0:
        reply = await backend.renew_lease(api.RenewLeaseRequest(run_id=RUN, sandbox_id=sid))
        assert now + ttl - 1.0 <= reply.lease_expires_at and reply.lease_expires_at >= renewed
        renewed = reply.lease_expires_at
        await asyncio.sleep(0.25)  # the client's renewal period
    assert renewed > first
    assert sid in backend.sandboxes and "lease_expired" not in events.kinds(sid)


async def test_restart_reaps_orphans_of_a_crashed_instance(state_root, events):
    proc = await asyncio.create_subprocess_exec(
        sys.executable, os.path.join(os.path.dirname(__file__), "sbx_crasher.py"), state_root,
        cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}, stdout=asyncio.subprocess.PIPE,
    )
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 60)
        crashed = json.loads(line)
    finally:
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
    dead_dir = os.path.join(state_root, crashed["instance"])
    assert mounts_under(dead_dir)  # the crash left its overlay mounts behind
    leftover = [p for sid in crashed["sandboxes"] for p in _cgroup_pids(crashed["instance"], sid)]
    assert leftover  # the paused sandbox's processes cannot die with their owner while frozen
    successor = BwrapBackend(make_config(state_root), events)
    try:
        reaped = await successor.start()
    except BackendUnavailable as e:
        pytest.skip(f"bwrap backend unavailable here: {e}")
    try:
        assert sorted(reaped) == sorted(crashed["sandboxes"])
        assert not os.path.exists(dead_dir) and mounts_under(dead_dir) == []
        hierarchy = successor.hierarchy
        assert crashed["instance"] not in hierarchy.instances()
        for pid in leftover:  # the paused sleeper survived its owner (frozen): the reaper killed it
            assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
        for sid in crashed["sandboxes"]:
            ev = events.of(sid, "destroyed")
            assert ev and ev[0].detail.reason == "orphan_reaped" and ev[0].run_id == "crashed"
        # the successor works normally
        sid = await new_sandbox(successor)
        assert (await sh(successor, sid, "echo ok")).stdout == b"ok\n"
    finally:
        await successor.close()
    assert os.listdir(state_root) == []


async def test_close_removes_everything(state_root, events):
    b = BwrapBackend(make_config(state_root), events)
    try:
        await b.start()
    except BackendUnavailable as e:
        pytest.skip(f"bwrap backend unavailable here: {e}")
    sid = await new_sandbox(b)
    await sh(b, sid, "sleep 60", detach=True)
    instance, hierarchy = b.instance_id, b.hierarchy
    await b.close()
    assert events.of(sid, "destroyed")[0].detail.reason == "shutdown"
    assert os.listdir(state_root) == []
    assert instance not in hierarchy.instances()


async def test_refuses_to_start_without_bubblewrap(state_root):
    b = BwrapBackend(make_config(state_root, bwrap_path="/nonexistent/bwrap"), lambda e: None)
    with pytest.raises(BackendUnavailable) as err:
        await b.start()
    text = str(err.value)
    assert "bubblewrap" in text and "apt-get install -y bubblewrap" in text and "unsafe-process" in text


async def test_refuses_a_root_dir_the_sandbox_user_cannot_reach(tmp_path):
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    os.chmod(tmp_path, 0o700)
    b = BwrapBackend(make_config(str(private / "root")), lambda e: None)
    with pytest.raises(BackendUnavailable, match="not reachable by sandbox_uid"):
        await b.start()


def _cgroup_pids(instance: str, sandbox_id: str) -> list[int]:
    from services.sandbox.cgroups import Hierarchy

    cg = Hierarchy.detect("rlbus").existing(instance, sandbox_id)
    try:
        return cg.pids()
    except OSError:
        return []



async def test_image_base_replaces_the_host_view(state_root, events):
    image = os.path.join(state_root, "image")
    os.makedirs(os.path.join(image, "usr"))
    os.makedirs(os.path.join(image, "etc"))
    os.symlink("usr/bin", os.path.join(image, "bin"))
    os.symlink("usr/lib", os.path.join(image, "lib"))
    if os.path.isdir("/usr/lib64"):
        os.symlink("usr/lib64", os.path.join(image, "lib64"))
    with open(os.path.join(image, "etc", "image-marker"), "w") as f:
        f.write("from-image\n")
    usr = os.path.join(image, "usr")
    if os.system(f"mount --bind /usr {usr}") != 0:
        pytest.skip("cannot bind-mount /usr (not root?)")
    try:
        b = BwrapBackend(make_config(state_root + "/root", images={"mini": image}), events)
        try:
            await b.start()
        except BackendUnavailable as e:
            pytest.skip(f"bwrap backend unavailable here: {e}")
        try:
            sid = (await b.create(api.CreateRequest(run_id=RUN, base="mini"))).sandbox_id
            r = await sh(b, sid, "cat /etc/image-marker; ls /etc; touch /etc/x || echo read-only; echo w > f; cat f")
            assert r.stdout == b"from-image\nimage-marker\nread-only\nw\n"
        finally:
            await b.close()
    finally:
        os.system(f"umount {usr}")
