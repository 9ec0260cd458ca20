"""A tiny model built once per test session with a short warm-up (the real one takes ~40 s)."""

from __future__ import annotations

import pytest

from services.tasks.tiny_model import ensure_tiny_model

TEST_WARMUP_STEPS = 5


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return ensure_tiny_model(tmp_path_factory.mktemp("tiny-cache"), seed=0, warmup_steps=TEST_WARMUP_STEPS)
