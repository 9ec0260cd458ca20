"""A real nats-server started with the generated per-service users, and logins that record violations."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import pytest

from proto import catalog
from services.launcher.auth import AuthBundle, generate_auth
from services.runtime import bus
from services.runtime.natsd import EmbeddedNats

RUN = "r1"
OTHER_RUN = "r2"
RELAY = "node-a"
SERVICES = ("trainer", "rollout", "judge", "sandbox", "weightsync", "echo")


class Login:
    """One role's connection; every permissions violation the server reports is kept in ``violations``."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.violations: list[str] = []
        self.errors: list[str] = []
        self._changed = asyncio.Event()
        self.nc: nats.aio.client.Client | None = None

    async def on_error(self, e: Exception) -> None:
        text = str(e).lower()
        (self.violations if "permissions violation" in text else self.errors).append(text)
        self._changed.set()

    @property
    def js(self):
        return self.nc.jetstream(timeout=5.0)

    async def violation(self, kind: str, subject: str, timeout: float = 5.0) -> str:
        """Wait until the server has refused ``kind`` ("publish"/"subscription") to ``subject``."""
        want = f'permissions violation for {kind} to "{subject.lower()}"'
        async with asyncio.timeout(timeout):
            while True:
                for v in self.violations:
                    if want in v:
                        return v
                self._changed.clear()
                await self._changed.wait()

    def assert_clean(self) -> None:
        assert self.violations == [], f"{self.role} was refused legitimate operations: {self.violations}"


@pytest.fixture
def bundle(tmp_path: Path) -> AuthBundle:
    return generate_auth(tmp_path / "run", SERVICES, run_id=RUN, relay_scopes=(RELAY,), max_payload=8 * 1024 * 1024)


@pytest.fixture
async def server(tmp_path: Path, bundle: AuthBundle) -> AsyncIterator[EmbeddedNats]:
    """The server with the bundle's users; the launcher provisions the catalog first (as ``rlbus up`` does)."""
    srv = EmbeddedNats(tmp_path / "nats", port=None, config_file=bundle.server_config)
    srv.start()
    try:
        nc = await nats.connect(srv.url, allow_reconnect=False,
                                **bundle.for_role("launcher").connect_kwargs())
        js = nc.jetstream(timeout=10.0)
        await bus.provision_all(js)
        await bus.ensure_stream(js, catalog.SANDBOX_EVENTS_STREAM)
        await nc.close()
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def login(server: EmbeddedNats, bundle: AuthBundle):
    """``async with login(role) as c``: a connection as ``role`` (``c.nc``, ``c.js``, ``c.violations``)."""

    @contextlib.asynccontextmanager
    async def connect(role: str, bundle_: AuthBundle | None = None) -> AsyncIterator[Login]:
        c = Login(role)
        creds = (bundle_ or bundle).for_role(role)
        c.nc = await nats.connect(server.url, name=f"test-{role}", allow_reconnect=False, error_cb=c.on_error,
                                  **creds.connect_kwargs())
        try:
            yield c
        finally:
            if not c.nc.is_closed:
                await c.nc.close()

    return connect
