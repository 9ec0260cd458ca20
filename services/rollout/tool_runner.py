"""Bounded calls of user code in the rollout: function tools and environment hooks.

**In-process, not worker processes** (the judge runs rewards in worker processes, ``user_code.py``; the
rollout does not). A tool call is on the episode's critical path between two generations, many per episode
and thousands per step, and most tools are I/O (an HTTP API, a database, a search index) written ``async``:
they belong on the event loop, where a timeout cancels them for real. Worker processes would add a pickle
round trip per call, require arguments, results *and the environment* to be rebuilt in the worker (tools
are often closures or methods holding a client), and a pool per task. So:

* an ``async def`` tool runs on the event loop under ``asyncio.timeout(timeout_s)``; past it, it is cancelled;
* a sync tool runs in a **daemon thread of its own** (not the loop's default executor, which a few hung calls
  would fill) and is awaited under the same timeout; past it the thread is *abandoned* (Python cannot stop a
  thread): the episode gets its error observation at once, the event loop and every other episode go on.
  Abandoned threads still running are counted (``hung``); past ``max_hung`` of them, sync calls fail at once
  with an error observation instead of starting more threads, until some return.

The price: a sync tool spinning in pure Python holds the GIL half the time until it returns, slowing this
process (not stalling it), and an ``async`` tool that blocks the loop (``time.sleep``) cannot be bounded.
Untrusted or CPU-heavy code belongs in the sandbox (sandbox environments) or behind an ``async`` client.

**Every failure is an observation**, never an exception out of :meth:`ToolRunner.run_calls`: an unknown tool
or wrong arguments (``bad_call``), a raise (``exception``), a timeout (``timeout``), a result that is not
JSON-serialisable (``not_json``); a result longer than ``max_chars`` is cut with a note (``cut``, not an
error). Each kind is counted in :attr:`ToolRunner.counters`. A string result is passed as is; anything else
as its JSON text. Rendering a large result runs off the event loop.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Mapping
from typing import Any

from services.tasks.env import ToolResult
from services.tasks.function_tools import ToolSpec, check_call, is_async
from services.tasks.toolcalls import Parsed


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


class ToolRunner:
    """Runs calls of user code bounded; one instance serves every episode of a rollout process."""

    def __init__(self, timeout_s: float, max_chars: int, max_calls: int = 8, max_hung: int = 64) -> None:
        self.timeout_s = timeout_s
        self.max_chars = max_chars
        self.max_calls = max_calls
        self.max_hung = max_hung
        #: sync calls abandoned past their timeout and still running
        self.hung = 0
        self.counters: dict[str, int] = {"calls": 0, "timeout": 0, "exception": 0, "not_json": 0, "bad_call": 0,
                                         "parse": 0, "cut": 0, "too_many": 0}

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

    async def run_calls(self, tools: Mapping[str, ToolSpec], parsed: Parsed) -> list[ToolResult]:
        """One turn's calls, concurrently, each bounded; results in call order, then one per parse error."""
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
            runs.append((i, c))
        done = await asyncio.gather(*(self._run_one(tools[c.name], c.id, c.arguments) for _, c in runs))
        for (i, _), r in zip(runs, done, strict=True):
            results[i] = r
        out = [r for r in results if r is not None]
        for k, problem in enumerate(parsed.errors):
            self.counters["parse"] += 1
            out.append(ToolResult(f"error_{k}", "error", f"error: {cut(problem, self.max_chars)}", "parse"))
        return out

    async def _run_one(self, spec: ToolSpec, call_id: str, arguments: dict[str, Any]) -> ToolResult:
        fn = spec.fn
        try:
            if spec.is_async:
                async with asyncio.timeout(self.timeout_s):
                    value = await fn(**arguments)
            else:
                value = await self.call(lambda: fn(**arguments))
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
        if _small(value):
            text, ok = render(value, self.max_chars)
        else:
            text, ok = await asyncio.to_thread(render, value, self.max_chars)
        if not ok:
            self.counters["not_json"] += 1
            return ToolResult(call_id, spec.name, f"error: tool {spec.name!r}: {text}", "not_json")
        if text.endswith("characters cut]") and len(text) > self.max_chars:
            self.counters["cut"] += 1
        return ToolResult(call_id, spec.name, text)


def _small(value: Any) -> bool:
    """Cheap to render on the event loop (a string is only cut; anything else may be large JSON)."""
    return isinstance(value, (str, int, float, bool)) or value is None
