"""Helpers for the sandbox tests (imported by the test modules and conftest)."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import io
import os
from collections.abc import AsyncIterator
from typing import Any

import pytest

from proto import sandbox as api
from services.sandbox.backend import BackendUnavailable
from services.sandbox.bwrap import BwrapBackend
from services.sandbox.config import SandboxConfig
from services.sandbox.warm_pool import pool_key

RUN = "sbxtest"


class Events:
    """Records every event and lets a test wait for one."""

    def __init__(self) -> None:
        self.items: list[api.SandboxEvent] = []
        self._changed = asyncio.Event()

    def __call__(self, event: api.SandboxEvent) -> None:
        self.items.append(event)
        self._changed.set()

    def kinds(self, sandbox_id: str) -> list[str]:
        return [e.kind for e in self.items if e.sandbox_id == sandbox_id]

    def of(self, sandbox_id: str, kind: str) -> list[api.SandboxEvent]:
        return [e for e in self.items if e.sandbox_id == sandbox_id and e.kind == kind]

    async def wait_for(self, sandbox_id: str, kind: str, timeout: float = 60.0) -> api.SandboxEvent:
        async def _wait() -> api.SandboxEvent:
            while not self.of(sandbox_id, kind):
                self._changed.clear()
                await self._changed.wait()
            return self.of(sandbox_id, kind)[0]

        return await asyncio.wait_for(_wait(), timeout)


def exec_pids(backend: BwrapBackend, sandbox_id: str) -> list[int]:
    """The processes in the sandbox's cgroup other than its exec server's (its bwrap monitor and pid 1)."""
    sb = backend.sandboxes[sandbox_id]
    server = {sb.server.proc.pid, sb.server.pid1} if sb.server is not None else set()
    return [p for p in sb.cgroup.pids() if p not in server]


def make_config(root: str, **kw: object) -> SandboxConfig:
    return SandboxConfig(root_dir=root, **kw)  # type: ignore[arg-type]


async def new_sandbox(backend: BwrapBackend, **kw: object) -> str:
    reply = await backend.create(api.CreateRequest(run_id=RUN, **kw))  # type: ignore[arg-type]
    return reply.sandbox_id


async def sh(backend: BwrapBackend, sandbox_id: str, script: str, **kw: object) -> api.ExecReply:
    return await backend.exec(api.ExecRequest(run_id=RUN, sandbox_id=sandbox_id, command=api.Shell(script=script),
                                              **kw))  # type: ignore[arg-type]


async def read(backend: BwrapBackend, sandbox_id: str, path: str) -> bytes | None:
    reply = await backend.read_files(api.ReadFilesRequest(run_id=RUN, sandbox_id=sandbox_id, paths=[path]))
    f = reply.files[0]
    return f.data if isinstance(f, api.FileContent) else None


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server API
        body = self.server.body  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def host_address() -> str | None:
    """A non-loopback IPv4 address of this host (a public-looking egress target), None without one: the source
    address of the route to a documentation address (a UDP connect sends nothing)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.123", 9))
        except OSError:
            return None
        ip = s.getsockname()[0]
    return None if ip.startswith(("127.", "0.", "169.254.")) else ip


needs_host_address = pytest.mark.skipif(host_address() is None, reason="this host has no non-loopback address")

needs_python = pytest.mark.skipif(not os.path.exists("/usr/bin/python3"), reason="needs /usr/bin/python3 on the host")


class PoolFirst(BwrapBackend):
    """A bwrap backend whose every create is served by its warm pool: the pool first builds one sandbox of exactly
    what the request asks for (its exec server started), and the create must then take that one (a create the
    request's checks refuse raises what the create would)."""

    async def create(self, req: api.CreateRequest) -> api.CreateReply:
        await self.pool.fill(pool_key(req, self.cfg, self._base_args, self.egress.policy), 1)
        hits = self.pool.hits
        reply = await super().create(req)
        if self.pool.hits != hits + 1:
            raise AssertionError(f"the create of {req} did not take the sandbox pooled for it")
        return reply


async def settle(backend: BwrapBackend) -> None:
    """Wait for the background work of destroyed sandboxes (processes gone, cgroup removed, volume unmounted)."""
    while backend._tasks:
        await asyncio.gather(*list(backend._tasks), return_exceptions=True)


@contextlib.asynccontextmanager
async def started_backend(cfg: Any, events: Events, cls: type[BwrapBackend] = BwrapBackend
                          ) -> AsyncIterator[BwrapBackend]:
    """A started bwrap backend of ``cfg``, closed after use (skipped where bwrap cannot run: not root)."""
    b = cls(cfg, events)
    try:
        await b.start()
    except BackendUnavailable as e:
        pytest.skip(f"bwrap backend unavailable here: {e}")
    try:
        yield b
    finally:
        await close_within(b)


#: a backend's close destroys a handful of sandboxes in well under a second here; past this it hangs
CLOSE_BOUND_S = 120.0


async def close_within(b: BwrapBackend, bound_s: float = CLOSE_BOUND_S) -> None:
    """``b.close()``, failing the test with every task's stack if it has not ended within ``bound_s``: a close that
    hangs must say where, not run into the suite's timeout."""
    closing = asyncio.create_task(b.close(), name="backend-close")
    done, _ = await asyncio.wait({closing}, timeout=bound_s)
    if done:
        return closing.result()
    stacks = []
    for task in asyncio.all_tasks():  # taken before the close is cancelled: where it waits
        out = io.StringIO()
        task.print_stack(file=out)
        stacks.append(out.getvalue())
    closing.cancel()
    pytest.fail(f"the backend's close did not end within {bound_s:.0f} s; the loop's tasks:\n" + "\n".join(stacks))
