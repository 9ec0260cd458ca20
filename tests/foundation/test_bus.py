"""The runtime against a real nats-server: provisioning, ack policy, dead letters, drain."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import msgspec
import nats
import pytest
from nats.js.errors import NotFoundError

from proto import catalog, codec
from proto.deadletter import DeadLetter
from proto.echo import EchoReply, EchoRequest
from services.echo.config import EchoConfig
from services.echo.service import EchoService
from services.runtime import bus
from services.runtime.config import CommonSection, Loaded, NatsSection, RunSection
from services.runtime.natsd import EmbeddedNats
from services.runtime.service import CONFIG_ERROR_EXIT, ServiceContext
from tests.conftest import wait_for_async

RUN = "t1"


async def consumer_counts(js) -> tuple[int, int] | None:
    """(delivered and not yet acked, not yet delivered) on the echo service's durable consumer
    (None until the service has created it)."""
    try:
        info = await js.consumer_info("ECHO", f"echo-{RUN}")
    except NotFoundError:
        return None
    return info.num_ack_pending, info.num_pending


async def consumer_settled(js) -> bool:
    return await consumer_counts(js) == (0, 0)


async def picked_up(js, n: int) -> bool:
    """All ``n`` published requests are delivered to the service and in progress."""
    return await consumer_counts(js) == (n, 0)


async def test_provisioning_is_idempotent(nats_url):
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    await bus.provision_all(js)
    first = {n: (await js.stream_info(n)).config for n in catalog.STREAMS}
    await bus.provision_all(js)
    second = {n: (await js.stream_info(n)).config for n in catalog.STREAMS}
    assert first == second
    assert set(first) >= {"PROMPTS", "ROLLOUTS", "TRAJECTORIES", "DLQ", "METRICS"}
    c1 = await bus.ensure_consumer(js, catalog.ROLLOUT_PROMPTS.for_run(RUN))
    c2 = await bus.ensure_consumer(js, catalog.ROLLOUT_PROMPTS.for_run(RUN))
    assert c1.config.durable_name == c2.config.durable_name == f"rollout-{RUN}"
    assert c1.config.filter_subject == f"rlbus.{RUN}.prompts"
    # a changed definition is applied to the existing stream, not an error
    changed = msgspec.structs.replace(catalog.METRICS_STREAM, max_age_s=3600.0)
    info = await bus.ensure_stream(js, changed)
    assert info.config.max_age == 3600.0
    kv1 = await bus.ensure_kv(js, catalog.MEMBERS)
    kv2 = await bus.ensure_kv(js, catalog.MEMBERS)
    assert kv1._name == kv2._name
    await nc.close()


async def test_a_store_too_small_for_a_reservation_says_how_to_make_room(tmp_path):
    """A real nats-server whose store limit (here set in its config; by default 75% of the free disk) is below
    SANDBOX_EVENTS' reserved max_bytes: provisioning fails naming the stream and how to make room."""
    conf = tmp_path / "small.conf"
    conf.write_text("jetstream { max_file_store: 1MB }\n")  # its store directory comes with -sd
    with EmbeddedNats(tmp_path / "nats", port=None, config_file=conf) as server:
        nc = await nats.connect(server.url)
        try:
            with pytest.raises(bus.BusError) as e:
                await bus.ensure_stream(nc.jetstream(), catalog.SANDBOX_EVENTS_STREAM)
        finally:
            await nc.close()
    text = str(e.value)
    assert "SANDBOX_EVENTS" in text and "insufficient storage" in text
    assert "free disk space" in text and "max_file_store" in text


class EchoHarness:
    """An echo service running in this event loop, plus a client connection."""

    def __init__(self, url: str, concurrency: int = 4) -> None:
        self.url = url
        self.concurrency = concurrency

    async def __aenter__(self):
        self.nc = await nats.connect(self.url)
        self.js = self.nc.jetstream()
        await bus.provision_all(self.js)
        loaded = Loaded(run=RunSection(id=RUN), nats=NatsSection(url=self.url),
                        common=CommonSection(drain_timeout_s=5.0), service=EchoConfig())
        self.svc_nc = await nats.connect(self.url)
        self.ctx = ServiceContext("echo", "echo-test", loaded, self.svc_nc)
        self.task = asyncio.create_task(EchoService(EchoConfig(concurrency=self.concurrency)).run(self.ctx))
        self.replies: asyncio.Queue = asyncio.Queue()
        self.letters: asyncio.Queue = asyncio.Queue()

        async def on_reply(m):
            await self.replies.put(codec.decode(m.data, EchoReply))

        async def on_letter(m):
            await self.letters.put(codec.decode(m.data, DeadLetter))

        await self.nc.subscribe(f"rlbus.{RUN}.echo.out", cb=on_reply)
        await self.nc.subscribe(f"rlbus.{RUN}.dlq.>", cb=on_letter)
        await self.nc.flush()
        return self

    async def send(self, payload: bytes | EchoRequest, subject: str | None = None) -> None:
        data = payload if isinstance(payload, bytes) else codec.encode(payload)
        await self.js.publish(subject or f"rlbus.{RUN}.echo.in", data)

    async def __aexit__(self, *exc):
        self.ctx.stop.set()
        await asyncio.wait_for(self.task, 20)
        await self.svc_nc.close()
        await self.nc.close()


async def test_malformed_message_is_dead_lettered_and_service_keeps_serving(nats_url):
    async with EchoHarness(nats_url) as h:
        await h.send(b"\x92\x01not-an-echo-request")
        await h.send(msgspec.msgpack.encode({"run_id": RUN, "text": 42}))
        await h.send(EchoRequest(run_id=RUN, text="still alive"))
        reply = await asyncio.wait_for(h.replies.get(), 10)
        assert reply.text == "still alive"
        letters = [await asyncio.wait_for(h.letters.get(), 10) for _ in range(2)]
        reasons = sorted(letter.reason for letter in letters)
        assert any("$.text" in r and "str" in r for r in reasons), reasons
        assert all(letter.error_type == "DecodeError" and letter.original_subject == f"rlbus.{RUN}.echo.in"
                   for letter in letters)
        assert {letter.payload for letter in letters} == {b"\x92\x01not-an-echo-request",
                                                          msgspec.msgpack.encode({"run_id": RUN, "text": 42})}
        # the dead letters are stored in the DLQ stream too
        info = await h.js.stream_info("DLQ")
        assert info.state.messages == 2


async def test_wrong_run_is_rejected_with_reason(nats_url):
    async with EchoHarness(nats_url) as h:
        await h.send(EchoRequest(run_id="other-run", text="hi"))
        letter = await asyncio.wait_for(h.letters.get(), 10)
        assert letter.error_type == "WrongRun" and "other-run" in letter.reason


async def test_transient_failure_is_redelivered(nats_url):
    async with EchoHarness(nats_url) as h:
        await h.send(EchoRequest(run_id=RUN, text="flaky", fail_times=2))
        reply = await asyncio.wait_for(h.replies.get(), 15)
        assert reply.text == "flaky" and reply.deliveries == 3
        assert h.letters.empty()


async def test_poison_message_is_terminated_after_max_deliver(nats_url):
    async with EchoHarness(nats_url) as h:
        await h.send(EchoRequest(run_id=RUN, text="poison pill"))
        await h.send(EchoRequest(run_id=RUN, text="after"))
        letter = await asyncio.wait_for(h.letters.get(), 20)
        assert letter.deliveries == catalog.ECHO_IN.max_deliver
        assert "poison pill" in letter.reason and letter.error_type == "RuntimeError"
        assert (await asyncio.wait_for(h.replies.get(), 10)).text == "after"
        # the ack follows the reply: wait for it to land
        await wait_for_async(lambda: consumer_settled(h.js), 5, "the echo consumer to have nothing pending")


async def test_sigterm_drains_within_bound(nats_url, tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text(f'[run]\nid = "{RUN}"\n[nats]\nurl = "{nats_url}"\n[common]\ndrain_timeout_s = 8.0\n'
                   "[services.echo]\nconcurrency = 4\n")
    proc = subprocess.Popen([sys.executable, "-m", "services.launcher.cli", "service", "echo", "--config", str(cfg)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ})
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    await bus.provision_all(js)
    replies: asyncio.Queue = asyncio.Queue()

    async def on_reply(m):
        await replies.put(codec.decode(m.data, EchoReply))

    await nc.subscribe(f"rlbus.{RUN}.echo.out", cb=on_reply)
    # wait for the service's heartbeat: it is up
    hb = await nc.subscribe(f"rlbus.{RUN}.heartbeat.echo")
    await hb.next_msg(timeout=30)
    for i in range(3):
        await js.publish(f"rlbus.{RUN}.echo.in", codec.encode(EchoRequest(run_id=RUN, text=f"slow{i}", work_s=2.0)))
    # the service has taken all three before the signal
    await wait_for_async(lambda: picked_up(js, 3), 10, "the service to take the 3 requests")
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code = await asyncio.to_thread(proc.wait, 30)
    elapsed = time.monotonic() - t0
    out = proc.stdout.read().decode()
    assert code == 0, out
    assert elapsed < 8.0 + 5.0, out
    got = sorted([(await asyncio.wait_for(replies.get(), 5)).text for _ in range(3)])
    assert got == ["slow0", "slow1", "slow2"]  # in-flight work finished, not abandoned
    assert "SIGTERM received" in out
    await nc.close()


async def test_sigterm_past_bound_abandons_work_for_redelivery(nats_url, tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text(f'[run]\nid = "{RUN}"\n[nats]\nurl = "{nats_url}"\n[common]\ndrain_timeout_s = 1.0\n')
    proc = subprocess.Popen([sys.executable, "-m", "services.launcher.cli", "service", "echo", "--config", str(cfg)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    await bus.provision_all(js)
    hb = await nc.subscribe(f"rlbus.{RUN}.heartbeat.echo")
    await hb.next_msg(timeout=30)
    await js.publish(f"rlbus.{RUN}.echo.in", codec.encode(EchoRequest(run_id=RUN, text="long", work_s=60.0)))
    await wait_for_async(lambda: picked_up(js, 1), 10, "the service to take the request")
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(proc.wait, 30) == 0
    assert time.monotonic() - t0 < 1.0 + 5.0
    info = await js.consumer_info("ECHO", f"echo-{RUN}")
    # naked back: available for another instance right away
    assert info.num_ack_pending + info.num_pending == 1 and info.num_redelivered >= 0
    await nc.close()


def test_bad_config_value_names_key(tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text('[services.echo]\nconcurrency = "lots"\n')
    r = subprocess.run([sys.executable, "-m", "services.launcher.cli", "service", "echo", "--config", str(cfg)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == CONFIG_ERROR_EXIT  # supervisors do not restart it
    assert "services.echo.concurrency" in r.stderr and "int" in r.stderr
    cfg.write_text("[services.echo]\nconcurrency = 2\n")
    r = subprocess.run([sys.executable, "-m", "services.launcher.cli", "service", "echo", "--config", str(cfg),
                        "--set", "services.echo.concurency=3"], capture_output=True, text=True, timeout=60)
    assert r.returncode == CONFIG_ERROR_EXIT and "services.echo.concurency" in r.stderr and "unknown key" in r.stderr
