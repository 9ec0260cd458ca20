"""Feeding stdin to a process and collecting its output under a size cap and a wall-time limit.

Shared by the backends. Output beyond the cap is read and discarded (so the
process never blocks on a full pipe) and flagged as truncated; what was read
before a timeout is kept.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass

CHUNK = 1 << 16
#: after a kill, how long to wait for the pipes to close before giving up on the rest of the output
KILL_GRACE_S = 2.0


class _Capped:
    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.buf = bytearray()
        self.total = 0

    @property
    def truncated(self) -> bool:
        return self.total > self.cap

    async def drain(self, stream: asyncio.StreamReader) -> None:
        while True:
            chunk = await stream.read(CHUNK)
            if not chunk:
                return
            room = self.cap - len(self.buf)
            if room > 0:
                self.buf += chunk[:room]
            self.total += len(chunk)


async def _feed(stdin: asyncio.StreamWriter | None, data: bytes) -> None:
    if stdin is None:
        return
    try:
        if data:
            stdin.write(data)
            await stdin.drain()
        stdin.close()
        await stdin.wait_closed()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the process exited or closed stdin without reading it all: not an error


@dataclass
class Outcome:
    """What a foreground exec produced."""

    returncode: int | None
    stdout: bytes
    stderr: bytes
    stdout_truncated: bool
    stderr_truncated: bool
    timed_out: bool
    #: total bytes the process wrote (including what the cap discarded)
    stdout_bytes: int
    stderr_bytes: int


async def communicate(
    proc: asyncio.subprocess.Process,
    stdin: bytes,
    max_output_bytes: int,
    timeout_s: float,
    kill: Callable[[], None],
) -> Outcome:
    """Run ``proc`` to completion or until ``timeout_s``, then call ``kill`` and collect what there is."""
    out, err = _Capped(max_output_bytes), _Capped(max_output_bytes)
    tasks = []
    if proc.stdout is not None:
        tasks.append(asyncio.create_task(out.drain(proc.stdout), name="sandbox-exec-stdout"))
    if proc.stderr is not None:
        tasks.append(asyncio.create_task(err.drain(proc.stderr), name="sandbox-exec-stderr"))
    feeder = asyncio.create_task(_feed(proc.stdin, stdin), name="sandbox-exec-stdin")
    waiter = asyncio.create_task(proc.wait(), name="sandbox-exec-wait")
    pending = {*tasks, waiter}
    timed_out = False
    try:
        _, pending = await asyncio.wait(pending, timeout=timeout_s)
        if pending:
            timed_out = True
            kill()
            _, pending = await asyncio.wait(pending, timeout=KILL_GRACE_S)
    finally:
        for t in (*pending, feeder):
            t.cancel()
        for t in (*pending, feeder):
            with contextlib.suppress(asyncio.CancelledError):
                await t
    rc = proc.returncode
    return Outcome(
        returncode=rc,
        stdout=bytes(out.buf),
        stderr=bytes(err.buf),
        stdout_truncated=out.truncated,
        stderr_truncated=err.truncated,
        timed_out=timed_out,
        stdout_bytes=out.total,
        stderr_bytes=err.total,
    )


def exit_code(returncode: int | None) -> int | None:
    """Shell convention: a process killed by signal N exits with 128 + N."""
    if returncode is None:
        return None
    return 128 - returncode if returncode < 0 else returncode
