"""TextArena's single-player games as multi-turn environments: one prompt is one game, played turn by turn.

Run-file form::

    [task]
    name = "textarena"
    options = { game = "GuessTheNumber-v0", eval_size = 100 }

Needs the ``textarena`` package (``pip install "rlbus[envs]"``); it is imported only when this task is named
(the registry loads this module lazily), never at ``import services.tasks``.

**A prompt is one game seed.** The eval split is the games seeded ``eval_seed .. eval_seed + eval_size - 1``
(below 2**31); training prompt ``k`` of run seed ``s`` is the game seeded from a hash of ``(game, s, k)``
(from 2**31 up, so never an eval game), so a resumed trainer continues exactly. The prompt's messages are
the optional system message and the game's first observation (its rules and, for board games, the board)
as the user turn. Many games show the same first observation whatever the seed (GuessTheNumber hides its
number): prompts then differ by their seed alone (``metadata["game_seed"]``).

**An episode** (``services/rollout/episode.py``): ``reset(prompt)`` starts a fresh game with the prompt's
seed, checks that its first observation is the prompt's (the trainer rendered the prompt into the ticket's
tokens; a game whose first observation is not a function of its seed cannot be used) and keeps the game in
``Start.state``; ``step`` plays the assistant's text as the player's action and answers with the game's new
messages as one user message (the chat holds the history: the game's own history-repeating observation
wrapper is not used, nor the echo of the player's action). The episode ends when the game does.

**Actions** are the assistant's whole text, through the game's own action wrappers: for nearly every game
``ActionFormattingWrapper``, which puts a text without any bracket in brackets (``A C`` -> ``[A C]``). The
game reads its move from the text as it always does, usually the first ``[...]`` (GuessTheNumber ``[12]``,
TowerOfHanoi ``[A C]``, Minesweeper ``[3 4]``, FrozenLake ``[up]``): the game's prompt says which.

**Invalid moves** follow the game's own rule (``SinglePlayerState``, one error allowed): the first invalid
move is answered with the game's explanation and the player moves again; a second one in a row ends the
game with the game's penalty reward (often its progress so far, e.g. TowerOfHanoi's share of disks placed).

**Reward.** When the game ends, its reward for the player (``env.close()``) is the reward of the episode's
last turn (``Step.reward``), so the episode's reward (turn rewards + the judge's final score) is the game's:
``reward(prompt, completion)``, the judge's final score, is 0.0. An episode cut by the loop's budgets
(``turn_limit``, ...) before the game ends has no game reward (0). Rewards are the game's, not always in
[0, 1] (some games give -1 for a loss).

**Randomness.** TextArena games draw from Python's global ``random`` (seeded by the game's state on reset),
so every call into a game holds one process-wide lock and runs on the episode's own random state (saved in
the episode after each call, the process's state restored): concurrent episodes cannot disturb each other
and an episode is a function of its seed and its actions.

Not supported: games for two or more players (they need opponents), games whose reset needs the network
(Wordle, Hangman and the other word games download NLTK corpora at import unless ``NLTK_DATA`` holds them;
with them present they run offline), and constructor options of a game (choose a registered variant, e.g.
``TowerOfHanoi-v0-medium``).
"""

from __future__ import annotations

import hashlib
import inspect
import itertools
import random
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from services.runtime.config import ConfigError
from services.tasks.base import Prompt, Reward, did_you_mean, encode_chat, encode_text, register_task
from services.tasks.env import Action, Start, Step

#: game seeds: the eval split below TRAIN_SEED_BASE, the training stream from it up to 2**32
TRAIN_SEED_BASE = 2**31
#: seconds a game call waits for another episode's game call to finish (games are short pure-Python calls)
LOCK_TIMEOUT_S = 10.0
INSTALL_HINT = 'pip install "rlbus[envs]" (or pip install textarena)'
#: every call into a game: TextArena games share Python's global ``random``
_GAME_LOCK = threading.Lock()


class TextArenaError(ConfigError):
    """An option of the textarena task is unusable (the message names the key). A :class:`ConfigError`:
    retrying cannot help, the run file must change."""


def _textarena() -> Any:
    try:
        import textarena
    except ImportError as e:
        raise TextArenaError(f"task 'textarena' needs the textarena package ({e}): {INSTALL_HINT}") from e
    return textarena


@dataclass
class Game:
    """One episode's game (``Start.state``/``Step.state``): the TextArena env and its random state."""

    env: Any
    seed: int
    rng: Any = None
    first: str = ""


@contextmanager
def _game_random(game: Game) -> Iterator[None]:
    """Run a game call on the episode's random state, one call in the process at a time."""
    if not _GAME_LOCK.acquire(timeout=LOCK_TIMEOUT_S):
        raise RuntimeError(f"another TextArena game call held the lock for over {LOCK_TIMEOUT_S:g} s")
    try:
        outer = random.getstate()
        if game.rng is not None:
            random.setstate(game.rng)
        try:
            yield
        finally:
            game.rng = random.getstate()
            random.setstate(outer)
    finally:
        _GAME_LOCK.release()


def _innermost(env: Any) -> Any:
    ta = _textarena()
    while isinstance(env, ta.Wrapper):
        env = env.env
    return env


def _new_messages(game: Game) -> str:
    """The game's messages to the player since the last call, without the echo of the player's own action
    (single-player games: every ``PLAYER_ACTION`` message is the player's, whatever sender the game gave it)."""
    ta = _textarena()
    _, messages = _innermost(game.env).get_observation()
    return "\n".join(str(text) for _, text, kind in messages if kind != ta.ObservationType.PLAYER_ACTION)


@register_task("textarena")
class TextArenaTask:
    """One TextArena single-player game as an environment (see the module docstring).

    Args:
        game: the TextArena env id (``GuessTheNumber-v0``, ``TowerOfHanoi-v0``, ``Minesweeper-v0-small``, ...).
        eval_size: games (seeds) in the fixed eval split.
        eval_seed: the first eval game's seed (0 <= eval_seed, eval_seed + eval_size <= 2**31).
        system_prompt: a system message before the game's first observation; ``""`` (default): none (the
            game's own first message states the rules and the move format).
        max_new_tokens: the completion budget of one assistant turn (one move).
    """

    name = "textarena"
    stop: list[str] = []

    def __init__(self, game: str = "", eval_size: int = 100, eval_seed: int = 20261202, system_prompt: str = "",
                 max_new_tokens: int = 256, **unknown: Any) -> None:
        if unknown:
            known = [k for k in inspect.signature(TextArenaTask).parameters if k != "unknown"]
            key = sorted(unknown)[0]
            raise TextArenaError(f"task.options.{key}: unknown option of the textarena task; "
                                 f"{did_you_mean(key, known)}known: {', '.join(known)}")
        ta = _textarena()
        from textarena.envs.registration import ENV_REGISTRY

        games = sorted(ENV_REGISTRY)
        if not game:
            raise TextArenaError("task.options.game: name a TextArena game (e.g. GuessTheNumber-v0); "
                                 f"{len(games)} are registered (textarena.envs.registration.ENV_REGISTRY)")
        if game not in ENV_REGISTRY:
            close = did_you_mean(game, games)
            raise TextArenaError(f"task.options.game: {game!r} is not a TextArena game; {close or 'no close match; '}"
                                 f"{len(games)} are registered (textarena.envs.registration.ENV_REGISTRY)")
        if eval_size < 1:
            raise TextArenaError(f"task.options.eval_size: must be at least 1, got {eval_size}")
        if not 0 <= eval_seed <= TRAIN_SEED_BASE - eval_size:
            raise TextArenaError(f"task.options.eval_seed: must be in 0..{TRAIN_SEED_BASE - eval_size} (so the "
                                 f"eval games' seeds stay below the training stream's), got {eval_seed}")
        if max_new_tokens < 1:
            raise TextArenaError(f"task.options.max_new_tokens: must be at least 1, got {max_new_tokens}")
        self._ta = ta
        self.game, self.eval_size, self.eval_seed = game, eval_size, eval_seed
        self.system_prompt, self.max_new_tokens = system_prompt, max_new_tokens
        # one game now, twice: a game that cannot start here, or starts differently, fails at start-up
        try:
            first, again = self._start(eval_seed).first, self._start(eval_seed).first
        except Exception as e:  # the game's own error, of any type: the game is what to change
            raise TextArenaError(f"task.options.game: {game!r} cannot start a single-player game here: "
                                 f"{type(e).__name__}: {' '.join(str(e).replace('*', '').split())[:300]}{_hint(e)}") from e
        if first != again:
            raise TextArenaError(f"task.options.game: {game!r} starts differently twice with seed {eval_seed}: "
                                 "its first observation is not a function of its seed, which the prompt needs")

    # --- games ---

    def _start(self, seed: int) -> Game:
        """A fresh game with ``seed``, its first observation read."""
        game = Game(env=None, seed=seed)
        with _game_random(game):  # built inside too: a game's constructor may draw from random
            game.env = self._ta.make(self.game)
            game.env.reset(num_players=1, seed=seed)
            game.first = _new_messages(game)
        return game

    def _train_seed(self, seed: int, position: int) -> int:
        h = int.from_bytes(hashlib.sha256(f"textarena-train:{self.game}:{seed}:{position}".encode()).digest()[:8])
        return TRAIN_SEED_BASE + h % TRAIN_SEED_BASE

    def _prompt(self, prompt_id: str, game_seed: int) -> Prompt:
        first = self._start(game_seed).first
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        messages.append({"role": "user", "content": first})
        return Prompt(id=prompt_id, text=first, messages=messages,
                      metadata={"game": self.game, "game_seed": str(game_seed)})

    # --- prompts ---

    def train_prompts(self, seed: int, start: int = 0) -> Iterator[Prompt]:
        """Endless; prompt id ``textarena/<game>/train/<seed>/<position>``, one game seed each."""
        for position in itertools.count(start):
            yield self._prompt(f"textarena/{self.game}/train/{seed}/{position}", self._train_seed(seed, position))

    @cached_property
    def _eval(self) -> list[Prompt]:
        return [self._prompt(f"textarena/{self.game}/eval/{k}", self.eval_seed + k) for k in range(self.eval_size)]

    def eval_prompts(self) -> list[Prompt]:
        """The held-out games; prompt id ``textarena/<game>/eval/<k>`` (seed ``eval_seed + k``)."""
        return list(self._eval)

    def format_prompt(self, tokenizer: Any, prompt: Prompt) -> list[int]:
        """The chat template over the messages (contents joined by blank lines when the tokenizer has none)."""
        if not prompt.messages:
            raise ValueError(f"prompt {prompt.id} has no messages; textarena prompts are chat prompts")
        if getattr(tokenizer, "chat_template", None):
            return encode_chat(tokenizer, prompt.messages)
        return encode_text(tokenizer, "\n\n".join(m["content"] for m in prompt.messages) + "\n\n")

    # --- the environment ---

    def reset(self, prompt: Prompt) -> Start:
        """The game of the prompt's seed; its first observation must be the prompt's."""
        if prompt.metadata.get("game") != self.game:
            raise ValueError(f"prompt {prompt.id} is a game of {prompt.metadata.get('game')!r}, not of this "
                             f"task's {self.game!r}: run the rollout with the trainer's run file")
        try:
            seed = int(prompt.metadata["game_seed"])
        except (KeyError, ValueError) as e:
            raise ValueError(f"prompt {prompt.id} carries no game seed (metadata 'game_seed'); was it made by "
                             "this task?") from e
        game = self._start(seed)
        if game.first != prompt.text:
            raise ValueError(f"{self.game} with seed {seed} starts with another observation than prompt "
                             f"{prompt.id} shows: the game's first observation is not a function of its seed")
        return Start(messages=list(prompt.messages or []), state=game)

    def step(self, state: Game, action: Action) -> Step:
        """The assistant's text played as the move; the game's answer, or its reward when it ends."""
        with _game_random(state):
            done, _ = state.env.step(action.text)
            text = _new_messages(state)
            rewards = state.env.close()[0] if done else None
        if not done:
            return Step(observations=[{"role": "user", "content": text}] if text else [], state=state)
        if not rewards or 0 not in rewards:
            raise RuntimeError(f"{self.game} ended without a reward for the player (rewards {rewards!r})")
        return Step(reward=float(rewards[0]), done=True, state=state)

    def reward(self, prompt: Prompt, completion: str) -> Reward:
        """0.0: the game's reward is the episode's last turn reward, which the judge adds to this."""
        return Reward(0.0, f"the reward came from {self.game}'s turns (the game's reward is the last turn's)")


def _hint(error: Exception) -> str:
    if isinstance(error, LookupError) and "nltk" in str(error).lower():
        return (" (the game needs NLTK data: python -m nltk.downloader words averaged_perceptron_tagger_eng, "
                "or set NLTK_DATA to a folder holding them)")
    if isinstance(error, AssertionError) and "number of players" in str(error):
        return " (a game for several players: the textarena task plays single-player games)"
    return ""
