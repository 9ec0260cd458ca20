from __future__ import annotations

import pytest

from services.tasks.tiny_model import ensure_tiny_model


@pytest.fixture(scope="session")
def loop_model_dir(tmp_path_factory):
    """The default example's tiny model with a short warm-up (built once per test session)."""
    return ensure_tiny_model(tmp_path_factory.mktemp("loop-model-cache"), seed=0, warmup_steps=60)
