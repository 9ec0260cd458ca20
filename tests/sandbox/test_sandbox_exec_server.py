"""The exec server (``exec_path`` server / hybrid): what differs from one bwrap per exec.

The containment, exec, quota and fork tests run against both paths through the ``backend`` fixture; these
cover the server's own lifecycle: reuse, the hybrid hand-over, a shepherd killed from inside, a dead server,
a base without the interpreter, and the guard that keeps the server from running outside a sandbox.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
from sbx_helpers import RUN, exec_pids, make_config, new_sandbox, sh, started_backend

from proto import sandbox as api
from tests.conftest import wait_for_async

SERVER_MAIN = Path(__file__).resolve().parents[2] / "services" / "sandbox" / "exec_server_main.py"


@pytest.fixture
async def server_backend(state_root, events):
    async with started_backend(make_config(state_root, exec_path="server"), events) as b:
        yield b


async def test_execs_run_as_children_of_one_server(server_backend):
    b = server_backend
    sid = await new_sandbox(b)
    first = await sh(b, sid, "cat /proc/1/comm; echo $$")
    sb = b.sandboxes[sid]
    server = sb.server
    assert server is not None and first.stdout.split()[0] == b"python3"  # pid 1 is the server, not bwrap's init
    pids = {int(first.stdout.split()[1])}
    for _ in range(3):
        r = await sh(b, sid, "echo $$")
        pids.add(int(r.stdout))
    assert sb.server is server and len(pids) == 4  # one server, a new process per exec
    assert sorted(sb.cgroup.pids()) == sorted([server.proc.pid, server.pid1])  # nothing else left running


async def test_hybrid_starts_the_server_at_the_second_exec_and_uses_it_once_ready(state_root, events):
    async with started_backend(make_config(state_root, exec_path="hybrid"), events) as b:
        sid = await new_sandbox(b)
        sb = b.sandboxes[sid]
        first = await sh(b, sid, "cat /proc/1/comm")
        assert first.stdout == b"bwrap\n" and sb.server_start is None  # one exec: no server started
        second = await sh(b, sid, "cat /proc/1/comm")
        assert second.stdout == b"bwrap\n" and sb.server_start is not None  # its own bwrap; the server starts
        await wait_for_async(lambda: sb.server is not None, 60, "the exec server to be ready")
        later = await sh(b, sid, "cat /proc/1/comm")
        assert later.stdout == b"python3\n" and later.exit_code == 0


async def test_an_exec_that_kills_its_shepherd_leaves_nothing_behind(server_backend):
    b = server_backend
    sid = await new_sandbox(b)
    r = await sh(b, sid, "sleep 300 & kill -9 $PPID; sleep 300", timeout_s=60)
    assert not r.timed_out and r.exit_code == 137  # the shepherd's death is the exec's end
    assert r.duration_s < 30
    assert exec_pids(b, sid) == []  # both sleeps were strays of pid 1 and were killed with the shepherd's death
    assert (await sh(b, sid, "echo fine")).stdout == b"fine\n"


async def test_a_dead_server_fails_its_running_exec_and_the_next_exec_gets_a_new_one(server_backend):
    b = server_backend
    sid = await new_sandbox(b)
    await sh(b, sid, "true")
    sb = b.sandboxes[sid]
    dead = sb.server
    running = asyncio.create_task(sh(b, sid, "sleep 300", timeout_s=120))
    await wait_for_async(lambda: exec_pids(b, sid), 30, "the sleep to run")
    dead.kill()  # what an OOM kill of pid 1 does: its whole pid namespace goes
    r = await asyncio.wait_for(running, 60)
    assert r.exit_code is None and not r.timed_out
    again = await sh(b, sid, "echo again")
    assert again.stdout == b"again\n" and sb.server is not None and sb.server is not dead
    assert sb.server.pid1 != dead.pid1


async def test_a_base_without_the_interpreter_runs_every_exec_through_bwrap(state_root, events):
    cfg = make_config(state_root, exec_path="server", exec_server_python="/nonexistent/python3")
    async with started_backend(cfg, events) as b:
        sid = await new_sandbox(b)
        r = await sh(b, sid, "cat /proc/1/comm")
        assert r.stdout == b"bwrap\n" and b.sandboxes[sid].server is None


async def test_a_snapshot_restarts_the_server_on_the_new_upper_layer(server_backend):
    b = server_backend
    sid = await new_sandbox(b)
    await sh(b, sid, "echo before > f")
    old = b.sandboxes[sid].server
    snap = await b.snapshot(api.SnapshotRequest(run_id=RUN, sandbox_id=sid))
    assert not snap.copied and b.sandboxes[sid].server is None  # stopped: its mounts held the frozen layer
    await sh(b, sid, "echo after > f")
    assert b.sandboxes[sid].server is not old
    child = (await b.fork(api.ForkRequest(run_id=RUN, source=api.FromSnapshot(snapshot_id=snap.snapshot_id))))
    assert (await sh(b, child.sandbox_id, "cat f")).stdout == b"before\n"
    assert (await sh(b, sid, "cat f")).stdout == b"after\n"


def test_the_server_refuses_to_run_outside_a_sandbox():
    """It kills every child of its own that is not a shepherd: run anywhere but as pid 1 it must not start."""
    r = subprocess.run([sys.executable, "-I", "-S", str(SERVER_MAIN), "0"], capture_output=True, timeout=60)
    assert r.returncode != 0 and b"refusing to run outside a sandbox" in r.stderr


async def test_a_paused_sandbox_with_a_server_can_be_forked_and_resumed(server_backend):
    b = server_backend
    sid = await new_sandbox(b)
    await sh(b, sid, "echo kept > f")
    assert b.sandboxes[sid].server is not None
    await b.pause(api.PauseRequest(run_id=RUN, sandbox_id=sid))
    # the snapshot stops the frozen server (thawed to die, the cgroup frozen again)
    fork = await asyncio.wait_for(b.fork(api.ForkRequest(run_id=RUN, source=api.FromSandbox(sandbox_id=sid))), 60)
    sb = b.sandboxes[sid]
    assert sb.server is None and sb.state == "paused" and sb.cgroup.is_frozen() and sb.cgroup.pids() == []
    await b.resume(api.ResumeRequest(run_id=RUN, sandbox_id=sid))
    assert (await sh(b, sid, "cat f")).stdout == b"kept\n"
    assert (await sh(b, fork.sandbox_id, "cat f")).stdout == b"kept\n"
