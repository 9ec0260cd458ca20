"""Load shedding of the sandbox service over a real nats-server, with real bwrap sandboxes (as root).

A burst beyond the admission bounds is answered ``overloaded`` (never a timeout), a request past its
deadline is never started, a refused create is retried with back-off by the client, and a stop with
work queued stays within its bound and leaves nothing a restart cannot reap.
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest
from sbx_bus import RUN, BusHarness

from proto import codec
from proto import sandbox as api
from services.lib.sandbox_client import SandboxClient, SandboxClientError, SandboxTimeout


def refused_client(h: BusHarness) -> SandboxClient:
    """A client that raises ``overloaded`` instead of retrying (to count the refusals)."""
    return SandboxClient(h.nc, RUN, timeout_s=60.0, retry_overloaded=False)


async def raw_request(h: BusHarness, req: object, subject: str, deadline: float) -> object:
    """``req`` sent by hand with the given deadline header; the decoded reply."""
    msg = await h.nc.request(subject, codec.encode(req), timeout=30,
                             headers={api.DEADLINE_HEADER: f"{deadline:.3f}"})
    return codec.decode(msg.data, api.AnyMessage)


async def test_a_burst_beyond_the_admission_bound_is_answered_overloaded_not_timed_out(nats_url, state_root):
    async with BusHarness(nats_url, state_root) as h:
        inst = await h.start(max_sandboxes=4, max_creating=1, max_queued_creates=2)
        c = refused_client(h)
        results = await asyncio.gather(*(c.create() for _ in range(200)), return_exceptions=True)
        made = [r.sandbox_id for r in results if isinstance(r, api.CreateReply)]
        errors = [r for r in results if not isinstance(r, api.CreateReply)]
        assert not [e for e in errors if isinstance(e, SandboxTimeout)], "a refusal must be an answer, not a silence"
        assert all(isinstance(e, SandboxClientError) and e.code == "overloaded" for e in errors), errors[:3]
        assert all(e.error.retry_after_s is not None for e in errors)
        assert 1 <= len(made) <= 4 and len(made) + len(errors) == 200
        assert all("max_sandboxes" in e.error.message or "max_creating" in e.error.message for e in errors)
        # the live sandboxes never passed the bound, and each success is one of them
        assert sorted(s.sandbox_id for s in await c.sandboxes()) == sorted(made)
        gauges = inst.ctx.gauges
        assert gauges.get("sandbox/refused_sandboxes", 0) + gauges.get("sandbox/refused_creates_queued", 0) == 200 - len(
            made)
        # at the bound, a retrying client gets its sandbox once one is destroyed
        while len(made) < 4:
            made.append((await SandboxClient(h.nc, RUN).create()).sandbox_id)
        retrying = SandboxClient(h.nc, RUN, timeout_s=30.0)
        late = asyncio.create_task(retrying.create())
        while retrying.overloaded == 0:
            await asyncio.sleep(0.02)
        assert not late.done()
        await c.destroy(made.pop())
        assert (await late).sandbox_id and retrying.retried >= 1


async def test_a_request_past_its_deadline_is_not_started(nats_url, state_root):
    async with BusHarness(nats_url, state_root) as h:
        inst = await h.start(max_creating=1, max_queued_creates=1000, max_sandboxes=1000)
        create_subject = h.client.subject_for(api.CreateRequest(run_id=RUN))
        reply = await raw_request(h, api.CreateRequest(run_id=RUN), create_subject, time.time() - 1.0)
        assert isinstance(reply, api.ErrorReply) and reply.code == "overloaded" and "deadline" in reply.message
        assert await h.client.sandboxes() == []
        # an exec past its deadline does not run: the file it would write never appears
        sid = (await h.client.create()).sandbox_id
        exec_req = api.ExecRequest(run_id=RUN, sandbox_id=sid, command=api.Shell(script="touch ran"))
        reply = await raw_request(h, exec_req, h.client.subject_for(exec_req), time.time() - 1.0)
        assert isinstance(reply, api.ErrorReply) and reply.code == "overloaded"
        with pytest.raises(FileNotFoundError):
            await h.client.read_file(sid, "ran")
        # creates that wait in the queue past their deadline are dropped unstarted, not served late
        deadline = time.time() + 0.1
        replies = await asyncio.gather(*(raw_request(h, api.CreateRequest(run_id=RUN), create_subject, deadline)
                                         for _ in range(300)))
        made = {r.sandbox_id for r in replies if isinstance(r, api.CreateReply)}
        late = [r for r in replies if isinstance(r, api.ErrorReply)]
        assert late and all(r.code == "overloaded" and "deadline" in r.message for r in late), {(r.code, r.message) for r in late}
        assert len(made) + len(late) == 300
        assert {s.sandbox_id for s in await h.client.sandboxes()} == made | {sid}
        assert inst.ctx.gauges["sandbox/refused_deadline"] == len(late) + 2


async def test_stop_stays_within_its_bound_with_work_queued(nats_url, state_root):
    drain = 3.0
    async with BusHarness(nats_url, state_root) as h:
        inst = await h.start(drain_timeout_s=drain, max_creating=1, max_queued_creates=1000, max_sandboxes=2000)
        c = refused_client(h)
        live = await asyncio.gather(*(SandboxClient(h.nc, RUN).create() for _ in range(60)))
        stuck = asyncio.create_task(c.exec(live[0].sandbox_id, "sleep 600", timeout_s=600))
        burst = [asyncio.create_task(c.create()) for _ in range(600)]
        while inst.ctx.gauges.get("sandbox/creates_queued", 0) < 50:
            await asyncio.sleep(0.01)
        old = inst.id
        t0 = time.monotonic()
        await inst.stop()
        took = time.monotonic() - t0
        h.instances.remove(inst)
        assert took <= drain + 3.0, f"stop took {took:.1f}s (bound {drain}s)"
        results = await asyncio.gather(*burst, stuck, return_exceptions=True)
        answers = [r for r in results if not isinstance(r, api.CreateReply)]
        assert not [r for r in answers if isinstance(r, SandboxTimeout)]
        assert {r.code for r in answers} <= {"overloaded", "unavailable"}, {type(r) for r in answers}
        assert any(r.code == "overloaded" and "stopping" in r.error.message for r in answers)
        # whatever the bound left behind is reaped by the next instance on the same root
        again = await h.start()
        assert await h.client.sandboxes() == []
        assert os.listdir(state_root) == [again.id]
        assert old not in again.service.backend.hierarchy.instances()
