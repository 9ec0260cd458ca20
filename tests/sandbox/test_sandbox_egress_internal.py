"""Loopback, link-local and the bus's own addresses are refused whatever a sandbox's allowlist says: at create
(an address or ``localhost`` in the allowlist, refused naming the entry) or when the sandbox connects (a name
that resolves to one); an operator's ``egress_open_internal`` opens a named one. Real bwrap sandboxes, real
HTTP servers on the host, and the real sandbox service on a real nats-server for the bus's address."""

from __future__ import annotations

from urllib.parse import urlsplit

import pytest
from sbx_bus import BusHarness
from sbx_helpers import (
    Events,
    host_address,
    make_config,
    needs_host_address,
    needs_python,
    new_sandbox,
    sh,
    started_backend,
)

from services.lib.sandbox_client import SandboxClientError
from services.sandbox.backend import InvalidRequest

FETCH = """
import sys, urllib.request
try:
    print(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())
except Exception as e:
    print("FAILED", e)
"""

INTERNAL = {
    "127.0.0.1:4222": "loopback",
    "127.9.9.9:80": "loopback",
    "[::1]:4222": "loopback",
    "[::ffff:127.0.0.1]:4222": "loopback",
    "0.0.0.0:4222": "this-host",
    "localhost:8222": "localhost",
    "api.localhost:80": "localhost",
    "169.254.169.254:80": "link-local",  # cloud metadata
    "[fe80::1]:80": "link-local",
}


async def test_internal_entries_are_refused_at_create_naming_the_entry(backend):
    for entry, why in INTERNAL.items():
        with pytest.raises(InvalidRequest) as err:
            await new_sandbox(backend, egress=["pypi.org:443", entry])
        text = str(err.value)
        host = entry.rpartition(":")[0].strip("[]")
        assert host in text and why in text and "egress_open_internal" in text, (entry, text)
    assert backend.sandboxes == {}  # nothing was created
    await new_sandbox(backend, egress=["pypi.org:443", "10.1.2.3:3128"])  # a public or private name still may


@needs_python
async def test_a_name_that_resolves_to_loopback_is_refused_when_connecting(backend, events, http_server_factory):
    port = http_server_factory(b"host-secret")
    sid = await new_sandbox(backend, egress=[f"127.1:{port}"])  # not an address literal: resolved when used
    r = await sh(backend, sid, f"python3 -c '{FETCH}' http://127.1:{port}/x")
    assert b"host-secret" not in r.stdout and b"403" in r.stdout
    [refused] = events.of(sid, "egress_refused")
    assert (refused.detail.host, refused.detail.port) == ("127.1", port)
    assert "loopback address 127.0.0.1" in refused.detail.reason


@needs_python
async def test_an_operator_opens_a_named_internal_target(state_root, http_server_factory):
    opened = http_server_factory(b"mirror-body")
    closed = http_server_factory(b"host-secret")
    events = Events()
    async with started_backend(make_config(state_root, egress_open_internal=[f"127.0.0.1:{opened}"]), events) as b:
        with pytest.raises(InvalidRequest, match=f"'127.0.0.1:{closed}' is a loopback address"):
            await new_sandbox(b, egress=[f"127.0.0.1:{opened}", f"127.0.0.1:{closed}"])
        sid = await new_sandbox(b, egress=[f"127.0.0.1:{opened}"])
        r = await sh(b, sid, f"python3 -c '{FETCH}' http://127.0.0.1:{opened}/x")
        assert r.stdout.strip() == b"mirror-body"


@needs_host_address
async def test_the_bus_is_refused_through_the_service(nats_url, state_root, http_server_factory):
    """The real sandbox service on the run's nats-server: the bus's own address:port is refused at create,
    also as this host's public-looking address at the bus's port; another port of that address still works."""
    ip = host_address()
    bus_port = urlsplit(nats_url).port
    async with BusHarness(nats_url, state_root) as h:
        await h.start()
        for entry in (f"127.0.0.1:{bus_port}", f"{ip}:{bus_port}"):
            with pytest.raises(SandboxClientError) as err:
                await h.client.create(egress=[entry])
            assert err.value.code == "invalid" and entry in str(err.value), str(err.value)
        box = await h.client.create(egress=[f"{ip}:{http_server_factory(b'ok', host=ip)}"])
        await h.client.destroy(box.sandbox_id)
