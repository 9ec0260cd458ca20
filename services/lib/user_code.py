"""A pool of worker processes that run user code bounded: the judge's reward functions
(``services/judge/user_code.py``) and the rollout's sync function tools (``services/rollout/tool_runner.py``).

Why processes, not threads (``bench/user_code.py`` measures both): a call into a worker process costs a
pickle round trip over a pipe (tens of microseconds more than a thread hop), and it is the only way to *end*
a hang. A thread stuck in ``while True: pass`` can be abandoned but never stopped: it keeps its slot and,
holding the GIL half the time, slows the event loop (and the heartbeats, and an engine beside it) until the
process dies. A worker whose call does not return within its timeout is killed (SIGKILL), reaped and
replaced on its next use; one that dies (a segfault in a C extension, the memory limit) is replaced too.
Either way the call raises :class:`UserCallFailed` and the caller says why to whoever reads it.

**What runs**: a module-level function, named by its module and ``__qualname__`` (:func:`importable` tells
whether a function can be named so); the worker imports the module (``services/lib/user_worker.py``), and
any the caller names, once, before its first call into it, bounded by ``start_timeout_s`` and not charged
to the call. Arguments and the
result cross the pipe pickled. Workers start on first use (also not charged to the call).

**The pool grows past stuck workers**: a worker whose call has run longer than ``grow_after_s`` counts as
stuck, and a call that finds no idle worker starts one in its place (up to ``max_workers``), so calls stuck
until their timeout do not queue everyone else's behind them; a queue of quick calls alone never grows the
pool. Workers beyond ``workers`` that stay idle ``idle_retire_s`` are closed. A stuck worker runs at the
lowest CPU priority (niceness 19) until its call returns, so a spinning hang does not starve the services
sharing the host while it waits out its timeout. A call may bound its wait for a free worker (``wait_s``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import signal
import sys
import time
from typing import Any, Protocol

from services.lib.user_worker import HEADER

#: niceness of a worker whose call has run past ``grow_after_s``: a spinning hang then takes CPU only
#: from what is idle, not from the trainer and the engines (``bench/hanging_reward.py --hang spin``)
STUCK_NICE = 19


class PoolBounds(Protocol):
    """The bounds a pool runs under (the judge's ``UserCodeConfig``, the rollout's ``ToolWorkersSection``); each
    call brings its own timeout."""

    workers: int
    memory_mb: int
    start_timeout_s: float
    max_workers: int
    grow_after_s: float
    idle_retire_s: float


def resolve_max_workers(bounds: PoolBounds, key: str) -> None:
    """A pool section's ``max_workers`` check, from its ``__post_init__``: 0 becomes ``max(16, workers)``; below
    ``workers`` is a configuration error naming ``key`` (the section's path)."""
    from services.runtime.config import ConfigError

    if bounds.max_workers == 0:
        bounds.max_workers = max(16, bounds.workers)
    elif bounds.max_workers < bounds.workers:
        raise ConfigError(f"config key {key}.max_workers is {bounds.max_workers}, below workers ({bounds.workers}): "
                          "raise it (or set 0 for max(16, workers))")


class UserCallFailed(Exception):
    """A call into user code did not return a value. ``kind``: ``timeout`` (its worker was killed), ``crash``
    (its worker died), ``exception`` (the code raised; the message is ``ExcType: message``, ``traceback`` its
    last lines), ``import`` (importing the function's module raised) or ``busy`` (no worker was free within
    the call's ``wait_s``)."""

    def __init__(self, kind: str, message: str, traceback: str = "") -> None:
        super().__init__(message)
        self.kind = kind
        self.traceback = traceback


class WorkerPoolError(RuntimeError):
    """The pool, not the user's code, failed a call (a frame the worker could not decode)."""


class WorkerGone(Exception):
    """The worker process exited (or was killed) during a call."""


def importable(fn: Any) -> tuple[str, str] | None:
    """``(module, qualname)`` under which a worker process finds ``fn``, or None: a lambda, a closure, a
    bound method, a function of ``__main__`` or of a module that was not imported from a file (``exec``)."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str) or module == "__main__" or "<" in qualname:
        return None
    obj = sys.modules.get(module)
    if obj is None or getattr(obj, "__spec__", None) is None:
        return None
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return (module, qualname) if obj is fn else None


class Worker:
    """One worker process and the pipe frames to it."""

    def __init__(self, bounds: PoolBounds, index: int) -> None:
        self.bounds = bounds
        self.index = index
        self.proc: asyncio.subprocess.Process | None = None
        self.broken = False  # killed, or its pipe is out of step (a call abandoned mid-way)
        self.imported: set[str] = set()  # modules imported in this process
        self.last_used = time.monotonic()
        self.busy_since: float | None = None  # when its current call was sent (None: idle)
        self.niced = False  # running a call past grow_after_s, at STUCK_NICE

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None and not self.broken

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "services.lib.user_worker",
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=None)
        self.broken, self.imported = False, set()
        await self._send(("init", list(sys.path), self.bounds.memory_mb))
        reply = await asyncio.wait_for(self._receive(), self.bounds.start_timeout_s)
        if reply != ("ready",):
            raise RuntimeError(f"user-code worker {self.index} answered {reply!r} to init")

    async def _send(self, frame: tuple[Any, ...]) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        data = pickle.dumps(frame, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            self.proc.stdin.write(HEADER.pack(len(data)) + data)
            await self.proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError) as e:
            raise WorkerGone(str(e)) from e

    async def _receive(self) -> Any:
        assert self.proc is not None and self.proc.stdout is not None
        try:
            (size,) = HEADER.unpack(await self.proc.stdout.readexactly(HEADER.size))
            return pickle.loads(await self.proc.stdout.readexactly(size))
        except asyncio.IncompleteReadError as e:
            raise WorkerGone("the worker closed its pipe") from e

    async def call(self, frame: tuple[Any, ...], timeout_s: float, nice: bool = True) -> tuple[Any, ...]:
        """Send ``frame``, await its reply within ``timeout_s`` (TimeoutError: the worker is killed);
        lowered to STUCK_NICE past ``grow_after_s`` when ``nice``."""
        lower = (asyncio.get_running_loop().call_later(self.bounds.grow_after_s, self._set_nice, STUCK_NICE)
                 if nice else None)
        try:
            await self._send(frame)
            reply = await asyncio.wait_for(self._receive(), timeout_s)
        except BaseException:  # timeout, death, or the caller cancelled: the reply can no longer be matched
            self.signal_kill()
            raise
        finally:
            if lower is not None:
                lower.cancel()
        if self.niced and not self._set_nice(0):
            self.broken = True  # cannot be raised back (no CAP_SYS_NICE): replaced on its next use
        return reply

    def _set_nice(self, value: int) -> bool:
        """Set the worker's niceness; False if the kernel refused."""
        if self.proc is None or self.proc.returncode is not None:
            return False
        try:
            os.setpriority(os.PRIO_PROCESS, self.proc.pid, value)
        except OSError:
            return False
        self.niced = value != 0
        return True

    def signal_kill(self) -> None:
        self.broken = True
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()

    async def kill(self) -> int | None:
        """SIGKILL the worker (a hung call cannot be stopped any other way) and reap it; its exit code."""
        if self.proc is None:
            return None
        self.signal_kill()
        return await self.proc.wait()

    async def close(self) -> None:
        """Ask the worker to exit (EOF on its stdin), killing it if it does not within a few seconds."""
        if self.proc is None or self.proc.returncode is not None:
            return
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            await asyncio.wait_for(self.proc.wait(), 5.0)
        except TimeoutError:
            await self.kill()


def exit_reason(code: int | None) -> str:
    """How a worker ended, in words."""
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


class WorkerPool:
    """``workers`` worker processes, growing to ``max_workers`` on demand; each call bounded by the timeout it
    is given (see the module docstring). ``log`` and ``what`` (``user-code``, ``tool``) name the pool in log lines.

    Counted: ``calls``, ``restarts`` (workers replaced after a timeout or a death), ``killed`` (calls whose
    worker was killed at their timeout), ``grown`` (workers started beyond ``workers``), ``retired``.
    """

    def __init__(self, bounds: PoolBounds, log: logging.Logger | None = None, what: str = "user-code") -> None:
        self.bounds = bounds
        self.log = log or logging.getLogger("rlbus.lib.user_code")
        self.what = what
        self.workers = [Worker(bounds, i) for i in range(bounds.workers)]
        self._next_index = bounds.workers
        self.idle: asyncio.Queue[Worker] = asyncio.Queue()
        for w in self.workers:
            self.idle.put_nowait(w)
        self.calls = 0
        self.restarts = 0
        self.killed = 0
        self.grown = 0
        self.retired = 0
        self._closing: set[asyncio.Task[None]] = set()

    def _stuck(self, now: float) -> int:
        """Workers whose call has run longer than ``grow_after_s`` (hung ones among them)."""
        return sum(w.busy_since is not None and now - w.busy_since > self.bounds.grow_after_s for w in self.workers)

    async def _take(self, wait_s: float | None) -> Worker:
        """An idle worker, or a new one (up to ``max_workers``) standing in for each stuck one: the pool keeps
        ``workers`` that are not stuck, so a queue of quick calls alone never grows it. Past ``wait_s`` (None:
        no limit) without one: :class:`UserCallFailed` (``busy``)."""
        self._retire_idle()
        bounds = self.bounds
        deadline = None if wait_s is None else time.monotonic() + wait_s
        while True:
            try:
                return self.idle.get_nowait()
            except asyncio.QueueEmpty:
                pass
            now = time.monotonic()
            stuck = self._stuck(now)
            if len(self.workers) < min(bounds.max_workers, bounds.workers + stuck):
                worker = Worker(bounds, self._next_index)
                self._next_index += 1
                self.workers.append(worker)
                self.grown += 1
                self.log.info("%d %s worker(s) stuck in a call for over %g s: started worker %d (%d of at most "
                              "%d)", stuck, self.what, bounds.grow_after_s, worker.index, len(self.workers),
                              bounds.max_workers)
                return worker
            wait = bounds.grow_after_s
            if deadline is not None:
                if now >= deadline:
                    raise UserCallFailed("busy", f"no {self.what} worker was free within {wait_s:g} s (all "
                                                 f"{len(self.workers)} busy, at most {bounds.max_workers})")
                wait = min(wait, deadline - now)
            try:
                return await asyncio.wait_for(self.idle.get(), wait)
            except TimeoutError:
                continue  # look again: a call may have become stuck meanwhile

    def _retire_idle(self) -> None:
        """Close workers beyond ``workers`` that were idle ``idle_retire_s`` (no awaits: the queue stays whole)."""
        if len(self.workers) <= self.bounds.workers:
            return
        now, keep = time.monotonic(), []
        while True:
            try:
                w = self.idle.get_nowait()
            except asyncio.QueueEmpty:
                break
            if len(self.workers) > self.bounds.workers and now - w.last_used > self.bounds.idle_retire_s:
                self.workers.remove(w)
                self.retired += 1
                task = asyncio.ensure_future(w.close())
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)
            else:
                keep.append(w)
        for w in keep:
            self.idle.put_nowait(w)

    async def _ready(self, worker: Worker, modules: tuple[str, ...]) -> None:
        """``worker`` running (started or replaced) with ``modules`` imported; neither charged to a call."""
        if not worker.alive:
            if worker.proc is not None:
                self.restarts += 1
                await worker.kill()  # reap the one it replaces
            try:
                await worker.start()
            except BaseException:
                await worker.kill()
                raise
        for module in modules:
            if module in worker.imported:
                continue
            reply = await self._frame(worker, ("import", module), self.bounds.start_timeout_s, f"import {module}",
                                      nice=False)
            if reply[0] == "error":
                raise UserCallFailed("import", f"importing {module} raised {reply[1]}", reply[2])
            worker.imported.add(module)

    async def _frame(self, worker: Worker, frame: tuple[Any, ...], timeout_s: float, label: str,
                     nice: bool = True) -> tuple[Any, ...]:
        """One frame's reply; a timeout or a death kills and reaps the worker and raises :class:`UserCallFailed`."""
        try:
            reply = await worker.call(frame, timeout_s, nice)
        except TimeoutError:
            code = await worker.kill()
            self.killed += 1
            self.log.warning("%s did not return within %g s; %s worker %d %s and replaced", label, timeout_s,
                             self.what, worker.index, exit_reason(code))
            raise UserCallFailed("timeout", f"{label} did not return within {timeout_s:g} s (its worker process "
                                            "was killed)") from None
        except WorkerGone:
            code = await worker.kill()
            self.log.warning("%s worker %d died in %s (%s)", self.what, worker.index, label, exit_reason(code))
            raise UserCallFailed("crash", f"{label} killed its worker process ({exit_reason(code)})") from None
        if reply[0] == "internal":
            raise WorkerPoolError(f"{self.what} worker {worker.index} could not take the call to {label}: "
                                  f"{reply[1]}")
        return reply

    async def call(self, module: str, qualname: str, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None,
                   *, timeout_s: float, wait_s: float | None = None, label: str | None = None,
                   imports: tuple[str, ...] = ()) -> Any:
        """``module.qualname(*args, **kwargs)`` in a worker within ``timeout_s``, after waiting at most
        ``wait_s`` for a free worker (None: as long as it takes). ``module`` and ``imports`` (the modules the
        function will import, such as the one holding the code it calls) are imported first, outside the
        timeout. ``label`` names the call in errors and log lines. Raises :class:`UserCallFailed` (the code's
        failure) or :class:`WorkerPoolError`."""
        label = label or f"{module}.{qualname}()"
        worker = await self._take(wait_s)
        try:
            await self._ready(worker, (module, *imports))
            self.calls += 1
            worker.busy_since = time.monotonic()
            reply = await self._frame(worker, ("call", module, qualname, args, kwargs or {}), timeout_s, label)
        finally:
            worker.busy_since, worker.last_used = None, time.monotonic()
            self.idle.put_nowait(worker)
        if reply[0] == "error":
            raise UserCallFailed("exception", reply[1], reply[2])
        return reply[1]

    async def close(self) -> None:
        await asyncio.gather(*(w.close() for w in self.workers), *self._closing)
