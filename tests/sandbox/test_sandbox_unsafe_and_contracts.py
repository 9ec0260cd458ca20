"""The unsafe-process backend, the wire contracts (proto.sandbox) and the config section."""

from __future__ import annotations

import logging

import msgspec
import pytest
from sbx_helpers import RUN, Events, read, sh

from proto import catalog
from proto import sandbox as api
from services.sandbox.backend import InvalidRequest, create_backend, dispatch
from services.sandbox.config import LimitsConfig, SandboxConfig
from services.sandbox.unsafe import UnsafeProcessBackend
from tests.conftest import wait_for_async


@pytest.fixture
async def unsafe(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="rlbus.sandbox.unsafe")
    events = Events()
    b = create_backend(SandboxConfig(type="unsafe-process", root_dir=str(tmp_path / "root")), events)
    assert isinstance(b, UnsafeProcessBackend)
    await b.start()
    try:
        yield b, events
    finally:
        await b.close()


async def test_unsafe_backend_warns_loudly_and_works(unsafe, caplog):
    b, events = unsafe
    assert any("UNSAFE" in r.getMessage() for r in caplog.get_records("setup"))  # at start
    sid = (await b.create(api.CreateRequest(run_id=RUN, files=[api.FileData(path="a", data=b"1")]))).sandbox_id
    assert "UNSAFE" in caplog.text  # on every create
    r = await sh(b, sid, "cat a; echo e >&2; exit 2")
    assert (r.exit_code, r.stdout, r.stderr) == (2, b"1", b"e\n")
    t = await sh(b, sid, "sleep 20", timeout_s=0.3)
    assert t.timed_out and t.exit_code == 137
    child = (await b.fork(api.ForkRequest(run_id=RUN, source=api.FromSandbox(sandbox_id=sid)))).sandbox_id
    await sh(b, child, "echo 2 > a")
    assert await read(b, sid, "a") == b"1" and await read(b, child, "a") == b"2\n"
    await sh(b, sid, "while :; do echo x >> log; sleep 0.02; done", detach=True)
    await wait_for_async(lambda: read(b, sid, "log"), 60, "the detached loop to write its log")
    await b.pause(api.PauseRequest(run_id=RUN, sandbox_id=sid))
    frozen = await read(b, sid, "log")
    # a witness sandbox runs the same loop unpaused until it has written 15 lines: the paused loop had as
    # long to write more, however loaded the machine
    witness = (await b.create(api.CreateRequest(run_id=RUN))).sandbox_id
    await sh(b, witness, "while :; do echo x >> log; sleep 0.02; done", detach=True)

    async def witness_wrote() -> bool:
        return (await read(b, witness, "log") or b"").count(b"\n") >= 15

    await wait_for_async(witness_wrote, 60, "the witness loop to write 15 lines")
    assert await read(b, sid, "log") == frozen
    await b.destroy(api.DestroyRequest(run_id=RUN, sandbox_id=witness))
    await b.resume(api.ResumeRequest(run_id=RUN, sandbox_id=sid))

    async def grown() -> bool:
        return len(await read(b, sid, "log") or b"") > len(frozen)

    await wait_for_async(grown, 60, "the loop to write again after resume")
    await b.destroy(api.DestroyRequest(run_id=RUN, sandbox_id=sid))
    assert events.kinds(sid)[0] == "created" and events.kinds(sid)[-1] == "destroyed"
    assert "timeout" in events.kinds(sid)


async def test_dispatch_maps_requests_to_verbs(unsafe):
    b, _ = unsafe
    reply = await dispatch(b, api.CreateRequest(run_id=RUN))
    assert isinstance(reply, api.CreateReply)
    listed = await dispatch(b, api.ListRequest(run_id=RUN))
    assert [s.sandbox_id for s in listed.sandboxes] == [reply.sandbox_id]
    with pytest.raises(InvalidRequest):
        dispatch(b, api.ListReply(run_id=RUN, instance_id="x", sandboxes=[]))


def test_every_request_and_reply_round_trips_through_msgpack():
    samples = [
        api.CreateRequest(run_id=RUN, limits=api.Limits(memory_mb=64), egress=["pypi.org:443"],
                          files=[api.FileData(path="a", data=b"\x00\xff")]),
        api.ExecRequest(run_id=RUN, sandbox_id="i-1", command=api.Argv(args=["ls"]), stdin=b"x"),
        api.ExecRequest(run_id=RUN, sandbox_id="i-1", command=api.Shell(script="ls"), detach=True),
        api.ForkRequest(run_id=RUN, source=api.FromSnapshot(snapshot_id="i-snap-1")),
        api.ReadFilesReply(run_id=RUN, sandbox_id="i-1", files=[api.FileContent(path="a", data=b"1", size=1),
                                                                 api.FileError(path="b", error="nope")]),
        api.SandboxEvent(run_id=RUN, sandbox_id="i-1", instance_id="i", seq=3,
                         detail=api.ExecFinished(exec_id="i-1-e1", exit_code=0, duration_s=0.1)),
        api.ErrorReply(run_id=RUN, code="not_found", message="gone"),
    ]
    for msg in samples:
        data = msgspec.msgpack.encode(msg)
        assert msgspec.msgpack.decode(data, type=api.AnyMessage) == msg
    op = msgspec.msgpack.decode(msgspec.msgpack.encode(samples[1]), type=api.InstanceRequest)
    assert isinstance(op, api.ExecRequest)
    assert samples[5].kind == "exec_finished"
    assert set(api.REPLY_TYPES) >= {type(m) for m in samples if type(m).__name__.endswith("Request")}
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode({"type": "sandbox_create", "run_id": RUN,
                                                       "limits": {"memory_mb": 1}}), type=api.CreateRequest)


def test_subjects_and_stream_definition():
    assert catalog.SANDBOX_REQUESTS.subject("r1", api.CREATE_TARGET) == "rlbus.r1.sandbox.api.create"
    assert catalog.SANDBOX_REQUESTS.subject("r1", "ab12") == "rlbus.r1.sandbox.api.ab12"
    assert catalog.SANDBOX_EVENTS.subject("r1", "ab12-0000beef") == "rlbus.r1.sandbox.events.ab12-0000beef"
    assert api.instance_of("ab12-snap-0000beef") == "ab12"
    stream = catalog.SANDBOX_EVENTS_STREAM
    assert stream.retention == "limits" and stream.subjects == ["rlbus.*.sandbox.events.>"]


def test_config_defaults_and_validation():
    cfg = msgspec.convert({"root_dir": "/var/lib/x", "default_limits": {"memory_mb": 256}}, SandboxConfig)
    assert cfg.type == "bwrap" and cfg.default_limits == LimitsConfig(memory_mb=256)
    for bad in ({"instance_id": "Has-Dash"}, {"workdir": "/"}, {"default_limits": {"pids": 10**6}},
                {"images": {"host": "/x"}}, {"typo_key": 1}, {"type": "docker"}):
        with pytest.raises(msgspec.ValidationError):
            msgspec.convert(bad, SandboxConfig)
