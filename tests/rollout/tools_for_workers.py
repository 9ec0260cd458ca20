"""Function tools of the test environments, in a module of their own: sync ones run in tool worker processes,
which import this module (``services/rollout/tool_runner.py``), so it imports nothing heavy (``env_harness``
imports transformers, seconds per worker).
"""

from __future__ import annotations

import asyncio
import os
import time


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first.
        b: the second.
    """
    return a + b


async def multiply(a: float, b: float) -> float:
    """Multiply two numbers."""
    await asyncio.sleep(0)
    return a * b


def boom(x: int) -> int:
    """Raise."""
    raise ZeroDivisionError("the tool divided by zero")


def hang(x: int) -> int:
    """Hang in a sync call (its worker is killed past the timeout)."""
    time.sleep(30)
    return x


async def hang_async(x: int) -> int:
    """Hang in an async call (cancelled past the timeout)."""
    await asyncio.sleep(30)
    return x


def opaque(x: int) -> object:
    """Return something that is not JSON."""
    return object()


def huge(x: int) -> str:
    """Return 100 MB."""
    return "x" * 100_000_000


def spin(x: int) -> int:
    """Spin on a core, holding the GIL, forever."""
    while True:
        x += 1


def whoami(x: int) -> dict[str, int]:
    """The process the call ran in."""
    return {"pid": os.getpid()}


def stamp(seconds: float) -> dict[str, float]:
    """Sleep; say when (wall clock) and where the call ran."""
    start = time.time()
    time.sleep(seconds)
    return {"pid": os.getpid(), "start": start, "end": time.time()}


def die(x: int) -> int:
    """Kill the process the call runs in."""
    os._exit(3)
