"""Bounded calls of user code in the rollout: function tools and environment hooks.

**Where each call runs**:

* an ``async def`` tool runs on the event loop under ``asyncio.timeout(timeout_s)``; past it, it is cancelled.
  Most tools are I/O (an HTTP API, a database, a search index): they belong on the loop, where a timeout
  cancels them for real. An ``async`` tool that blocks the loop (``time.sleep``) cannot be bounded.
* a **sync tool that is a module-level function** (a worker finds it by ``fn.__module__`` and
  ``fn.__qualname__``: :func:`services.lib.user_code.importable`) runs in a **worker process**
  (``[services.rollout] agent.tool_workers``; the judge's pool, :class:`services.lib.user_code.WorkerPool`),
  so a tool that spins takes neither a core nor the GIL from the engine beside it. Past ``timeout_s`` its
  worker is killed (SIGKILL), reaped and replaced on the next call: nothing keeps running. The worker renders
  the result (:func:`run_tool`: JSON checked, cut to ``max_chars``), so only that text crosses the pipe; a
  worker's start and the import of the tool's module are not charged to the call (``start_timeout_s``). The
  pool grows past workers stuck in a call up to ``max_workers``; a call that finds none free within
  ``timeout_s`` fails with a timeout observation.
* a **sync tool a worker cannot import** (a lambda, a closure, a bound method, a function defined in
  ``__main__`` or in code run by ``exec``), every sync tool when ``tool_workers.workers = 0``, and the
  environment's own hooks (``reset``/``step``, methods of an object holding state: :meth:`ToolRunner.call`)
  run in a **daemon thread of their own** (not the loop's default executor, which a few hung calls would
  fill), awaited under the same timeout; past it the thread is *abandoned* (Python cannot stop a thread) and
  goes on holding the GIL half the time until it returns. Abandoned threads still running are counted
  (``hung``); past ``max_hung`` of them, calls in threads fail at once instead of starting more. A tool that
  falls back to a thread is said once per tool in the log.

Untrusted code belongs in the sandbox (sandbox environments).

**Every failure is an observation**, never an exception out of :meth:`ToolRunner.run_calls`: an unknown tool
or wrong arguments (``bad_call``), a raise or a worker that died (``exception``), a timeout (``timeout``; the
tool's worker was killed: ``killed`` too), a result that is not JSON-serialisable (``not_json``); a result
longer than ``max_chars`` is cut with a note (``cut``, not an error). Each kind is counted in
:attr:`ToolRunner.counters`. A string result is passed as is; anything else as its JSON text. Rendering a
large result runs off the event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

from services.lib.user_code import PoolBounds, UserCallFailed, WorkerPool, WorkerPoolError, importable
from services.lib.user_worker import resolve
from services.tasks.env import ToolResult
from services.tasks.function_tools import ToolSpec, check_call, is_async
from services.tasks.toolcalls import Parsed

log = logging.getLogger("rlbus.rollout.tools")

#: what a tool worker runs: :func:`run_tool` (module, qualname, arguments, max_chars)
RUN_TOOL = (__name__, "run_tool")


class CallFailed(Exception):
    """A bounded call did not return a value: ``kind`` is ``timeout``, ``exception`` or ``hung``."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def cut(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, the cut said."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}\n... [{len(text) - limit} more characters cut]"


def render(value: Any, limit: int) -> tuple[str, bool]:
    """A tool's result as observation text (a string as is, else JSON) cut to ``limit``; and whether it is JSON
    at all (False: the text says why)."""
    if isinstance(value, str):
        return cut(value, limit), True
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as e:
        return f"the tool returned a {type(value).__name__}, which is not JSON-serialisable ({e})", False
    return cut(text, limit), True


def run_tool(module: str, qualname: str, arguments: dict[str, Any], max_chars: int) -> tuple[str, bool]:
    """In a tool worker: the tool called, and its result rendered there (:func:`render`), so that only the
    observation text crosses the pipe (a 100 MB result is cut in the worker; a non-JSON one is said there)."""
    value = resolve(module, qualname)(**arguments)
    if asyncio.iscoroutine(value):  # a sync function that returned a coroutine: run it here, in the same bound
        value = asyncio.run(value)
    return render(value, max_chars)


class ToolRunner:
    """Runs calls of user code bounded; one instance serves every episode of a rollout process. ``workers``
    (``agent.tool_workers``) bounds the pool of worker processes for sync tools; None, or ``workers = 0``: sync
    tools run in threads. :meth:`close` it when done (it stops the workers)."""

    def __init__(self, timeout_s: float, max_chars: int, max_calls: int = 8, max_hung: int = 64,
                 workers: PoolBounds | None = None) -> None:
        self.timeout_s = timeout_s
        self.max_chars = max_chars
        self.max_calls = max_calls
        self.max_hung = max_hung
        #: sync calls abandoned past their timeout and still running
        self.hung = 0
        self.counters: dict[str, int] = {"calls": 0, "timeout": 0, "exception": 0, "not_json": 0, "bad_call": 0,
                                         "parse": 0, "cut": 0, "too_many": 0, "killed": 0, "in_thread": 0}
        #: worker processes for sync tools (None: every sync tool in a thread)
        self.pool = WorkerPool(workers, log, "tool") if workers is not None and workers.workers > 0 else None
        self._said_in_thread: set[str] = set()

    def metrics(self) -> dict[str, float]:
        """Counters and gauges, named as ``rollout/tools/<name>`` reports them."""
        out = {k: float(v) for k, v in self.counters.items()}
        out["hung"] = float(self.hung)
        if self.pool is not None:
            out.update(workers=float(len(self.pool.workers)), worker_restarts=float(self.pool.restarts))
        return out

    async def close(self) -> None:
        """Stop the tool workers (a worker still in a call is killed after a few seconds)."""
        if self.pool is not None:
            await self.pool.close()

    async def call(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None) -> Any:
        """``fn(*args)`` bounded: an ``async`` function on the loop, a sync one in a thread of its own (an
        awaitable a sync function returns is awaited in the same bound). Raises :class:`CallFailed`."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        name = getattr(fn, "__name__", type(fn).__name__)
        try:
            async with asyncio.timeout(limit):
                if is_async(fn):
                    return await fn(*args)
                result = await self._in_thread(fn, *args)
                if asyncio.iscoroutine(result) or isinstance(result, asyncio.Future):
                    result = await result
                return result
        except TimeoutError:
            raise CallFailed("timeout", f"{name} did not return within {limit:g} s") from None
        except CallFailed:
            raise
        except Exception as e:
            raise CallFailed("exception", f"{name} raised {type(e).__name__}: {e}") from e

    async def _in_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self.hung >= self.max_hung:
            raise CallFailed("hung", f"{self.hung} earlier calls still hang past their timeout; not starting more")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        state = {"abandoned": False, "returned": False}

        def settle(ok: bool, value: Any) -> None:  # on the loop
            state["returned"] = True
            if state["abandoned"]:
                self.hung -= 1
            elif not future.done():
                future.set_result(value) if ok else future.set_exception(value)

        def target() -> None:
            try:
                ok, value = True, fn(*args)
            except Exception as e:  # becomes the call's error
                ok, value = False, e
            try:
                loop.call_soon_threadsafe(settle, ok, value)
            except RuntimeError:  # the loop is closed: nobody waits any more
                pass

        threading.Thread(target=target, name=f"rlbus-tool-{getattr(fn, '__name__', 'call')}", daemon=True).start()
        try:
            return await future
        except asyncio.CancelledError:
            if not state["returned"]:  # the thread runs on; settle() counts it back when it returns
                state["abandoned"] = True
                self.hung += 1
            raise

    async def run_calls(self, tools: Mapping[str, ToolSpec], parsed: Parsed, sandbox: Any = None) -> list[ToolResult]:
        """One turn's calls, concurrently, each bounded; results in call order, then one per parse error.
        ``sandbox``: the episode's sandbox handle, passed to the tools that take one."""
        calls = parsed.calls
        results: list[ToolResult | None] = [None] * len(calls)
        runs = []
        for i, c in enumerate(calls):
            self.counters["calls"] += 1
            if i >= self.max_calls:
                self.counters["too_many"] += 1
                results[i] = ToolResult(c.id, c.name, f"error: not run: at most {self.max_calls} tool calls per "
                                                      "message", "too_many")
                continue
            problems = check_call(tools, c.name, c.arguments)
            if problems:
                self.counters["bad_call"] += 1
                results[i] = ToolResult(c.id, c.name, "error: " + "; ".join(problems), "bad_call")
                continue
            spec = tools[c.name]
            if spec.sandbox_arg is not None:
                if sandbox is None:
                    self.counters["bad_call"] += 1
                    results[i] = ToolResult(c.id, c.name, f"error: tool {c.name!r} works in the episode's sandbox, "
                                                          "and this episode has none", "bad_call")
                    continue
                runs.append((i, c, {**c.arguments, spec.sandbox_arg: sandbox}))
                continue
            runs.append((i, c, c.arguments))
        done = await asyncio.gather(*(self._run_one(tools[c.name], c.id, args) for _, c, args in runs))
        for (i, _, _), r in zip(runs, done, strict=True):
            results[i] = r
        out = [r for r in results if r is not None]
        for k, problem in enumerate(parsed.errors):
            self.counters["parse"] += 1
            out.append(ToolResult(f"error_{k}", "error", f"error: {cut(problem, self.max_chars)}", "parse"))
        return out

    async def _run_one(self, spec: ToolSpec, call_id: str, arguments: dict[str, Any]) -> ToolResult:
        try:
            text, ok = await self._rendered(spec, arguments)
        except TimeoutError:
            self.counters["timeout"] += 1
            return ToolResult(call_id, spec.name, f"error: tool {spec.name!r} did not return within "
                                                  f"{self.timeout_s:g} s", "timeout")
        except CallFailed as e:
            kind = "timeout" if e.kind in ("timeout", "hung") else "exception"
            self.counters[kind] += 1
            return ToolResult(call_id, spec.name, f"error: tool {spec.name!r}: {cut(str(e), self.max_chars)}", kind)
        except Exception as e:  # an async tool's own error
            self.counters["exception"] += 1
            return ToolResult(call_id, spec.name, cut(f"error: tool {spec.name!r} raised {type(e).__name__}: {e}",
                                                      self.max_chars), "exception")
        if not ok:
            self.counters["not_json"] += 1
            return ToolResult(call_id, spec.name, f"error: tool {spec.name!r}: {text}", "not_json")
        if text.endswith("characters cut]") and len(text) > self.max_chars:
            self.counters["cut"] += 1
        return ToolResult(call_id, spec.name, text)

    async def _rendered(self, spec: ToolSpec, arguments: dict[str, Any]) -> tuple[str, bool]:
        """The call, bounded where it runs (see the module docstring), and its result as :func:`render` says."""
        fn = spec.fn
        if spec.is_async:
            async with asyncio.timeout(self.timeout_s):
                value = await fn(**arguments)
        else:
            target = self._worker_target(spec)
            if target is not None:
                return await self._in_worker(spec, target, arguments)
            self.counters["in_thread"] += 1
            value = await self.call(lambda: fn(**arguments))
        if _small(value):
            return render(value, self.max_chars)
        return await asyncio.to_thread(render, value, self.max_chars)

    def _worker_target(self, spec: ToolSpec) -> tuple[str, str] | None:
        """Where a worker finds the sync tool (module, qualname), or None: it runs in a thread (said once)."""
        if self.pool is None:
            return None
        target = importable(spec.fn)
        if target is None:
            where = f"{getattr(spec.fn, '__module__', '?')}.{getattr(spec.fn, '__qualname__', spec.name)}"
            if where not in self._said_in_thread:
                self._said_in_thread.add(where)
                log.warning("tool %r (%s) is not a module-level function a worker process can import (a lambda, "
                            "a closure, a method, or defined in __main__ or exec'd code): it runs in a thread of "
                            "the rollout process, abandoned (not stopped) past its timeout", spec.name, where)
        return target

    async def _in_worker(self, spec: ToolSpec, target: tuple[str, str], arguments: dict[str, Any]) -> tuple[str, bool]:
        assert self.pool is not None
        try:
            return await self.pool.call(*RUN_TOOL, (*target, arguments, self.max_chars), timeout_s=self.timeout_s,
                                        wait_s=self.timeout_s, label=spec.name, imports=target[:1])
        except UserCallFailed as e:
            if e.kind == "exception":
                raise CallFailed("exception", f"{spec.name} raised {e}") from None
            if e.kind == "import":
                raise CallFailed("exception", f"{spec.name}: {e}") from None
            if e.kind == "timeout":
                self.counters["killed"] += 1
            raise CallFailed("timeout" if e.kind in ("timeout", "busy") else "exception", str(e)) from None
        except (WorkerPoolError, OSError, RuntimeError, TimeoutError) as e:  # a worker that would not start
            raise CallFailed("exception", f"{spec.name} could not run in a tool worker: {type(e).__name__}: "
                                          f"{e}") from e


def _small(value: Any) -> bool:
    """Cheap to render on the event loop (a string is only cut; anything else may be large JSON)."""
    return isinstance(value, (str, int, float, bool)) or value is None
