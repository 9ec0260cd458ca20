"""Fixtures for the sandbox tests: a real bwrap backend (as root), an event recorder, a local HTTP server."""

from __future__ import annotations

import http.server
import os
import shutil
import threading
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
from sbx_helpers import Events, Handler, PoolFirst, make_config, started_backend

from services.sandbox.bwrap import BwrapBackend


@pytest.fixture
def state_root() -> Iterator[str]:
    """A root_dir the unprivileged sandbox user can traverse (pytest's tmp_path is mode 700)."""
    root = f"/var/tmp/rlbus-sandbox-test-{uuid.uuid4().hex[:8]}"
    os.makedirs(root, mode=0o711)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
async def events() -> Events:
    return Events()


@pytest.fixture(params=["server", "bwrap", "pool"])
async def backend(request: pytest.FixtureRequest, state_root: str, events: Events) -> AsyncIterator[BwrapBackend]:
    """A started backend; every test using it runs three times: each exec through the sandbox's exec server (started
    by the first exec, which waits for it); each exec through its own bubblewrap; and every created sandbox taken
    from the warm pool (built ahead for the create's exact spec, its server running: the default ``hybrid`` path
    then never starts one), its execs through that server from the first."""
    if request.param == "pool":
        async with started_backend(make_config(state_root, warm_pool=0), events, cls=PoolFirst) as b:
            yield b
        return
    async with started_backend(make_config(state_root, exec_path=request.param, warm_pool=0), events) as b:
        yield b


@pytest.fixture
def http_server_factory() -> Iterator:
    """Start HTTP servers on 127.0.0.1 or ``host`` (host side) answering a fixed body; yields
    ``start(body, host=...) -> port``."""
    servers: list[http.server.ThreadingHTTPServer] = []

    def start(body: bytes, host: str = "127.0.0.1") -> int:
        srv = http.server.ThreadingHTTPServer((host, 0), Handler)
        srv.body = body  # type: ignore[attr-defined]
        threading.Thread(target=srv.serve_forever, name="sandbox-test-http", daemon=True).start()
        servers.append(srv)
        return srv.server_address[1]

    yield start
    for srv in servers:
        srv.shutdown()
        srv.server_close()
