"""Disk and inode quotas, enforced by the kernel: writes fail with ENOSPC inside the sandbox, a
``limit_exceeded`` event says so, and the host's disk never sees the bytes (real bwrap backend, as root)."""

from __future__ import annotations

import os

import msgspec
import pytest
from sbx_helpers import RUN, needs_python, new_sandbox, read, sh

from proto import sandbox as api
from services.sandbox.backend import InvalidRequest, LimitReached
from services.sandbox.config import SandboxConfig
from services.sandbox.overlay import VOLUME_OVERHEAD_BYTES, VOLUME_OVERHEAD_INODES


def host_free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


async def test_dd_of_20_gb_stops_at_the_quota_and_never_reaches_the_host_disk(backend, events, state_root):
    sid = await new_sandbox(backend, limits=api.Limits(disk_mb=64))
    free_before = host_free_bytes(state_root)
    r = await sh(backend, sid, "dd if=/dev/zero of=./big bs=1M count=20000; echo dd=$?; ls -l big",
                 timeout_s=600)
    out = r.stdout.decode()
    assert "No space left on device" in r.stderr.decode(), r.stderr[-500:]
    assert "dd=1" in out
    size = int(out.split()[-5])  # ls -l: ... SIZE month day time name
    assert 60 << 20 <= size <= (64 << 20) + VOLUME_OVERHEAD_BYTES, size
    # the bytes are in the sandbox's volume (a tmpfs), not on the host's disk: free space there did not drop
    # by anything like 20 GB, nor by the 64 MB written (1 GB of slack for other work on this machine)
    assert free_before - host_free_bytes(state_root) < 1 << 30
    ev = await events.wait_for(sid, "limit_exceeded", timeout=60)
    assert ev.detail == api.LimitExceeded(resource="disk", limit=64, exec_id=r.exec_id)
    # once full, nothing more fits, and the service's own writes are refused the same way
    r = await sh(backend, sid, "head -c 65536 /dev/zero > /tmp/more; echo $?")
    assert r.stdout.decode().strip() == "1" and "No space left" in r.stderr.decode()
    with pytest.raises(LimitReached, match="quota"):
        await backend.write_files(api.WriteFilesRequest(run_id=RUN, sandbox_id=sid,
                                                        files=[api.FileData(path="x", data=b"y" * 65536)]))
    # freeing space makes room again
    await sh(backend, sid, "rm big")
    await sh(backend, sid, "echo ok > small")
    assert await read(backend, sid, "small") == b"ok\n"
    # one event per exec that ended on the full disk (dd, head) and one for the refused write_files
    assert [e.detail.exec_id for e in events.of(sid, "limit_exceeded")][:2] == [ev.detail.exec_id,
                                                                               f"{sid}-e2"]
    assert len(events.of(sid, "limit_exceeded")) == 3


@needs_python
async def test_a_million_small_files_stop_at_the_inode_limit(backend, events):
    sid = await new_sandbox(backend, limits=api.Limits(inodes=5000))
    script = ("import errno, os\n"
              "os.makedirs('many', exist_ok=True)\n"
              "for i in range(1_000_000):\n"
              "    try:\n"
              "        open(f'many/{i}', 'w').close()\n"
              "    except OSError as e:\n"
              "        print(i, errno.errorcode[e.errno]); break\n"
              "else:\n"
              "    print(1_000_000, 'none')\n")
    r = await backend.exec(api.ExecRequest(run_id=RUN, sandbox_id=sid, command=api.Argv(args=["python3", "-c", script]),
                                           timeout_s=600))
    made, err = r.stdout.decode().split()
    assert err == "ENOSPC" and 4900 <= int(made) <= 5000 + VOLUME_OVERHEAD_INODES, r.stdout
    ev = await events.wait_for(sid, "limit_exceeded", timeout=60)
    assert ev.detail.resource == "inodes" and ev.detail.limit == 5000


async def test_a_fork_that_fills_its_copy_hits_its_own_quota_and_leaves_the_parent_alone(backend, events,
                                                                                         state_root):
    parent = await new_sandbox(backend, limits=api.Limits(disk_mb=32))
    await sh(backend, parent, "head -c 8M /dev/zero > base")
    fork = (await backend.fork(api.ForkRequest(run_id=RUN, source=api.FromSandbox(sandbox_id=parent)))).sandbox_id
    free_before = host_free_bytes(state_root)
    r = await sh(backend, fork, "cat /dev/zero > fill; echo $?")
    assert r.stdout.decode().strip() == "1" and "No space left" in r.stderr.decode()
    assert free_before - host_free_bytes(state_root) < 1 << 30
    assert (await events.wait_for(fork, "limit_exceeded", timeout=60)).detail.resource == "disk"
    # the fork's quota is its own: the parent still has its room (32 MB minus its 8 MB) and no event
    r = await sh(backend, parent, "head -c 16M /dev/zero > more; echo $?")
    assert r.stdout.decode().strip() == "0", r.stderr
    assert events.of(parent, "limit_exceeded") == []
    # the fork reads the parent's layer through its own, full, volume
    r = await sh(backend, fork, "wc -c < base")
    assert r.stdout.decode().strip() == str(8 << 20)


async def test_a_copying_snapshot_that_does_not_fit_is_refused_with_limit(backend):
    sid = await new_sandbox(backend, limits=api.Limits(disk_mb=16))
    await sh(backend, sid, "head -c 10M /dev/zero > f")
    await sh(backend, sid, "sleep 60", detach=True)  # a running exec: the snapshot must copy (10 MB more)
    with pytest.raises(LimitReached, match="disk quota"):
        await backend.snapshot(api.SnapshotRequest(run_id=RUN, sandbox_id=sid))
    assert (await sh(backend, sid, "wc -c < f")).stdout.decode().strip() == str(10 << 20)


async def test_quota_requests_and_config_are_checked(backend, events):
    with pytest.raises(InvalidRequest, match="limits.disk_mb=20000 exceeds this service's maximum"):
        await new_sandbox(backend, limits=api.Limits(disk_mb=20000, memory_mb=16384))
    # files have their own bound: a disk larger than the memory is fine (the cgroup holds both)
    big_disk = await new_sandbox(backend, limits=api.Limits(disk_mb=600))
    cg = backend.sandboxes[big_disk].cgroup
    name = "memory.max" if cg.version == 2 else "memory.limit_in_bytes"
    assert int(open(os.path.join(cg.dirs["unified" if cg.version == 2 else "memory"], name)).read()) == (512 + 600) << 20
    with pytest.raises(InvalidRequest, match="limits.inodes=2000000"):
        await new_sandbox(backend, limits=api.Limits(inodes=2_000_000))
    # a small memory limit without a disk limit gets a disk quota that fits in it
    sid = await new_sandbox(backend, limits=api.Limits(memory_mb=64))
    limits = events.of(sid, "created")[0].detail.limits
    assert (limits.memory_mb, limits.disk_mb, limits.inodes) == (64, 64, 32768)
    cfg = msgspec.convert({"root_dir": "/x", "default_limits": {"memory_mb": 512, "disk_mb": 1024}}, SandboxConfig)
    assert cfg.default_limits.disk_mb == 1024
