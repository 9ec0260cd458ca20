"""exec: exit codes, stdout/stderr/stdin, environment, timeouts, output caps, files."""

from __future__ import annotations

import os

import pytest
from sbx_helpers import RUN, exec_pids, new_sandbox, read, sh

from proto import sandbox as api
from services.sandbox.backend import Conflict, InvalidRequest, NotFound


async def test_exit_code_stdout_stderr_stdin(backend, events):
    sid = await new_sandbox(backend)
    r = await sh(backend, sid, "cat; echo out; echo err >&2; exit 7", stdin=b"from-stdin\n")
    assert r.exit_code == 7
    assert r.stdout == b"from-stdin\nout\n"
    assert r.stderr == b"err\n"
    assert not r.timed_out and not r.stdout_truncated and not r.stderr_truncated
    argv = await backend.exec(api.ExecRequest(run_id=RUN, sandbox_id=sid, command=api.Argv(args=["printf", "%s|", "a b", "c"])))
    assert (argv.exit_code, argv.stdout) == (0, b"a b|c|")
    kinds = events.kinds(sid)
    assert kinds == ["created", "exec_started", "exec_finished", "exec_started", "exec_finished"]
    finished = events.of(sid, "exec_finished")[0].detail
    assert finished.exit_code == 7 and finished.duration_s > 0 and finished.stdout_bytes == len(r.stdout)
    assert [e.seq for e in events.items if e.sandbox_id == sid] == [1, 2, 3, 4, 5]


async def test_runs_as_unprivileged_root_in_workdir_with_scrubbed_env(backend):
    os.environ["RLBUS_TEST_SECRET"] = "leak"
    try:
        sid = await new_sandbox(backend, env={"MINE": "yes"})
        r = await sh(backend, sid, "id -u; pwd; env; grep -E '^(CapEff|NoNewPrivs)' /proc/self/status; "
                                   "unshare -U true 2>/dev/null && echo NESTED-USERNS", env={"PER_EXEC": "1"})
    finally:
        del os.environ["RLBUS_TEST_SECRET"]
    out = r.stdout.decode()
    lines = out.splitlines()
    assert lines[0] == "0" and lines[1] == "/workspace"
    assert "MINE=yes" in out and "PER_EXEC=1" in out and "HOME=/workspace" in out
    assert "RLBUS_TEST_SECRET" not in out and "VIRTUAL_ENV" not in out
    assert "CapEff:\t0000000000000000" in out and "NoNewPrivs:\t1" in out
    assert "NESTED-USERNS" not in out  # --disable-userns: no root-in-a-new-namespace tricks


async def test_timeout_kills_and_reports(backend, events):
    sid = await new_sandbox(backend)
    r = await sh(backend, sid, "echo started; sleep 30 & sleep 30", timeout_s=3.0)  # time to print
    assert r.timed_out
    assert r.exit_code == 137
    assert r.stdout == b"started\n"  # output before the kill is kept
    assert r.duration_s < 29
    assert events.of(sid, "timeout")[0].detail.timeout_s == 3.0
    assert events.of(sid, "exec_finished")[0].detail.timed_out
    assert exec_pids(backend, sid) == []  # the background sleep died with the exec (its pid namespace or shepherd)


async def test_output_caps(backend):
    sid = await new_sandbox(backend)
    r = await sh(backend, sid, "head -c 100000 /dev/zero; echo small >&2", max_output_bytes=1000)
    assert len(r.stdout) == 1000 and r.stdout_truncated
    assert r.stderr == b"small\n" and not r.stderr_truncated
    assert r.exit_code == 0


async def test_files_round_trip_and_symlinks_not_followed(backend):
    sid = await new_sandbox(backend, files=[api.FileData(path="src/a.py", data=b"print(1)\n")])
    await backend.write_files(api.WriteFilesRequest(run_id=RUN, sandbox_id=sid, files=[
        api.FileData(path="/workspace/run.sh", data=b"#!/bin/sh\necho ran\n", mode=0o755),
        api.FileData(path="/tmp/t.txt", data=b"tmp"),
    ]))
    r = await sh(backend, sid, "cat src/a.py; ./run.sh; cat /tmp/t.txt; stat -c %u src/a.py; echo x > made.txt")
    assert r.stdout == b"print(1)\nran\ntmp0\n"
    assert await read(backend, sid, "made.txt") == b"x\n"
    # a symlink planted by the sandbox must not lead the service (root, on the host) outside
    await sh(backend, sid, "ln -s /etc evil; ln -s /etc/hostname evil2")
    assert await read(backend, sid, "evil2") is None
    with pytest.raises(InvalidRequest):
        await backend.write_files(api.WriteFilesRequest(run_id=RUN, sandbox_id=sid, files=[
            api.FileData(path="evil/owned", data=b"x")]))
    with pytest.raises(InvalidRequest):
        await backend.write_files(api.WriteFilesRequest(run_id=RUN, sandbox_id=sid, files=[
            api.FileData(path="../escape", data=b"x")]))
    reply = await backend.read_files(api.ReadFilesRequest(run_id=RUN, sandbox_id=sid, paths=["/etc/passwd", "nope"]))
    assert all(isinstance(f, api.FileError) for f in reply.files)
    big = await backend.read_files(api.ReadFilesRequest(run_id=RUN, sandbox_id=sid, paths=["src/a.py"], max_bytes=3))
    assert big.files[0].data == b"pri" and big.files[0].truncated and big.files[0].size == 9


async def test_detached_exec_reports_finish(backend, events):
    sid = await new_sandbox(backend)
    r = await sh(backend, sid, "sleep 0.2; echo done > flag; exit 4", detach=True)
    assert r.detached and r.exit_code is None
    ev = await events.wait_for(sid, "exec_finished")
    assert ev.detail.exit_code == 4 and ev.detail.exec_id == r.exec_id
    assert await read(backend, sid, "flag") == b"done\n"


async def test_unknown_and_destroyed_sandboxes(backend, events):
    with pytest.raises(NotFound):
        await sh(backend, "nothere-00000000", "true")
    sid = await new_sandbox(backend)
    await backend.destroy(api.DestroyRequest(run_id=RUN, sandbox_id=sid))
    assert events.kinds(sid)[-1] == "destroyed"
    with pytest.raises(NotFound):
        await sh(backend, sid, "true")
    listed = await backend.list(api.ListRequest(run_id=RUN))
    assert sid not in [s.sandbox_id for s in listed.sandboxes]


async def test_exec_on_paused_sandbox_is_a_conflict(backend):
    sid = await new_sandbox(backend)
    await backend.pause(api.PauseRequest(run_id=RUN, sandbox_id=sid))
    with pytest.raises(Conflict):
        await sh(backend, sid, "true")
    await backend.resume(api.ResumeRequest(run_id=RUN, sandbox_id=sid))
    assert (await sh(backend, sid, "true")).exit_code == 0


async def test_request_validation(backend):
    with pytest.raises(InvalidRequest):
        await backend.create(api.CreateRequest(run_id=RUN, limits=api.Limits(memory_mb=10**7)))
    with pytest.raises(InvalidRequest):
        await backend.create(api.CreateRequest(run_id=RUN, base="no-such-image"))
    with pytest.raises(InvalidRequest):
        await backend.create(api.CreateRequest(run_id=RUN, egress=["no-port"]))
    sid = await new_sandbox(backend)
    with pytest.raises(InvalidRequest):
        await sh(backend, sid, "true", timeout_s=10**6)
