"""snapshot / fork independence, layers, pause / resume."""

from __future__ import annotations

import asyncio
import os

import pytest
from sbx_helpers import RUN, new_sandbox, read, settle, sh

from proto import sandbox as api
from services.sandbox.backend import NotFound
from services.sandbox.overlay import mounts_under
from tests.conftest import wait_for_async


async def fork(backend, source) -> str:
    reply = await backend.fork(api.ForkRequest(run_id=RUN, source=source))
    return reply.sandbox_id


async def test_fork_of_live_sandbox_is_independent_both_ways(backend, events):
    parent = await new_sandbox(backend)
    await sh(backend, parent, "echo v1 > a.txt; mkdir d; echo keep > d/k")
    child = await fork(backend, api.FromSandbox(sandbox_id=parent))
    assert await read(backend, child, "a.txt") == b"v1\n"
    # child changes: parent untouched
    await sh(backend, child, "echo child > a.txt; echo new > b.txt; rm d/k")
    assert await read(backend, parent, "a.txt") == b"v1\n"
    assert await read(backend, parent, "b.txt") is None
    assert await read(backend, parent, "d/k") == b"keep\n"
    # parent changes: child untouched
    await sh(backend, parent, "echo parent > a.txt; echo p > c.txt")
    assert await read(backend, child, "a.txt") == b"child\n"
    assert await read(backend, child, "c.txt") is None
    assert await read(backend, child, "d/k") is None
    assert events.kinds(child)[0] == "forked"
    assert events.of(child, "forked")[0].detail.parent_id == parent
    assert "snapshotted" in events.kinds(parent)


async def test_snapshot_then_two_forks_are_independent_copies(backend):
    sid = await new_sandbox(backend)
    await sh(backend, sid, "echo base > f")
    snap = await backend.snapshot(api.SnapshotRequest(run_id=RUN, sandbox_id=sid))
    assert not snap.copied  # nothing running: O(1) layer swap
    await sh(backend, sid, "echo after > f")  # the sandbox keeps going on a fresh layer
    a = await fork(backend, api.FromSnapshot(snapshot_id=snap.snapshot_id))
    b = await fork(backend, api.FromSnapshot(snapshot_id=snap.snapshot_id))
    assert await read(backend, a, "f") == b"base\n"
    assert await read(backend, b, "f") == b"base\n"
    await sh(backend, a, "echo a > f; echo only-a > g")
    assert await read(backend, b, "f") == b"base\n" and await read(backend, b, "g") is None
    await sh(backend, b, "rm f")
    assert await read(backend, a, "f") == b"a\n"
    assert await read(backend, sid, "f") == b"after\n"
    # forks outlive their parent; the snapshot goes with the parent
    await backend.destroy(api.DestroyRequest(run_id=RUN, sandbox_id=sid))
    assert await read(backend, a, "g") == b"only-a\n"
    with pytest.raises(NotFound):
        await fork(backend, api.FromSnapshot(snapshot_id=snap.snapshot_id))


async def test_snapshot_while_processes_run_copies_and_keeps_them_running(backend):
    sid = await new_sandbox(backend)
    await sh(backend, sid, "echo before > f")
    bg = await sh(backend, sid, "sleep 30", detach=True)
    snap = await backend.snapshot(api.SnapshotRequest(run_id=RUN, sandbox_id=sid))
    assert snap.copied
    assert bg.exec_id in backend.sandboxes[sid].execs  # still running
    await sh(backend, sid, "echo after > f")
    child = await fork(backend, api.FromSnapshot(snapshot_id=snap.snapshot_id))
    assert await read(backend, child, "f") == b"before\n"


async def test_layers_are_shared_and_freed(backend):
    store = backend.layers
    sid = await new_sandbox(backend)
    parent_dir = backend.sandboxes[sid].tree.dir
    await sh(backend, sid, "echo 1 > f")
    s1 = await backend.snapshot(api.SnapshotRequest(run_id=RUN, sandbox_id=sid))
    s2 = await backend.snapshot(api.SnapshotRequest(run_id=RUN, sandbox_id=sid))  # nothing changed
    assert backend.snapshots[s1.snapshot_id].layers == backend.snapshots[s2.snapshot_id].layers
    child = await fork(backend, api.FromSnapshot(snapshot_id=s1.snapshot_id))
    (layer,) = store.home
    assert os.path.dirname(store.path(layer)) == parent_dir  # in the parent's volume
    await backend.destroy(api.DestroyRequest(run_id=RUN, sandbox_id=sid))
    # the fork still uses the layer: the parent's volume stays mounted with it, the rest of the parent goes
    await wait_for_async(lambda: sorted(os.listdir(parent_dir)) == [f"l{layer}"], 60,
                         "the parent's volume holding only the fork's layer")
    assert parent_dir in mounts_under(parent_dir)
    assert await read(backend, child, "f") == b"1\n"
    await backend.destroy(api.DestroyRequest(run_id=RUN, sandbox_id=child))
    await wait_for_async(lambda: not os.path.exists(parent_dir), 60, "the parent's volume unmounted and removed")
    assert not store.home and not store.volumes


COUNTER = "i=0; while :; do i=$((i+1)); echo $i > c.tmp; mv c.tmp counter; sleep 0.02; done"


async def counter(backend, sid) -> int:
    data = await read(backend, sid, "counter")
    return int(data) if data else 0


async def wait_above(backend, sid, value: int, timeout: float = 60.0) -> int:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while (now := await counter(backend, sid)) <= value:
        if loop.time() > end:
            raise AssertionError(f"counter stuck at {now} (wanted > {value})")
        await asyncio.sleep(0.05)
    return now


async def test_pause_stops_processes_and_resume_continues(backend, events):
    sid = await new_sandbox(backend)
    await sh(backend, sid, COUNTER, detach=True)
    await wait_above(backend, sid, 2)
    await backend.pause(api.PauseRequest(run_id=RUN, sandbox_id=sid))
    assert backend.sandboxes[sid].cgroup.is_frozen()
    frozen_at = await counter(backend, sid)
    # a witness sandbox runs the same counter unpaused to 25: the paused one had as long to count on,
    # however loaded the machine
    witness = await new_sandbox(backend)
    await sh(backend, witness, COUNTER, detach=True)
    await wait_above(backend, witness, 25)
    assert await counter(backend, sid) == frozen_at
    await backend.destroy(api.DestroyRequest(run_id=RUN, sandbox_id=witness))
    listed = await backend.list(api.ListRequest(run_id=RUN))
    assert [s.state for s in listed.sandboxes if s.sandbox_id == sid] == ["paused"]
    await backend.resume(api.ResumeRequest(run_id=RUN, sandbox_id=sid))
    await wait_above(backend, sid, frozen_at)
    assert events.kinds(sid)[-2:] == ["paused", "resumed"]


async def test_destroying_a_paused_sandbox_kills_its_processes(backend, events):
    sid = await new_sandbox(backend)
    await sh(backend, sid, COUNTER, detach=True)
    await wait_above(backend, sid, 1)
    await backend.pause(api.PauseRequest(run_id=RUN, sandbox_id=sid))
    cg = backend.sandboxes[sid].cgroup
    assert cg.pids()
    await backend.destroy(api.DestroyRequest(run_id=RUN, sandbox_id=sid))
    await settle(backend)
    assert not any(os.path.exists(d) for d in cg.dirs.values())
    assert events.kinds(sid)[-1] == "destroyed"
