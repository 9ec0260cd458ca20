"""Fixtures for weightsync tests: a connected NATS client on the per-test nats-server, small state dicts."""

from __future__ import annotations

import nats
import pytest


@pytest.fixture
async def nc(nats_url):
    client = await nats.connect(nats_url, max_reconnect_attempts=0)
    try:
        yield client
    finally:
        await client.close()
