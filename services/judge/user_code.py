"""The judge's bounded runner for user code (tasks' reward functions and hidden-test builders).

Why processes, not threads (``bench/user_code.py`` measures both): a call into a worker process costs a
pickle round trip over a pipe (tens of microseconds more than a thread hop, far below any reward worth
training on), and it is the only way to *end* a hang. A thread stuck in ``while True: pass`` can be
abandoned but never stopped: it keeps its pool slot and, holding the GIL half the time, slows the event loop
(and the heartbeats) until the process dies. A worker process whose call does not return within
``timeout_s`` is killed (SIGKILL) and replaced; one that dies (a segfault in a C extension, the memory
limit) is replaced too. Either way the call raises :class:`UserCodeError` and the sample is scored failed.

Each worker builds the judge's tasks itself, once (``services/judge/user_worker.py``), from the task name,
its options and the module defining it; the judge sends only the arguments. Workers start on first use;
calls wait for a free worker (the wait is not charged to the call's timeout).

**A hang costs its own group, not the run** (``bench/user_code.py --pipeline`` measures it). Two rules:

* *The pool grows on demand*: a worker whose call has run longer than ``grow_after_s`` counts as stuck,
  and a call that finds no idle worker starts one in its place (up to ``max_workers``), so calls stuck
  until their timeout do not queue everyone else's behind them; a queue of quick calls alone never grows
  the pool. Workers beyond ``workers`` that stay idle ``idle_retire_s`` are closed. A stuck worker runs
  at the lowest CPU priority (niceness 19) until its call returns, so a spinning hang does not starve
  the services sharing the host while it waits out ``timeout_s``.
* *A group's first call probes for the rest*: calls made with the same ``scope`` (the judge passes the
  prompt group) to the same method wait for the first one to return; if it, or any later one, does not
  return within ``timeout_s``, the group's calls still to come fail at once with that reason instead of
  each hanging for ``timeout_s`` (the samples of a group share their prompt, the usual cause of a hang).
  The probe costs one call's latency per group, on the groups' own critical path only.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import signal
import sys
import time
from collections import OrderedDict
from typing import Any

from services.judge.config import UserCodeConfig
from services.judge.user_worker import HEADER
from services.tasks.graders import UserCodeError

log = logging.getLogger("rlbus.judge.user_code")


#: niceness of a worker whose call has run past ``grow_after_s``: a spinning hang then takes CPU only
#: from what is idle, not from the trainer and the engines (``bench/hanging_reward.py --hang spin``)
STUCK_NICE = 19


class WorkerGone(Exception):
    """The worker process exited (or was killed) during a call."""


class _Worker:
    """One worker process and the pipe frames to it."""

    def __init__(self, cfg: UserCodeConfig, index: int) -> None:
        self.cfg = cfg
        self.index = index
        self.proc: asyncio.subprocess.Process | None = None
        self.broken = False  # killed, or its pipe is out of step (a call abandoned mid-way)
        self.last_used = time.monotonic()
        self.busy_since: float | None = None  # when its current call was sent (None: idle)
        self.niced = False  # running a call past grow_after_s, at STUCK_NICE

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None and not self.broken

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "services.judge.user_worker",
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=None)
        self.broken = False
        await self._send(("init", list(sys.path), self.cfg.memory_mb))
        reply = await asyncio.wait_for(self._receive(), self.cfg.start_timeout_s)
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

    async def call(self, key: str, module: str, name: str, options: dict[str, Any], method: str,
                   args: tuple[Any, ...]) -> tuple[Any, ...]:
        lower = asyncio.get_running_loop().call_later(self.cfg.grow_after_s, self._set_nice, STUCK_NICE)
        try:
            await self._send(("call", key, module, name, options, method, args))
            reply = await asyncio.wait_for(self._receive(), self.cfg.timeout_s)
        except BaseException:  # timeout, death, or the caller cancelled: the reply can no longer be matched
            self.signal_kill()
            raise
        finally:
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


def _exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


class UserCodeRunnerError(RuntimeError):
    """The runner, not the user's code, failed a call (a frame the worker could not decode): not the task's
    verdict, so the judge retries the message instead of scoring the sample failed."""


class _Scope:
    """The calls of one group to one method: the first one's outcome, and why the rest fail (if they do)."""

    def __init__(self) -> None:
        self.probe: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.failed: str | None = None


#: scopes remembered (a group's calls come together; older ones are long finished)
SCOPES_KEPT = 4096


class ProcessUserCode:
    """``workers`` worker processes, growing to ``max_workers`` on demand; each call bounded by ``timeout_s``
    (see the module docstring).

    ``task_options`` are the judge's per-task options, so a worker builds the same task the judge has.
    ``restarts`` counts the workers replaced (after a timeout or a death), ``grown`` the workers started
    beyond ``workers``, ``group_failed`` the calls failed at once after a timeout in their group; the
    judge reports them.
    """

    def __init__(self, cfg: UserCodeConfig, task_options: dict[str, dict[str, Any]]) -> None:
        self.cfg = cfg
        self.task_options = task_options
        self.workers = [_Worker(cfg, i) for i in range(cfg.workers)]
        self._next_index = cfg.workers
        self.idle: asyncio.Queue[_Worker] = asyncio.Queue()
        for w in self.workers:
            self.idle.put_nowait(w)
        self.calls = 0
        self.restarts = 0
        self.grown = 0
        self.retired = 0
        self.group_failed = 0
        self._scopes: OrderedDict[tuple[str, str, str], _Scope] = OrderedDict()
        self._closing: set[asyncio.Task[None]] = set()

    async def call(self, task_name: str, task: Any, method: str, *args: Any, scope: str | None = None) -> Any:
        """``task.<method>(*args)`` in a worker; ``scope`` (a prompt group's id) joins calls whose first
        timeout fails the rest at once (see the module docstring)."""
        if scope is None:
            return await self._call(task_name, task, method, args)
        key = (scope, task_name, method)
        state = self._scopes.get(key)
        probing = state is None
        if state is None:
            state = self._scopes[key] = _Scope()
            while len(self._scopes) > SCOPES_KEPT:
                self._scopes.popitem(last=False)
        elif not state.probe.done():
            await asyncio.shield(state.probe)
        try:
            if state.failed is not None:
                self.group_failed += 1
                raise UserCodeError("timeout", state.failed)
            try:
                return await self._call(task_name, task, method, args)
            except UserCodeError as e:
                if e.kind == "timeout":
                    state.failed = (f"{method}() was not called: it did not return within {self.cfg.timeout_s:g} s "
                                    "for another sample of this group (same prompt)")
                raise
        finally:
            if probing and not state.probe.done():
                state.probe.set_result(None)

    def _stuck(self, now: float) -> int:
        """Workers whose call has run longer than ``grow_after_s`` (hung ones among them)."""
        return sum(w.busy_since is not None and now - w.busy_since > self.cfg.grow_after_s for w in self.workers)

    async def _take(self) -> _Worker:
        """An idle worker, or a new one (up to ``max_workers``) standing in for each stuck one: the pool keeps
        ``workers`` that are not stuck, so a queue of quick calls alone never grows it."""
        self._retire_idle()
        while True:
            try:
                return self.idle.get_nowait()
            except asyncio.QueueEmpty:
                pass
            stuck = self._stuck(time.monotonic())
            if len(self.workers) < min(self.cfg.max_workers, self.cfg.workers + stuck):
                worker = _Worker(self.cfg, self._next_index)
                self._next_index += 1
                self.workers.append(worker)
                self.grown += 1
                log.info("%d user-code worker(s) stuck in a call for over %g s: started worker %d (%d of at most "
                         "%d)", stuck, self.cfg.grow_after_s, worker.index, len(self.workers), self.cfg.max_workers)
                return worker
            try:
                return await asyncio.wait_for(self.idle.get(), self.cfg.grow_after_s)
            except TimeoutError:
                continue  # look again: a call may have become stuck meanwhile

    def _retire_idle(self) -> None:
        """Close workers beyond ``workers`` that were idle ``idle_retire_s`` (no awaits: the queue stays whole)."""
        if len(self.workers) <= self.cfg.workers:
            return
        now, keep = time.monotonic(), []
        while True:
            try:
                w = self.idle.get_nowait()
            except asyncio.QueueEmpty:
                break
            if len(self.workers) > self.cfg.workers and now - w.last_used > self.cfg.idle_retire_s:
                self.workers.remove(w)
                self.retired += 1
                task = asyncio.ensure_future(w.close())
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)
            else:
                keep.append(w)
        for w in keep:
            self.idle.put_nowait(w)

    async def _call(self, task_name: str, task: Any, method: str, args: tuple[Any, ...]) -> Any:
        options = dict(self.task_options.get(task_name, {}))
        key = f"{task_name}:{sorted(options.items())!r}"
        module = type(task).__module__
        worker = await self._take()
        try:
            if not worker.alive:
                if worker.proc is not None:
                    self.restarts += 1
                    await worker.kill()  # reap the one it replaces
                try:
                    await worker.start()
                except BaseException:
                    await worker.kill()
                    raise
            self.calls += 1
            worker.busy_since = time.monotonic()
            try:
                reply = await worker.call(key, module, task_name, options, method, args)
            except TimeoutError:
                code = await worker.kill()
                log.warning("user code %s.%s() did not return within %g s; worker %d %s and replaced",
                            task_name, method, self.cfg.timeout_s, worker.index, _exit_reason(code))
                raise UserCodeError("timeout", f"{method}() did not return within {self.cfg.timeout_s:g} s "
                                               "(its worker process was killed)") from None
            except WorkerGone:
                code = await worker.kill()
                log.warning("user-code worker %d died in %s.%s() (%s)", worker.index, task_name, method,
                            _exit_reason(code))
                raise UserCodeError("crash", f"{method}() killed its worker process ({_exit_reason(code)})") from None
        finally:
            worker.busy_since, worker.last_used = None, time.monotonic()
            self.idle.put_nowait(worker)
        if reply[0] == "internal":
            raise UserCodeRunnerError(f"user-code worker {worker.index} could not take the call to "
                                      f"{task_name}.{method}(): {reply[1]}")
        if reply[0] == "error":
            log.info("user code %s.%s() raised %s\n%s", task_name, method, reply[1], reply[2])
            raise UserCodeError("exception", f"{method}() raised {reply[1]}")
        return reply[1]

    async def close(self) -> None:
        await asyncio.gather(*(w.close() for w in self.workers), *self._closing)
