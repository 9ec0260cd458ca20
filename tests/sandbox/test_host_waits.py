"""The backend's waits on descriptors (a process's exit through its pidfd, a pipe to its end) cannot hang.

A destroy waits for the exec server's bubblewrap to exit through a pidfd the event loop watches. If any code on the
loop closed a descriptor without unregistering it, the loop's selector still maps that number; the next descriptor
to get the number (the pidfd) is then never reported by the kernel, since asyncio only swaps the callback, and the
wait hung for good (a CI run's backend close waited 600 s). These tests make exactly that state with real
descriptors and real processes, and check the waits end when the process does.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import time

import pytest

from services.sandbox.host import read_to_eof, readable_now, wait_exited


def _leave_stale_registration(loop: asyncio.AbstractEventLoop) -> int:
    """Register a pipe's read end with ``loop`` and close it without unregistering: the number stays mapped."""
    r, w = os.pipe()
    loop.add_reader(r, lambda: None)
    os.close(r)
    os.close(w)
    return r


def _move_to(fd: int, number: int) -> int:
    """``fd`` under the descriptor number ``number`` (the number a stale registration holds)."""
    if fd != number:
        os.dup2(fd, number)
        os.close(fd)
    return number


async def test_a_pidfd_under_a_stale_registration_reports_the_exit(caplog: pytest.LogCaptureFixture) -> None:
    loop = asyncio.get_running_loop()
    number = _leave_stale_registration(loop)
    child = subprocess.Popen(["sleep", "0.3"])
    pidfd = _move_to(os.pidfd_open(child.pid), number)
    try:
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="rlbus.sandbox.host"):
            assert await wait_exited(pidfd, 30.0)  # before: False after the whole timeout, the exit never reported
        assert time.monotonic() - t0 < 5.0
        assert child.wait(timeout=5) == 0
        assert any("still registered" in r.getMessage() for r in caplog.records)
    finally:
        os.close(pidfd)


async def test_two_waiters_on_one_pidfd_both_see_the_exit() -> None:
    """The second waiter's registration replaces the first's callback: the first must still see the exit."""
    child = subprocess.Popen(["sleep", "0.3"])
    pidfd = os.pidfd_open(child.pid)
    try:
        t0 = time.monotonic()
        both = asyncio.gather(wait_exited(pidfd, 30.0), wait_exited(pidfd, 30.0))  # registered in this order
        assert await asyncio.wait_for(both, 20) == [True, True]
        assert time.monotonic() - t0 < 5.0
    finally:
        child.wait(timeout=5)
        os.close(pidfd)


async def test_a_live_process_is_not_reported_exited() -> None:
    child = subprocess.Popen(["sleep", "30"])
    pidfd = os.pidfd_open(child.pid)
    try:
        assert not await wait_exited(pidfd, 1.5)  # past one backstop look: still running
        assert not readable_now(pidfd)
    finally:
        child.kill()
        child.wait(timeout=5)
        os.close(pidfd)


async def test_a_pipe_under_a_stale_registration_is_read_to_its_end() -> None:
    loop = asyncio.get_running_loop()
    number = _leave_stale_registration(loop)
    r, w = os.pipe()
    r = _move_to(r, number)
    os.write(w, b"child-pid 42")
    os.close(w)  # at EOF before the read registers: only a registration that reaches the kernel reports it
    assert await asyncio.wait_for(read_to_eof(r), 10) == b"child-pid 42"


def test_a_closed_descriptor_is_an_error_not_a_wait() -> None:
    r, w = os.pipe()
    os.close(r)
    os.close(w)
    with pytest.raises(OSError, match="not open"):
        readable_now(r)
