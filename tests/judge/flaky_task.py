"""A task plugin whose reward function misbehaves on some prompts, as a careless user's might.

Addition, except that the reward, chosen by the prompt's position in its stream (the number its id ends
with) modulo 10, so that every misbehaviour meets a short run:

* 1 — never returns (an infinite loop);
* 2 — raises ValueError;
* 3 — returns NaN;
* 4 — returns 2.0 (outside [0, 1]);
* 5 — kills its own process (SIGKILL), like a segfaulting C extension;
* 6 — prints to stdout, then the normal reward;
* anything else — the normal exact-match reward.

The loop test installs it as a real ``rlbus.tasks`` entry point (a dist-info on PYTHONPATH), so every
service process finds it the way a user's plugin is found; importing the module registers it too.
"""

from __future__ import annotations

import os
import signal

from services.tasks.addition import AdditionTask
from services.tasks.base import Prompt, Reward, register_task

BEHAVIOURS = {1: "hang", 2: "raise", 3: "nan", 4: "out_of_range", 5: "die", 6: "print"}


def behaviour(prompt_id: str) -> str:
    return BEHAVIOURS.get(int(prompt_id.rsplit("/", 1)[-1]) % 10, "ok")


@register_task("flaky-addition")
class FlakyAddition(AdditionTask):
    name = "flaky-addition"

    def reward(self, prompt: Prompt, completion: str) -> Reward:
        what = behaviour(prompt.id)
        if what == "hang":
            while True:
                pass
        if what == "raise":
            raise ValueError(f"cannot grade {completion!r}")
        if what == "nan":
            return Reward(float("nan"), "not a number")
        if what == "out_of_range":
            return Reward(2.0, "double credit")
        if what == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        if what == "print":
            print(f"grading {prompt.text}{completion}")
        return super().reward(prompt, completion)


@register_task("rare-hang-addition")
class RareHangAddition(AdditionTask):
    """Addition whose reward hangs on one prompt in ``hang_every`` (its position modulo ``hang_every`` is
    ``hang_every // 2``; 0: never), spinning (``hang = "spin"``, a CPU-bound loop) or blocked (``"sleep"``,
    a call that waits on something that never answers). ``bench/hanging_reward.py`` measures the cost."""

    name = "rare-hang-addition"

    def __init__(self, hang_every: int = 100, hang: str = "spin", **options) -> None:
        super().__init__(**options)
        self.hang_every, self.hang = hang_every, hang

    def reward(self, prompt: Prompt, completion: str) -> Reward:
        position = int(prompt.id.rsplit("/", 1)[-1])
        if self.hang_every and position % self.hang_every == self.hang_every // 2:
            if self.hang == "sleep":
                import time

                while True:
                    time.sleep(3600)
            while True:
                pass
        return super().reward(prompt, completion)
