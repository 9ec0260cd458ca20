"""The sandbox service over a real nats-server, with real bwrap sandboxes (as root, like CI).

In-process instances (a real ServiceContext each) for the API; ``rlbus service sandbox`` as a child
process for tap, crash + restart (orphans reaped and reported) and the refusal to start without bwrap.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys

import msgspec
import pytest
from opentelemetry import trace
from sbx_bus import (
    REPO,
    RUN,
    BusHarness,
    dead_letters,
    start_service,
    stop_process,
    stored_events,
    write_run_file,
)

from proto import catalog, codec, membership
from proto import sandbox as api
from services.lib.sandbox_client import SandboxClient, SandboxClientError
from services.runtime import tracing


@pytest.fixture
async def bus(nats_url, state_root):
    async with BusHarness(nats_url, state_root) as h:
        await h.start()
        yield h


async def test_create_exec_read_back(bus):
    c = bus.client
    created = await c.create(files={"in.txt": b"hello"}, env={"GREETING": "hi"}, labels={"task": "t1"})
    sid = created.sandbox_id
    assert created.instance_id == bus.instances[0].id == api.instance_of(sid)
    r = await c.exec(sid, 'cat in.txt; echo "$GREETING" >&2; printf bus > out.txt; exit 3')
    assert (r.exit_code, r.stdout, r.stderr) == (3, b"hello", b"hi\n")
    assert await c.read_file(sid, "out.txt") == b"bus"
    await c.write_files(sid, {"sub/new.txt": b"written"})
    assert (await c.exec(sid, ["cat", "sub/new.txt"])).stdout == b"written"
    [info] = await c.sandboxes()
    assert (info.sandbox_id, info.state, info.labels) == (sid, "running", {"task": "t1"})
    assert bus.instances[0].ctx.gauges["sandbox/live"] == 1.0
    await c.destroy(sid)
    with pytest.raises(SandboxClientError) as err:
        await c.exec(sid, "true")
    assert err.value.code == "not_found" and err.value.sandbox_id == sid and not err.value.instance_gone
    assert await c.sandboxes() == []


async def test_requests_run_concurrently_and_continue_the_trace(bus):
    c = bus.client
    sid = (await c.create()).sandbox_id
    # an exec that cannot finish before the test writes `go`: were requests served one at a time,
    # the create and exec below would wait behind it for ever
    slow = asyncio.create_task(c.exec(sid, "while [ ! -e go ]; do sleep 0.02; done; echo slow", timeout_s=30))
    other = (await c.create()).sandbox_id
    assert (await c.exec(other, "echo quick")).stdout == b"quick\n"
    assert not slow.done()
    await c.write_files(sid, {"go": b""})
    assert (await slow).stdout == b"slow\n"
    # the service answers inside a span parented on the request's trace context
    tracing.setup("sandbox-test")
    with tracing.span("test-request") as span:
        trace_id = span.get_span_context().trace_id
        headers: dict[str, str] = {}
        tracing.inject(headers)
        req = api.ExecRequest(run_id=RUN, sandbox_id=sid, command=api.Argv(args=["true"]))
        msg = await bus.nc.request(catalog.SANDBOX_REQUESTS.subject(RUN, bus.instances[0].id), codec.encode(req), timeout=60,
                                   headers=headers)
    assert isinstance(codec.decode(msg.data, api.ExecReply | api.ErrorReply), api.ExecReply)
    assert msg.headers and msg.headers["traceparent"].split("-")[1] == trace.format_trace_id(trace_id)
    # ... and the events it caused carry the same trace
    events_sub = await bus.js.subscribe(catalog.SANDBOX_EVENTS.subject(RUN, sid), ordered_consumer=True)
    seen = []
    while len(seen) < 5:  # created, exec started/finished (slow), exec started/finished (traced)
        seen.append(await events_sub.next_msg(timeout=60))
    await events_sub.unsubscribe()
    assert seen[-1].headers["traceparent"].split("-")[1] == trace.format_trace_id(trace_id)


async def test_fork_via_the_bus_keeps_the_parent_unchanged(bus):
    c = bus.client
    parent = (await c.create(files={"state.txt": b"parent"})).sandbox_id
    fork = await c.fork(sandbox_id=parent)
    assert fork.instance_id == api.instance_of(parent)
    await c.exec(fork.sandbox_id, "echo child > state.txt; touch only-in-fork")
    assert await c.read_file(parent, "state.txt") == b"parent"
    assert (await c.exec(parent, "test -e only-in-fork")).exit_code == 1
    await c.write_files(parent, {"state.txt": b"parent v2"})
    assert await c.read_file(fork.sandbox_id, "state.txt") == b"child\n"
    # a snapshot forks twice into independent copies
    snap = (await c.snapshot(parent)).snapshot_id
    a, b = (await c.fork(snapshot_id=snap)).sandbox_id, (await c.fork(snapshot_id=snap)).sandbox_id
    await c.write_files(a, {"state.txt": b"a"})
    assert [await c.read_file(x, "state.txt") for x in (a, b, parent)] == [b"a", b"parent v2", b"parent v2"]
    [info] = [s for s in await c.sandboxes() if s.sandbox_id == fork.sandbox_id]
    assert info.parent_id == parent


async def test_pause_and_resume_via_the_bus(bus):
    c = bus.client
    sid = (await c.create()).sandbox_id
    await c.exec(sid, "i=0; while true; do i=$((i+1)); echo $i > n; sleep 0.05; done", detach=True)
    await c.exec(sid, "while [ ! -s n ]; do sleep 0.02; done", timeout_s=60)  # the loop runs
    assert (await c.pause(sid)).state == "paused"
    assert bus.instances[0].ctx.gauges["sandbox/paused"] == 1.0
    assert [s.state for s in await c.sandboxes()] == ["paused"]
    with pytest.raises(SandboxClientError) as err:
        await c.exec(sid, "true")
    assert err.value.code == "conflict"
    frozen = await c.read_file(sid, "n")
    # a witness sandbox runs the same loop unpaused until it has written 6 values: the paused loop had as
    # long to write more, however loaded the machine
    witness = (await c.create()).sandbox_id
    await c.exec(witness, "i=0; while true; do i=$((i+1)); echo $i > n.tmp; mv n.tmp n; sleep 0.05; done", detach=True)
    await c.exec(witness, "while [ \"$(cat n 2>/dev/null || echo 0)\" -lt 6 ]; do sleep 0.02; done", timeout_s=60)
    assert await c.read_file(sid, "n") == frozen
    await c.destroy(witness)
    assert (await c.resume(sid)).state == "running"
    assert bus.instances[0].ctx.gauges["sandbox/paused"] == 0.0
    r = await c.exec(sid, f"while [ \"$(cat n)\" = '{frozen.decode().strip()}' ]; do sleep 0.05; done; echo moved",
                     timeout_s=60)
    assert r.stdout == b"moved\n"


async def test_two_instances_share_creates_and_verbs_reach_the_owner(bus):
    second = await bus.start()
    first = bus.instances[0]
    c = bus.client
    ids = [(await c.create()).sandbox_id for _ in range(24)]
    owners = {api.instance_of(s) for s in ids}
    assert owners == {first.id, second.id}  # the queue group spread them (all 24 on one: p = 2**-23)
    for sid in ids:
        r = await c.exec(sid, "hostname >/dev/null; echo $PWD")
        assert r.exit_code == 0 and r.sandbox_id == sid
    fork = await c.fork(sandbox_id=ids[-1])
    assert fork.instance_id == api.instance_of(ids[-1])
    replies = await c.list(expected=2)
    assert [r.instance_id for r in replies] == sorted([first.id, second.id])
    by_instance = {r.instance_id: {s.sandbox_id for s in r.sandboxes} for r in replies}
    assert by_instance[first.id] | by_instance[second.id] == set(ids) | {fork.sandbox_id}
    assert all(api.instance_of(s) == inst for inst, sids in by_instance.items() for s in sids)
    # an instance that is gone: its sandboxes are reported gone, not timed out
    await second.stop()
    gone = next(s for s in ids if api.instance_of(s) == second.id)
    with pytest.raises(SandboxClientError) as err:
        await c.exec(gone, "true")
    assert err.value.code == "not_found" and second.id in str(err.value) and err.value.instance_gone


async def test_malformed_requests_get_an_error_reply_and_a_dead_letter(bus):
    inst = bus.instances[0]
    subject = catalog.SANDBOX_REQUESTS.subject(RUN, inst.id)
    garbage = b"\xc1 not msgpack"
    wrong_field = msgspec.msgpack.encode({"type": "sandbox_exec", "run_id": RUN, "sandbox_id": 42,
                                          "command": {"type": "argv", "args": ["true"]}})
    misrouted = codec.encode(api.CreateRequest(run_id=RUN))
    other_run = codec.encode(api.CreateRequest(run_id="someone-else"))
    replies = []
    for subj, payload in ((subject, garbage), (subject, wrong_field), (subject, misrouted),
                          (catalog.SANDBOX_REQUESTS.subject(RUN, api.CREATE_TARGET), other_run)):
        msg = await bus.nc.request(subj, payload, timeout=60)
        replies.append(codec.decode(msg.data, api.ErrorReply))
    assert all(r.code == "invalid" for r in replies)
    assert "not valid msgpack" in replies[0].message
    assert "$.sandbox_id" in replies[1].message and "str" in replies[1].message
    assert "CreateRequest" in replies[2].message and "create subject" in replies[2].message
    assert "someone-else" in replies[3].message
    letters = await dead_letters(bus.js, 4)
    assert [letter.error_type for letter in letters] == ["DecodeError", "DecodeError", "WrongSubject", "WrongRun"]
    assert [letter.payload for letter in letters] == [garbage, wrong_field, misrouted, other_run]
    assert all(letter.service == "sandbox" for letter in letters) and letters[0].original_subject == subject
    # still serving
    sid = (await bus.client.create()).sandbox_id
    assert (await bus.client.exec(sid, "echo alive")).stdout == b"alive\n"
    assert not inst.task.done()


async def test_lifecycle_events_are_stored_in_order(bus, tmp_path, nats_url):
    c = bus.client
    sid = (await c.create(lease_ttl_s=300)).sandbox_id
    await c.exec(sid, "echo hi")
    await c.pause(sid)
    await c.resume(sid)
    snap = (await c.snapshot(sid)).snapshot_id
    child = (await c.fork(snapshot_id=snap)).sandbox_id
    await c.destroy(sid)
    events = await stored_events(bus.js, sid)
    assert [e.kind for e in events] == ["created", "exec_started", "exec_finished", "paused", "resumed",
                                        "snapshotted", "destroyed"]
    assert [e.seq for e in events] == list(range(1, 8))
    assert events[2].detail.exit_code == 0 and events[-1].detail.reason == "requested"
    assert events[5].detail.snapshot_id == snap
    forked = await stored_events(bus.js, child, until="forked")
    assert forked[0].detail.snapshot_id == snap and forked[0].detail.parent_id == sid
    # `rlbus tap` replays them as JSON lines
    cfg = write_run_file(str(tmp_path / "run.toml"), nats_url, bus.root)
    out = subprocess.run([sys.executable, "-m", "services.launcher.cli", "tap", catalog.SANDBOX_EVENTS.subject(RUN, sid),
                          "--from-start", "--count", "7", "--config", cfg],
                         cwd=REPO, capture_output=True, timeout=60, check=True)
    lines = [json.loads(line) for line in out.stdout.decode().splitlines()]
    assert [line["data"]["detail"]["type"] for line in lines] == [e.kind for e in events]
    assert all(line["data"]["sandbox_id"] == sid for line in lines)


async def test_lease_expiry_via_the_bus_is_published(bus):
    c = bus.client
    sid = (await c.create(lease_ttl_s=3.0)).sandbox_id  # long enough for the exec to reach it first
    await c.exec(sid, "sleep 60", detach=True)
    events = await stored_events(bus.js, sid)
    assert [e.kind for e in events][-2:] == ["lease_expired", "destroyed"]
    assert events[-2].detail.lease_ttl_s == 3.0 and events[-1].detail.reason == "lease_expired"
    with pytest.raises(SandboxClientError) as err:
        await c.renew_lease(sid)
    assert err.value.code == "not_found"


async def test_shutdown_finishes_in_flight_requests_then_destroys(bus):
    inst = bus.instances[0]
    c = bus.client
    sid = (await c.create()).sandbox_id
    idle = (await c.create()).sandbox_id
    running = asyncio.create_task(c.exec(sid, "sleep 1; echo finished"))
    started = await bus.js.subscribe(catalog.SANDBOX_EVENTS.subject(RUN, sid), ordered_consumer=True)
    while codec.decode((await started.next_msg(timeout=60)).data, api.SandboxEvent).kind != "exec_started":
        pass
    await started.unsubscribe()
    await inst.stop()  # stop set while the exec runs
    assert (await running).stdout == b"finished\n"
    for s in (sid, idle):
        events = await stored_events(bus.js, s)
        assert events[-1].detail.reason == "shutdown"
    assert inst.ctx.gauges["sandbox/live"] == 0.0
    with pytest.raises(SandboxClientError) as err:
        await c.create()
    assert err.value.code == "unavailable"


async def test_requests_past_the_drain_bound_are_answered_unavailable(nats_url, state_root):
    async with BusHarness(nats_url, state_root) as h:
        inst = await h.start(drain_timeout_s=3.0)  # the stuck exec (60 s) outlasts it
        sid = (await h.client.create()).sandbox_id
        stuck = asyncio.create_task(h.client.exec(sid, "sleep 60", timeout_s=60))
        sub = await h.js.subscribe(catalog.SANDBOX_EVENTS.subject(RUN, sid), ordered_consumer=True)
        while codec.decode((await sub.next_msg(timeout=60)).data, api.SandboxEvent).kind != "exec_started":
            pass
        await sub.unsubscribe()
        await inst.stop()
        with pytest.raises(SandboxClientError) as err:
            await stuck
        assert err.value.code == "unavailable" and "shut down" in str(err.value)
        assert (await stored_events(h.js, sid))[-1].detail.reason == "shutdown"


async def test_unsafe_process_backend_serves_when_chosen_explicitly(nats_url, state_root):
    async with BusHarness(nats_url, state_root) as h:
        await h.start(type="unsafe-process", bwrap_path="/nonexistent/bwrap")
        sid = (await h.client.create(files={"a": b"unsafe"})).sandbox_id
        assert (await h.client.exec(sid, "cat a")).stdout == b"unsafe"
        assert [e.kind for e in await stored_events(h.js, sid, until="exec_finished")][0] == "created"


async def test_rlbus_service_sandbox_restart_reaps_orphans(nats_url, state_root, tmp_path):
    cfg = write_run_file(str(tmp_path / "run.toml"), nats_url, state_root)
    log_path = str(tmp_path / "service.log")
    async with BusHarness(nats_url, state_root) as h:
        c: SandboxClient = h.client
        first = start_service(cfg, log_path)
        try:
            await c.wait_ready(timeout_s=60)
            ids = [(await c.create()).sandbox_id for _ in range(2)]
            await c.exec(ids[0], "sleep 300", detach=True)
            await c.pause(ids[0])
            await c.exec(ids[1], "echo x > f")
        finally:
            first.kill()  # SIGKILL: no cleanup at all
            first.wait(30)
        with pytest.raises(SandboxClientError) as err:
            await c.exec(ids[1], "true")
        assert err.value.code == "not_found" and err.value.instance_gone  # the instance died, not the episode
        heartbeats = await h.nc.subscribe(f"rlbus.{RUN}.{membership.FAMILY}.sandbox")
        second = start_service(cfg, log_path)
        try:
            ready = await c.wait_ready(timeout_s=60)
            assert ready[0].instance_id != api.instance_of(ids[0]) and ready[0].sandboxes == []
            for sid in ids:  # reported: a `destroyed` (orphan_reaped) event in the stream
                last = (await stored_events(h.js, sid))[-1]
                assert (last.detail.reason, last.seq, last.instance_id) == ("orphan_reaped", 0, api.instance_of(sid))
            beat = codec.decode((await heartbeats.next_msg(timeout=60)).data, membership.Heartbeat)
            while "sandbox/orphans_reaped" not in beat.metrics:  # beats sent while it was starting
                beat = codec.decode((await heartbeats.next_msg(timeout=60)).data, membership.Heartbeat)
            assert beat.metrics["sandbox/orphans_reaped"] == 2.0
            sid = (await c.create()).sandbox_id
            assert (await c.exec(sid, "echo ok")).stdout == b"ok\n"
        finally:
            code = stop_process(second, signal.SIGTERM)
        assert code == 0
        assert (await stored_events(h.js, sid))[-1].detail.reason == "shutdown"
    log = open(log_path).read()
    assert "reaped 2 orphaned sandboxes" in log
    assert os.listdir(state_root) == []


async def test_rlbus_service_sandbox_refuses_to_start_without_bubblewrap(nats_url, state_root, tmp_path):
    cfg = write_run_file(str(tmp_path / "run.toml"), nats_url, state_root, bwrap_path="/nonexistent/bwrap")
    proc = start_service(cfg, str(tmp_path / "service.log"))
    assert proc.wait(60) != 0
    log = open(tmp_path / "service.log").read()
    assert "bubblewrap" in log and "unsafe-process" in log
