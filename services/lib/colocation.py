"""A trainer and engines colocated in one process (``trainer+rollout``): the device is handed back and forth.

An engine configured with ``enable_sleep_mode`` registers with :data:`DEVICE_SHARE` when the rollout starts
it; the trainer runs each learner step inside :meth:`DeviceShare.trainer_turn`. A turn, in order:

1. every registered engine sleeps (releases its memory: the torch engine its KV cache and on a GPU its
   weights; vLLM its KV cache and its weights, offloaded at level 1 or dropped at level 2, where the update
   that follows every step overwrites them: ``engine.sleep_level``);
2. the trainer's memory comes back (:class:`HostOffload`: the learner's weights and optimiser state from the
   host to the device);
3. the learner step;
4. the trainer hands its memory back: weights and optimiser state to the host, ``torch.cuda.empty_cache()``,
   so the caching allocator returns the blocks to the driver and the engine's wake-up finds them free;
5. every engine wakes.

**Start order**: vLLM refuses to start unless ``gpu_memory_utilization`` of the GPU is free, so a colocated
engine starts inside :meth:`DeviceShare.engine_start`, which waits for the trainer of the same process to
have loaded its learner and handed its memory back (:meth:`DeviceShare.set_trainer`).

Requests in flight are kept across a turn and continue after the wake, their KV recomputed. With nothing
registered (any run that is not colocated, or without the switch) a turn is free and nothing moves. A failed
sleep or wake is logged and counted, never raised into the trainer: an engine that cannot sleep only costs
memory, and one that cannot wake fails its own requests (the rollout then stops and restarts). Moving the
trainer's memory is part of the step: a failure there is the step's.

Tested on CPU (the logic: what moves, in which order, equal after a round trip); the memory it frees on a
GPU is not verified here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any, Protocol

log = logging.getLogger(__name__)

#: seconds a colocated engine waits for its trainer's learner before starting anyway
TRAINER_WAIT_S = 1800.0


class Sleeper(Protocol):
    """What :class:`DeviceShare` asks of an engine."""

    async def sleep(self) -> None: ...

    async def wake_up(self) -> None: ...


class HostOffload:
    """Modules and optimisers whose tensors live on ``device`` for the trainer's turn and on ``host`` between
    turns (:meth:`release` / :meth:`reclaim`). Parameters keep their identity (the optimiser still holds
    them); gradients are dropped on release (a step leaves none worth keeping); optimiser state tensors (the
    moments, and the step counts the fused AdamW keeps on the device) move with them. Host copies are pinned
    when the device is CUDA, so the copies back are fast."""

    def __init__(self, modules: Iterable[Any], optimizers: Iterable[Any], device: Any, host: str = "cpu") -> None:
        import torch

        self.modules = [m for m in modules if m is not None]
        self.optimizers = list(optimizers)
        self.device = torch.device(device)
        self.host = torch.device(host)
        self.on_host = False
        self.moved_bytes = 0
        """Bytes moved by the last release or reclaim."""
        self._moved: list[tuple[Any, str, Any]] = []  # (owner, key, tensor) moved by the last release

    def tensors(self) -> Iterable[tuple[Any, str, Any]]:
        """(owner, key, tensor) of every tensor that moves: parameters and buffers, optimiser state."""
        once: set[int] = set()  # a parameter shared by two modules (tied embeddings) is one entry
        for module in self.modules:
            for sub in module.modules():
                for key, t in list(sub._parameters.items()) + list(sub._buffers.items()):
                    if t is not None and id(t) not in once:
                        once.add(id(t))
                        yield sub, key, t
        for opt in self.optimizers:
            for state in opt.state.values():
                for key, t in state.items():
                    if hasattr(t, "device"):
                        yield state, key, t

    def _move(self, entries: list[tuple[Any, str, Any]], to: Any, pin: bool) -> None:
        import torch

        seen: dict[int, Any] = {}  # shared storage (tied embeddings) moves once
        moved = 0
        for owner, key, t in entries:
            data = t.data if isinstance(owner, torch.nn.Module) else t
            if data.data_ptr() not in seen:
                copy = torch.empty_like(data, device=to, pin_memory=pin)
                copy.copy_(data, non_blocking=pin)
                seen[data.data_ptr()] = copy
                moved += data.numel() * data.element_size()
            if isinstance(owner, torch.nn.Module):  # a parameter or buffer keeps its identity
                t.data = seen[data.data_ptr()]
                if isinstance(t, torch.nn.Parameter):
                    t.grad = None
            else:  # an optimiser state entry
                owner[key] = seen[data.data_ptr()]
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.moved_bytes = moved

    def release(self) -> None:
        """What is on the device to the host (tensors already on the host, e.g. the step counts of a
        non-fused AdamW, stay); on CUDA the freed blocks go back to the driver (``empty_cache``)."""
        import torch

        if self.on_host:
            return
        self._moved = [(o, k, t) for o, k, t in self.tensors() if t.device == self.device]
        self._move(self._moved, self.host, pin=self.device.type == "cuda")
        self.on_host = True
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        log.info("trainer memory handed back: %.1f MiB on the host", self.moved_bytes / (1 << 20))

    def reclaim(self) -> None:
        """What :meth:`release` moved, back on the device."""
        if not self.on_host:
            return
        # the entries again, as they are now (an optimiser state entry was replaced by its host copy)
        moved = {(id(o), k) for o, k, _ in self._moved}
        self._move([(o, k, t) for o, k, t in self.tensors() if (id(o), k) in moved], self.device, pin=False)
        self._moved = []
        self.on_host = False


class DeviceShare:
    """The engines of this process that sleep while a colocated trainer steps, the trainer's memory that
    moves out of their way, and what it cost."""

    def __init__(self) -> None:
        self._sleepers: list[Sleeper] = []
        # per event loop (a process may run services on several loops one after another, e.g. tests)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._trainer: HostOffload | None = None
        self._trainer_ready = asyncio.Event()
        self._lock = asyncio.Lock()  # a turn and an engine's start-up never overlap
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

    def _turns(self) -> asyncio.Lock:
        """The lock of turns and start-ups on this event loop (the trainer's state is the loop's too)."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._loop, self._trainer = loop, None
            self._trainer_ready, self._lock = asyncio.Event(), asyncio.Lock()
        return self._lock

    async def set_trainer(self, memory: HostOffload | None) -> None:
        """The colocated trainer has loaded its learner: ``memory`` (None: nothing moves, e.g. on CPU) is handed
        back to the host at once, so that an engine can start (:meth:`engine_start`), and moved in and out
        around each turn from now on."""
        async with self._turns():
            self._trainer = memory
            if memory is not None:
                await asyncio.to_thread(memory.release)
            self._trainer_ready.set()

    @contextlib.asynccontextmanager
    async def engine_start(self, with_trainer: bool) -> AsyncIterator[None]:
        """Start a colocated engine in the body: with ``with_trainer`` (a trainer in this process) once the
        trainer has loaded its learner and handed its memory back (at most :data:`TRAINER_WAIT_S`), and
        never during a trainer's turn."""
        lock = self._turns()
        if with_trainer:
            try:
                await asyncio.wait_for(self._trainer_ready.wait(), TRAINER_WAIT_S)
            except TimeoutError:
                log.warning("the colocated trainer did not hand its memory back within %.0f s; starting the "
                            "engine anyway", TRAINER_WAIT_S)
        async with lock:
            yield

    @contextlib.asynccontextmanager
    async def trainer_turn(self) -> AsyncIterator[None]:
        """Every registered engine asleep and the trainer's memory on its device for the body (a learner
        step); the trainer's memory handed back and the engines awake after it (module docstring)."""
        async with self._turns():
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
            trainer = self._trainer
            try:
                if trainer is not None:
                    await asyncio.to_thread(trainer.reclaim)
                yield
            finally:
                if trainer is not None and self._sleepers:  # (no engine sleeps: nothing to make room for)
                    await asyncio.to_thread(trainer.release)  # before any engine wakes
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
