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
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import signal
import sys
from typing import Any

from services.judge.config import UserCodeConfig
from services.judge.user_worker import HEADER
from services.tasks.graders import UserCodeError

log = logging.getLogger("rlbus.judge.user_code")


class WorkerGone(Exception):
    """The worker process exited (or was killed) during a call."""


class _Worker:
    """One worker process and the pipe frames to it."""

    def __init__(self, cfg: UserCodeConfig, index: int) -> None:
        self.cfg = cfg
        self.index = index
        self.proc: asyncio.subprocess.Process | None = None
        self.broken = False  # killed, or its pipe is out of step (a call abandoned mid-way)

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
        try:
            await self._send(("call", key, module, name, options, method, args))
            return await asyncio.wait_for(self._receive(), self.cfg.timeout_s)
        except BaseException:  # timeout, death, or the caller cancelled: the reply can no longer be matched
            self.signal_kill()
            raise

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


class ProcessUserCode:
    """``workers`` worker processes; each call bounded by ``timeout_s`` (see the module docstring).

    ``task_options`` are the judge's per-task options, so a worker builds the same task the judge has.
    ``restarts`` counts the workers replaced (after a timeout or a death); the judge reports it.
    """

    def __init__(self, cfg: UserCodeConfig, task_options: dict[str, dict[str, Any]]) -> None:
        self.cfg = cfg
        self.task_options = task_options
        self.workers = [_Worker(cfg, i) for i in range(cfg.workers)]
        self.idle: asyncio.Queue[_Worker] = asyncio.Queue()
        for w in self.workers:
            self.idle.put_nowait(w)
        self.calls = 0
        self.restarts = 0

    async def call(self, task_name: str, task: Any, method: str, *args: Any) -> Any:
        options = dict(self.task_options.get(task_name, {}))
        key = f"{task_name}:{sorted(options.items())!r}"
        module = type(task).__module__
        worker = await self.idle.get()
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
            self.idle.put_nowait(worker)
        if reply[0] == "error":
            log.info("user code %s.%s() raised %s\n%s", task_name, method, reply[1], reply[2])
            raise UserCodeError("exception", f"{method}() raised {reply[1]}")
        return reply[1]

    async def close(self) -> None:
        await asyncio.gather(*(w.close() for w in self.workers))
