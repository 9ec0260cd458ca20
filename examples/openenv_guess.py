"""A small OpenEnv environment, written with openenv-core's own server API: guess a number from 1 to 20.

Serve it as an rlbus task (``services/tasks/openenv_env.py`` starts it in a server process of its own)::

    [task]
    name = "openenv"
    [task.options]
    server = "examples.openenv_guess:GuessTheNumber"

or by hand, as any OpenEnv server: ``uvicorn examples.openenv_guess:app --port 8000``.

The number comes from the reset's seed (the same seed, the same number, in every process); each guess is
answered "higher" or "lower" with a turn reward of 0; the right guess ends the episode with reward 1; the
sixth wrong guess ends it with reward 0. The action is a text (``message``): the first integer in it is the
guess; a text without one is answered with a reminder (and counts as a guess).
"""

from __future__ import annotations

import random
import re
import uuid
from typing import Any

from openenv.core.env_server import Action, Environment, Observation, State, create_fastapi_app

LOW, HIGH, GUESSES = 1, 20, 6


class GuessAction(Action):
    """The player's text; its first integer is the guess."""

    message: str


class GuessObservation(Observation):
    """What the player reads next."""

    message: str


class GuessTheNumber(Environment[GuessAction, GuessObservation, State]):
    """One game per session; sessions keep their own state, so one server plays many games at once."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._target = 0
        self._state = State(episode_id=None, step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> GuessObservation:
        self._target = random.Random(seed).randint(LOW, HIGH)
        self._state = State(episode_id=episode_id or str(uuid.uuid4()), step_count=0)
        return GuessObservation(message=f"I am thinking of a number from {LOW} to {HIGH}. You have {GUESSES} "
                                        "guesses; write one number per turn.")

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:
        self._state.step_count += 1
        found = re.search(r"-?\d+", action.message)
        left = GUESSES - self._state.step_count
        if found is not None and int(found.group()) == self._target:
            return GuessObservation(message="Correct!", reward=1.0, done=True)
        if left <= 0:
            return GuessObservation(message=f"No guesses left; it was {self._target}.", reward=0.0, done=True)
        if found is None:
            hint = "Write a number."
        else:
            hint = "Higher." if int(found.group()) < self._target else "Lower."
        return GuessObservation(message=f"{hint} {left} guesses left.", reward=0.0)

    @property
    def state(self) -> State:
        return self._state


#: the same environment as an ASGI app, for uvicorn (what openenv's own ``server/app.py`` modules define)
app = create_fastapi_app(GuessTheNumber, GuessAction, GuessObservation, max_concurrent_envs=16)
