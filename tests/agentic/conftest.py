"""Fixtures for the agentic tests (real nats-server, real bwrap sandbox service; see agentic_harness.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from agentic_harness import Bus, chat_tokenizer

import services.tasks.coding  # noqa: F401  (registers the coding task in this process)


@pytest.fixture(scope="session")
def tokenizer():
    return chat_tokenizer()


@pytest.fixture
async def bus(nats_url: str) -> AsyncIterator[Bus]:
    async with Bus(nats_url) as b:
        yield b
