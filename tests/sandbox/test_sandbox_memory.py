"""The instance's memory budget, and files that fill the disk quota rather than memory (real bwrap, as root).

* creates are refused ``overloaded`` once the instance's working set plus the new sandbox's reach the budget;
  the files of a destroyed parent that a fork keeps alive count against it (and show as the fork's
  ``retained_mb``) until the fork goes;
* with ``memory_mb = disk_mb`` a disk fill is ENOSPC and a ``limit_exceeded`` event, not an OOM kill, and
  every exec that ends on a full disk reports it;
* /dev/shm is inside the disk quota; /dev itself is read-only.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from sbx_helpers import RUN, Events, make_config, new_sandbox, settle, sh, started_backend

from proto import sandbox as api
from services.sandbox.backend import LimitReached, Overloaded
from services.sandbox.bwrap import BwrapBackend
from services.sandbox.config import LimitsConfig


@pytest.fixture
async def budgeted(state_root: str, events: Events) -> AsyncIterator[BwrapBackend]:
    """A backend with a 400 MiB budget whose sandboxes default to 64 MiB of memory and 200 MiB of disk."""
    cfg = make_config(state_root, memory_budget_mb=400, default_limits=LimitsConfig(memory_mb=64, disk_mb=200))
    async with started_backend(cfg, events) as b:
        yield b


async def test_creates_are_refused_past_the_budget_and_a_forks_retained_files_count(budgeted):
    b = budgeted
    with pytest.raises(LimitReached, match="exceeds this instance's memory budget"):
        await new_sandbox(b, limits=api.Limits(memory_mb=300, disk_mb=200))
    parent = await new_sandbox(b)
    r = await sh(b, parent, "head -c 100M /dev/zero > big; echo $?")
    assert r.stdout == b"0\n" and not r.oom_killed, r.stderr
    assert b.memory_used_mb() >= 95
    # 100 used + the 64 + 200 a fork may take fit in 400
    child = (await b.fork(api.ForkRequest(run_id=RUN, source=api.FromSandbox(sandbox_id=parent)))).sandbox_id
    assert (await sh(b, child, "head -c 100M /dev/zero > own; echo $?")).stdout == b"0\n"
    with pytest.raises(Overloaded, match="memory budget") as err:
        await new_sandbox(b)  # 200 used + 264 > 400
    assert err.value.reply(RUN).code == "overloaded" and err.value.retry_after_s > 0
    await b.destroy(api.DestroyRequest(run_id=RUN, sandbox_id=parent))
    await settle(b)
    # the parent is gone, its 100 MB are not: the fork reads them, they stay charged to the instance
    [info] = (await b.list(api.ListRequest(run_id=RUN))).sandboxes
    assert info.sandbox_id == child and info.retained_mb >= 95
    assert (await sh(b, child, "wc -c < big")).stdout.strip() == str(100 << 20).encode()
    assert b.memory_used_mb() >= 190
    with pytest.raises(Overloaded, match="memory budget"):
        await new_sandbox(b)
    await b.destroy(api.DestroyRequest(run_id=RUN, sandbox_id=child))
    await settle(b)
    assert b.memory_used_mb() < 50
    await new_sandbox(b)  # the memory came back with the last user of the files


async def test_a_disk_fill_with_memory_equal_to_disk_is_enospc_not_an_oom_kill(backend, events):
    sid = await new_sandbox(backend, limits=api.Limits(memory_mb=64, disk_mb=64))
    r = await sh(backend, sid, "dd if=/dev/zero of=big bs=1M count=500; echo dd=$?", timeout_s=120)
    assert not r.oom_killed and "No space left on device" in r.stderr.decode(), (r.oom_killed, r.stderr[-300:])
    assert b"dd=1" in r.stdout
    assert events.of(sid, "oom") == []
    first = await events.wait_for(sid, "limit_exceeded")
    assert first.detail == api.LimitExceeded(resource="disk", limit=64, exec_id=r.exec_id)
    # a second exec that hits the full disk reports it too
    again = await sh(backend, sid, "head -c 1M /dev/zero > more; echo $?")
    assert again.stdout == b"1\n"
    assert [e.detail.exec_id for e in events.of(sid, "limit_exceeded")] == [r.exec_id, again.exec_id]


async def test_dev_shm_is_inside_the_disk_quota_and_dev_is_read_only(backend, events):
    sid = await new_sandbox(backend, limits=api.Limits(disk_mb=32))
    r = await sh(backend, sid, "dd if=/dev/zero of=/dev/shm/x bs=1M count=200; echo dd=$?", timeout_s=120)
    assert "No space left on device" in r.stderr.decode() and b"dd=1" in r.stdout, r.stderr[-300:]
    assert (await events.wait_for(sid, "limit_exceeded")).detail.resource == "disk"
    # the bytes are in the sandbox's volume: the work directory has no room left either
    assert (await sh(backend, sid, "head -c 1M /dev/zero > w; echo $?")).stdout == b"1\n"
    r = await sh(backend, sid, "rm /dev/shm/x; touch /dev/new; echo touch=$?; echo hi > /dev/null; echo null=$?; "
                 "head -c 4 /dev/zero | wc -c")
    assert b"touch=1" in r.stdout and b"null=0" in r.stdout and r.stdout.endswith(b"4\n"), (r.stdout, r.stderr)
    assert "Read-only file system" in r.stderr.decode()
