"""The sides the benches compare, spelled once: a synchronous or asynchronous loop, and everything on every core
or disjoint pools (the trainer on one core, the rollout side on another) through the run file's
``[placement]``. bench/longtail.py and bench/vs_trl.py build their runs' overrides from here."""

from __future__ import annotations

import argparse
import os
from typing import Any

from bench._rlbus_runs import BenchRunError
from services.lib.engine.config import TorchEngineConfig

MODES = ("sync", "async")
LAYOUTS = ("shared", "pooled")


def choice_list(p: argparse.ArgumentParser, flag: str, text: str, allowed: tuple[str, ...]) -> list[str]:
    """A comma-separated flag's items, in ``allowed``'s order; an unknown or empty one is a usage error."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        p.error(f"{flag}: {', '.join(bad) or 'empty'}; choose from {', '.join(allowed)}")
    return [x for x in allowed if x in items]


def mode_overrides(mode: str, async_staleness: int = 1) -> dict[str, object]:
    """``sync``: max_staleness 0 (each step's samples come from the version it trains); ``async``:
    ``async_staleness`` (generation of the next versions' samples overlaps training)."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: choose from {', '.join(MODES)}")
    if mode == "async" and async_staleness < 1:
        raise ValueError(f"an asynchronous side needs max_staleness >= 1, not {async_staleness}")
    return {"services.trainer.max_staleness": 0 if mode == "sync" else async_staleness}


def pool_cpus() -> tuple[int, int]:
    """The trainer's core and the rollout side's core: the first two CPUs this process may use.

    Raises:
        BenchRunError: fewer than two CPUs (a pooled layout needs two).
    """
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise BenchRunError(f"the pooled layout needs two CPUs; this process may use {cpus}")
    return cpus[0], cpus[1]


def layout_overrides(layout: str, runfile: Any) -> dict[str, object]:
    """``shared``: nothing (every process on every core, the example's thread counts). ``pooled``: the trainer
    pinned to one core, every other service of the run to the other (CPU affinity set before ``exec``,
    OMP_NUM_THREADS to match), explicit torch thread counts set to 0 so torch follows the placement."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r}: choose from {', '.join(LAYOUTS)}")
    if layout == "shared":
        return {}
    trainer_cpu, rollout_cpu = pool_cpus()
    keys: dict[str, object] = {f"placement.{name}.cpus": str(trainer_cpu if name == "trainer" else rollout_cpu)
                               for name in runfile.launcher.services}
    keys["services.trainer.devices.num_threads"] = 0  # torch follows the placement (one core)
    if isinstance(runfile.services.rollout.engine, TorchEngineConfig):  # vLLM on CPU follows the affinity
        keys["services.rollout.engine.num_threads"] = 0
    return keys
