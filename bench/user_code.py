"""Where the judge runs user code (a task's reward function): inline, in a thread, or in a worker process.

Figures, measured side by side in one run (calls interleaved so all three see the same load):

* ``inline_us_p50`` / ``thread_us_p50`` / ``process_us_p50``: one ``reward(prompt, completion)`` of the
  addition task, awaited from the event loop: called directly, through ``asyncio.to_thread``, and through
  :class:`services.judge.user_code.ProcessUserCode` (a pickle round trip over a pipe);
  ``ratio_process_vs_thread`` is the process cost over the thread's;
* ``*_loop_lag_ms_max``: while a reward spins in ``while True: pass`` for ``--hang-s`` seconds, the worst
  lateness of a 10 ms ticker on the event loop (what the heartbeat task would suffer). Inline, the loop
  stops for the whole hang (measured with a hang that ends, since an inline one never would); in a thread
  the loop shares the GIL with the spinning thread; in a process it does not;
* ``thread_still_spinning_after_timeout``: the hung thread after ``wait_for`` gave up on it (Python cannot
  kill a thread: it spins, holding its pool slot and half the GIL, until the process exits);
  ``process_replacement_first_call_s``: after the hung worker was killed at the timeout, the first call
  (it starts the replacement worker: Python and the task's imports).

Usage: ``python bench/user_code.py [--calls N] [--hang-s S]``; the last stdout line is a JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.judge.config import UserCodeConfig  # noqa: E402
from services.judge.user_code import ProcessUserCode  # noqa: E402
from services.tasks import get_task  # noqa: E402
from services.tasks.base import Prompt, Reward  # noqa: E402
from services.tasks.graders import UserCodeError  # noqa: E402


class _Spinner:
    """A reward that spins until ``stop`` is set (a hang we can end, to measure the inline case)."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None

    def reward(self, prompt: Prompt, completion: str) -> Reward:
        self.thread = threading.current_thread()
        while not self.stop.is_set():
            pass
        return Reward(0.0)


async def _loop_lag(during: asyncio.Future, period: float = 0.01) -> float:
    """Worst lateness (s) of a ``period`` ticker while ``during`` runs."""
    worst = 0.0
    while not during.done():
        t0 = time.perf_counter()
        await asyncio.sleep(period)
        worst = max(worst, time.perf_counter() - t0 - period)
    return worst


async def main() -> dict[str, float | int | bool | str]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--hang-s", type=float, default=2.0)
    args = ap.parse_args()

    task = get_task("addition")
    prompt = task.eval_prompts()[0]
    # builtin_in_process off: the addition reward is otherwise called in the judge, and this measures the worker
    pool = ProcessUserCode(UserCodeConfig(workers=1, timeout_s=args.hang_s, builtin_in_process=False), {})
    await pool.call("addition", task, "reward", prompt, "0")  # start the worker (not measured)
    times: dict[str, list[float]] = {"inline": [], "thread": [], "process": []}
    for _ in range(args.calls):
        t0 = time.perf_counter()
        task.reward(prompt, "0")
        t1 = time.perf_counter()
        await asyncio.to_thread(task.reward, prompt, "0")
        t2 = time.perf_counter()
        await pool.call("addition", task, "reward", prompt, "0")
        t3 = time.perf_counter()
        times["inline"].append(t1 - t0)
        times["thread"].append(t2 - t1)
        times["process"].append(t3 - t2)
    out: dict[str, float | int | bool | str] = {
        f"{k}_us_p50": round(statistics.median(v) * 1e6, 1) for k, v in times.items()}
    out["ratio_process_vs_thread"] = round(float(out["process_us_p50"]) / float(out["thread_us_p50"]), 2)

    # a hang: inline (ended by us after hang_s, to measure), in a thread (never ends), in a process (killed)
    spinner = _Spinner()
    threading.Timer(args.hang_s, spinner.stop.set).start()
    t0 = time.perf_counter()
    spinner.reward(prompt, "0")  # inline: the event loop cannot run at all until it returns
    out["inline_loop_lag_ms_max"] = round((time.perf_counter() - t0) * 1e3, 1)

    spinner = _Spinner()
    hung = asyncio.ensure_future(asyncio.wait_for(asyncio.to_thread(spinner.reward, prompt, "0"), args.hang_s))
    lag = await _loop_lag(hung)
    out["thread_loop_lag_ms_max"] = round(lag * 1e3, 1)
    out["thread_call_timed_out"] = isinstance(hung.exception(), TimeoutError)
    out["thread_still_spinning_after_timeout"] = spinner.thread is not None and spinner.thread.is_alive()
    spinner.stop.set()  # the bench can end it (the spinner checks a flag); the judge could not end a user's loop

    hang_module = Path(__file__).resolve().parents[1] / "tests" / "judge" / "flaky_task.py"
    if hang_module.exists():
        from tests.judge.flaky_task import FlakyAddition

        flaky = FlakyAddition()
        hang_prompt = Prompt(id="h", text="10+31=", metadata={"answer": "41"})
        call = asyncio.ensure_future(pool.call("flaky-addition", flaky, "reward", hang_prompt, "0"))
        lag = await _loop_lag(call)
        try:
            await call
        except UserCodeError as e:
            out["process_hang_error"] = str(e)
        out["process_loop_lag_ms_max"] = round(lag * 1e3, 1)
        t0 = time.perf_counter()
        await pool.call("addition", task, "reward", prompt, "0")  # the replacement worker answers
        out["process_replacement_first_call_s"] = round(time.perf_counter() - t0, 2)
    await pool.close()
    out["loadavg_1m"] = round(os.getloadavg()[0], 2)
    out["calls"] = args.calls
    out["hang_s"] = args.hang_s
    return out


if __name__ == "__main__":
    result = asyncio.run(main())
    for k, v in result.items():
        print(f"{k:>34}: {v}")
    print(json.dumps(result))
