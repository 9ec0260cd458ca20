"""Shared fixtures: a real nats-server with JetStream on a free port."""

from __future__ import annotations

import os

import pytest

from services.runtime.natsd import EmbeddedNats

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture
def nats_server(tmp_path):
    """A fresh nats-server (JetStream, file storage under tmp_path) for one test."""
    server = EmbeddedNats(tmp_path / "nats", port=None)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def nats_url(nats_server) -> str:
    return nats_server.url


@pytest.fixture(scope="session")
def loop_model_dir(tmp_path_factory):
    """The default example's tiny model with a short warm-up (built once per test session)."""
    from services.tasks.tiny_model import ensure_tiny_model

    return ensure_tiny_model(tmp_path_factory.mktemp("loop-model-cache"), seed=0, warmup_steps=60)
