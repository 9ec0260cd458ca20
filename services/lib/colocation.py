"""A trainer and engines colocated in one process (``trainer+rollout``): engines that give the device back
while the trainer steps.

An engine configured with ``enable_sleep_mode`` registers with :data:`DEVICE_SHARE` when the rollout starts
it; the trainer runs each learner step inside :meth:`DeviceShare.trainer_turn`, which puts every registered
engine to sleep first and wakes it afterwards. Sleeping releases the engine's memory: the torch engine its
KV cache (and on a GPU moves its weights to the host), vLLM its KV cache and weights (level 1, GPU only).
Requests in flight are kept and continue after the wake, their KV recomputed. With nothing registered (any
run that is not colocated, or without the switch) the turn is free.

A failed sleep or wake is logged and counted, never raised into the trainer: an engine that cannot sleep
only costs memory, and one that cannot wake fails its own requests (the rollout then stops and restarts).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Protocol

log = logging.getLogger(__name__)


class Sleeper(Protocol):
    """What :class:`DeviceShare` asks of an engine."""

    async def sleep(self) -> None: ...

    async def wake_up(self) -> None: ...


class DeviceShare:
    """The engines of this process that sleep while a colocated trainer steps, and what it cost."""

    def __init__(self) -> None:
        self._sleepers: list[Sleeper] = []
        self.turns = 0
        """Trainer turns in which at least one engine slept."""
        self.failures = 0
        """Sleeps or wakes that raised (logged; the turn went on)."""
        self.sleep_s = 0.0
        """Seconds spent putting engines to sleep and waking them, over all turns."""

    def register(self, engine: Sleeper) -> None:
        if engine not in self._sleepers:
            self._sleepers.append(engine)

    def unregister(self, engine: Sleeper) -> None:
        if engine in self._sleepers:
            self._sleepers.remove(engine)

    @property
    def engines(self) -> int:
        return len(self._sleepers)

    @contextlib.asynccontextmanager
    async def trainer_turn(self) -> AsyncIterator[None]:
        """Every registered engine asleep for the body (a learner step), awake again after it."""
        asleep: list[Sleeper] = []
        started = time.perf_counter()
        for engine in list(self._sleepers):
            try:
                await engine.sleep()
                asleep.append(engine)
            except Exception:
                self.failures += 1
                log.exception("an engine could not sleep for the trainer's step; it keeps its memory")
        spent = time.perf_counter() - started
        try:
            yield
        finally:
            woke = time.perf_counter()
            for engine in asleep:
                try:
                    await engine.wake_up()
                except Exception:
                    self.failures += 1
                    log.exception("an engine could not wake up after the trainer's step")
            if asleep:
                self.turns += 1
                self.sleep_s += spent + time.perf_counter() - woke


#: the process's one share (a colocated trainer and rollout find each other here)
DEVICE_SHARE = DeviceShare()
