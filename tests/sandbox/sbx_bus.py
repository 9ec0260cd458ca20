"""Helpers for the bus tests of the sandbox service: in-process instances, a client, stored events."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from typing import Any

import msgspec
import nats
import pytest

from proto import catalog, codec
from proto import sandbox as api
from proto.deadletter import DeadLetter
from services.lib.sandbox_client import SandboxClient
from services.runtime import bus
from services.runtime.config import CommonSection, Loaded, NatsSection, RunSection
from services.runtime.service import ServiceContext
from services.sandbox.config import SandboxConfig
from services.sandbox.service import SandboxService, SandboxUnavailableError

RUN = "sbxbus"
REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


class Instance:
    """One sandbox service running in this event loop with its own connection and ServiceContext."""

    def __init__(self, ctx: ServiceContext, service: SandboxService, task: asyncio.Task[None]) -> None:
        self.ctx = ctx
        self.service = service
        self.task = task

    @property
    def id(self) -> str:
        return self.service.instance_id

    async def stop(self) -> None:
        self.ctx.stop.set()
        await asyncio.wait_for(self.task, 30)
        await self.ctx.nc.close()


class BusHarness:
    """Sandbox service instances against a real nats-server, plus a client connection."""

    def __init__(self, url: str, root: str) -> None:
        self.url = url
        self.root = root
        self.instances: list[Instance] = []

    async def __aenter__(self) -> BusHarness:
        self.nc = await nats.connect(self.url)
        self.js = self.nc.jetstream()
        await bus.provision_all(self.js)
        self.client = SandboxClient(self.nc, RUN, timeout_s=30.0)
        return self

    async def start(self, drain_timeout_s: float = 5.0, **cfg: Any) -> Instance:
        config = SandboxConfig(root_dir=self.root, **cfg)
        loaded = Loaded(run=RunSection(id=RUN), nats=NatsSection(url=self.url),
                        common=CommonSection(drain_timeout_s=drain_timeout_s), service=config)
        nc = await nats.connect(self.url)
        ctx = ServiceContext("sandbox", f"test-{len(self.instances)}", loaded, nc)
        service = SandboxService.from_loaded(loaded)
        task = asyncio.create_task(service.run(ctx), name="sandbox-service-under-test")
        ready = asyncio.create_task(self.client.wait_ready(len(self.instances) + 1), name="sandbox-wait-ready")
        await asyncio.wait({task, ready}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            ready.cancel()
            await nc.close()
            if isinstance(task.exception(), SandboxUnavailableError):
                pytest.skip(f"bwrap backend unavailable here: {task.exception()}")
            task.result()
        await ready
        inst = Instance(ctx, service, task)
        self.instances.append(inst)
        return inst

    async def __aexit__(self, *exc: object) -> None:
        for inst in self.instances:
            if not inst.task.done():
                await inst.stop()
        await self.nc.close()


async def stored_events(js: Any, sandbox_id: str, until: str = "destroyed", run: str = RUN,
                        timeout: float = 60.0) -> list[api.SandboxEvent]:
    """The SANDBOX_EVENTS records of one sandbox (ordered consumer), read until an event of kind ``until``."""
    sub = await js.subscribe(catalog.SANDBOX_EVENTS.subject(run, sandbox_id), ordered_consumer=True)
    events: list[api.SandboxEvent] = []
    try:
        while not events or events[-1].kind != until:
            msg = await sub.next_msg(timeout=timeout)
            events.append(codec.decode(msg.data, api.SandboxEvent))
    finally:
        await sub.unsubscribe()
    return events


async def dead_letters(js: Any, count: int, run: str = RUN, timeout: float = 60.0) -> list[DeadLetter]:
    sub = await js.subscribe(f"rlbus.{run}.dlq.>", ordered_consumer=True)
    try:
        return [codec.decode((await sub.next_msg(timeout=timeout)).data, DeadLetter) for _ in range(count)]
    finally:
        await sub.unsubscribe()


def write_run_file(path: str, nats_url: str, root: str, **service: Any) -> str:
    """A run file for ``rlbus service sandbox`` (TOML)."""
    lines = [f'[run]\nid = "{RUN}"\n[nats]\nurl = "{nats_url}"\n[common]\ndrain_timeout_s = 5.0\nheartbeat_s = 0.5\n',
             f'[services.sandbox]\nroot_dir = "{root}"\n']
    lines += [f"{k} = {msgspec.json.encode(v).decode()}\n" for k, v in service.items()]
    with open(path, "w") as f:
        f.write("".join(lines))
    return path


def start_service(config: str, log_path: str) -> subprocess.Popen[bytes]:
    """``rlbus service sandbox --config FILE`` as a child process (output to ``log_path``)."""
    with open(log_path, "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "services.launcher.cli", "service", "sandbox", "--config", config],
                                cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": REPO})


def stop_process(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
    return proc.wait(timeout)
