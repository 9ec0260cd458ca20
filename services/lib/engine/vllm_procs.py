"""vLLM's processes (``VLLM::EngineCore`` and its ``VLLM::Worker``\\ s) end with the engine that started them.

* **Owner dies** (any way, SIGKILL included): a watchdog (:class:`services.runtime.lifeline.Reaper`) that
  holds the processes started while the engine started kills them.
* **Owner stops** (:meth:`EngineProcesses.close`): vLLM's own shutdown gets :data:`SHUTDOWN_BOUND_S`, then
  what is left is killed (SIGTERM, SIGKILL after a grace).
* **One of them dies**: seen within :data:`WATCH_PERIOD_S`; the others are killed at once (vLLM's client
  then fails every pending request with ``EngineDeadError``) and :attr:`EngineProcesses.died` says which.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any

from services.runtime import lifeline

log = logging.getLogger("rlbus.engine.vllm")

#: how often the engine checks that its vLLM processes are alive
WATCH_PERIOD_S = 0.5
#: seconds vLLM's own shutdown gets before the processes left are killed
SHUTDOWN_BOUND_S = 20.0
#: seconds between SIGTERM and SIGKILL when the processes are killed
KILL_GRACE_S = 2.0


def without_expandable_segments(env: dict[str, str]) -> str:
    """Take ``expandable_segments`` out of ``env``'s ``PYTORCH_CUDA_ALLOC_CONF`` (vLLM's sleep-mode allocator
    refuses to start with it; a GPU trainer in the same process sets it, and vLLM's processes inherit the
    environment) and return what was taken out ("" when nothing was)."""
    conf = env.get("PYTORCH_CUDA_ALLOC_CONF", "")
    parts = [p for p in conf.split(",") if p.strip()]
    kept = [p for p in parts if not p.strip().startswith("expandable_segments")]
    if len(kept) == len(parts):
        return ""
    if kept:
        env["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(kept)
    else:
        del env["PYTORCH_CUDA_ALLOC_CONF"]
    return ",".join(p for p in parts if p not in kept)


class EngineProcesses:
    """The processes of one vLLM engine: started inside :meth:`starting`, watched, ended with the owner."""

    def __init__(self) -> None:
        self.reaper: lifeline.Reaper | None = None
        self.died = ""  # why the engine is dead ("vLLM process [pid] exited"), "" while it is not
        self._watch: asyncio.Task[None] | None = None

    async def start(self, build: Callable[[], Any]) -> Any:
        """``build()`` (in a thread) with every process it starts handed to a watchdog; its result."""
        self.reaper = lifeline.Reaper(grace_s=KILL_GRACE_S)
        before = lifeline.descendants()
        try:
            return await asyncio.to_thread(build)
        except BaseException:
            self.reaper.track(lifeline.descendants() - before)
            await self.close()
            raise
        finally:
            if self.reaper is not None:
                self.reaper.track(lifeline.descendants() - before)

    def watch(self, running: Callable[[], bool]) -> None:
        """From now on, while ``running()``: a process that exits kills the others and sets :attr:`died`."""
        self.died = ""
        self._watch = asyncio.create_task(self._follow(running), name="vllm-process-watch")

    async def _follow(self, running: Callable[[], bool]) -> None:
        reaper = self.reaper
        assert reaper is not None
        while running() and len(reaper.alive()) == len(reaper.tracked):
            await asyncio.sleep(WATCH_PERIOD_S)
        if running():
            gone = sorted(set(reaper.tracked) - set(reaper.alive()))
            self.died = f"vLLM process {gone} exited"
            log.error("the vllm engine died: %s; killing its other processes", self.died)
            await asyncio.to_thread(reaper.kill, 0.5)

    async def shutdown(self, llm: Any) -> None:
        """``llm.shutdown()`` within :data:`SHUTDOWN_BOUND_S`, from a daemon thread: a shutdown that hangs
        (a dead worker) does not hold this process at exit; :meth:`close` kills what it left."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def shut() -> None:
            try:
                llm.shutdown()
            except Exception as e:
                log.warning("vLLM shutdown failed: %s", e)
            finally:
                loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))

        threading.Thread(target=shut, name="vllm-shutdown", daemon=True).start()
        try:
            await asyncio.wait_for(asyncio.shield(done), SHUTDOWN_BOUND_S)
        except TimeoutError:
            log.warning("vLLM did not shut down within %.0fs; killing its processes", SHUTDOWN_BOUND_S)

    async def close(self) -> None:
        """Stop watching, kill what is still running and let the watchdog go."""
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)
            self._watch = None
        reaper, self.reaper = self.reaper, None
        if reaper is not None:
            left = await asyncio.to_thread(reaper.kill)
            if left:
                log.warning("vLLM processes %s were still running after shutdown; killed", left)
            await asyncio.to_thread(reaper.close)
