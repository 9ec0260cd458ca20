"""The tools of ``bench/episode_overhead.py``, in a module of their own: a tool worker process imports it to
run :func:`wait_worker` (``services/rollout/tool_runner.py``), so it imports nothing heavy."""

from __future__ import annotations

import asyncio
import time


async def wait_async(seconds: float) -> str:
    """Wait on the event loop (an async tool).

    Args:
        seconds: how long.
    """
    await asyncio.sleep(seconds)
    return "done"


def wait_worker(seconds: float) -> str:
    """Wait in a tool worker process (a sync module-level tool).

    Args:
        seconds: how long.
    """
    time.sleep(seconds)
    return "done"
