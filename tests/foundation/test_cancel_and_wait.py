"""``cancel_and_wait`` stops a task even when its first cancellation is lost.

On Python 3.11 ``asyncio.wait_for`` returns its inner result instead of raising when the cancellation arrives in
the same loop step as that result, which is what a JetStream request does when its ack lands as a service stops.
The loop below has the shape of the services' background loops (a request, then a wait); it is stopped only by
cancellation, and the test makes the lost cancellation certain rather than timing-bound.
"""

from __future__ import annotations

import asyncio
import logging
import sys

import pytest

from services.runtime.tasks import cancel_and_wait


async def _loop_that_loses_a_cancel(replies: asyncio.Queue[asyncio.Future[str]], waits: list[str]) -> None:
    loop = asyncio.get_running_loop()
    idle = asyncio.Event()
    while True:
        reply: asyncio.Future[str] = loop.create_future()
        await replies.put(reply)
        await asyncio.wait_for(reply, 30)  # a request and its ack
        waits.append("idle")
        await idle.wait()  # then waits for more work, which never comes


async def _start(waits: list[str]) -> tuple[asyncio.Task[None], asyncio.Future[str]]:
    replies: asyncio.Queue[asyncio.Future[str]] = asyncio.Queue()
    task = asyncio.create_task(_loop_that_loses_a_cancel(replies, waits), name="loses-a-cancel")
    reply = await asyncio.wait_for(replies.get(), 10)
    return task, reply


async def test_a_lost_cancellation_is_made_again_and_the_task_ends(caplog: pytest.LogCaptureFixture) -> None:
    waits: list[str] = []
    task, reply = await _start(waits)
    reply.set_result("ack")  # the ack lands ...
    with caplog.at_level(logging.WARNING, logger="rlbus.runtime.tasks"):
        await asyncio.wait_for(cancel_and_wait(task, retry_s=0.2), 10)  # ... as the stop cancels
    assert task.cancelled()
    if sys.version_info < (3, 12):  # the first cancellation was swallowed: the loop went back to its wait
        assert waits == ["idle"]
        assert any("went on after their cancellation" in r.getMessage() and "loses-a-cancel" in r.getMessage()
                   for r in caplog.records)


async def test_what_one_cancel_and_wait_without_retry_would_do_on_this_python() -> None:
    """The same race with a single cancel: on 3.11 the task is still running afterwards (why the helper exists)."""
    waits: list[str] = []
    task, reply = await _start(waits)
    reply.set_result("ack")
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=0.5)
    if sys.version_info < (3, 12):
        assert not done and waits == ["idle"]
    await cancel_and_wait(task, retry_s=0.2)
    assert task.done()


async def test_outcomes_stay_on_the_tasks_and_none_entries_are_skipped() -> None:
    async def fails() -> None:
        raise ValueError("boom")

    async def returns() -> int:
        return 7

    failed, finished = asyncio.create_task(fails()), asyncio.create_task(returns())
    await asyncio.wait({failed, finished})
    sleeper = asyncio.create_task(asyncio.sleep(60))
    await cancel_and_wait(failed, None, finished, sleeper)
    assert isinstance(failed.exception(), ValueError) and finished.result() == 7 and sleeper.cancelled()
