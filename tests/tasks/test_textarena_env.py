"""The textarena task (services/tasks/textarena_env.py) over the real textarena package, offline.

Episodes run through the real episode loop (``services.rollout.episode.EpisodeLoop``) with the real games, the
real chat-template framing and the judge's real turn-reward sum. The assistant turns come from
``env_harness.ReplayEngine``, an engine stand-in that replays fixed texts: the tiny test model does not play
the games (it would not write a valid move, let alone a winning line), and a win, a loss and an invalid move
each need a known line of play. GuessTheNumber's line is known from the seed: the game draws its number with
``random.seed(seed); random.randint(1, 20)``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rollout"))  # env_harness, as tests/rollout use it
from env_harness import ReplayEngine, tools_tokenizer  # noqa: E402

from proto.rollouts import Rollout  # noqa: E402
from services.judge.service import with_turn_rewards  # noqa: E402
from services.lib.engine.base import SamplingParams  # noqa: E402
from services.rollout.config import AgentSection  # noqa: E402
from services.rollout.episode import EpisodeLoop  # noqa: E402
from services.tasks import get_task  # noqa: E402
from services.tasks.base import Task  # noqa: E402
from services.tasks.env import Action, is_environment  # noqa: E402
from services.tasks.graders import Grading  # noqa: E402
from services.tasks.textarena_env import TextArenaError, TextArenaTask  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TOK = tools_tokenizer()
PARAMS = SamplingParams(max_new_tokens=64)


def task(game: str = "GuessTheNumber-v0", **options) -> TextArenaTask:
    return get_task("textarena", game=game, eval_size=options.pop("eval_size", 3), **options)


def target_of(prompt) -> int:
    """GuessTheNumber's number for the prompt's seed (the game: ``random.seed(seed); randint(1, 20)``)."""
    return random.Random(int(prompt.metadata["game_seed"])).randint(1, 20)


async def play(t: TextArenaTask, prompt, texts: list[str], max_turns: int = 16):
    loop = EpisodeLoop(ReplayEngine.of_texts(TOK, texts), TOK, AgentSection(max_turns=max_turns))
    out = await loop.run(t, prompt, t.format_prompt(TOK, prompt), PARAMS)
    return out, loop


def episode_reward(t: TextArenaTask, prompt, out) -> float:
    """The reward the judge gives the episode: the task's final score plus the turn rewards."""
    rollout = Rollout(run_id="ta", task="textarena", group_id="g", prompt_id=prompt.id, sample_index=0,
                      group_size=1, prompt_ids=[], turns=out.turns, finish_reason=out.finish_reason,
                      policy_version=0)
    final = t.reward(prompt, "".join(out.assistant_texts))
    assert final.value == 0.0 and "turns" in final.explanation
    return with_turn_rewards(Grading(final.value, []), rollout).reward


# --- the task by name, its prompts ----------------------------------------------------------------------


def test_the_task_by_name_is_an_environment_with_a_prompt_per_game_seed():
    t = task(system_prompt="Play well.")
    assert isinstance(t, Task) and is_environment(t) and t.name == "textarena" and t.max_new_tokens == 256
    evals = t.eval_prompts()
    assert [p.id for p in evals] == [f"textarena/GuessTheNumber-v0/eval/{k}" for k in range(3)]
    assert [int(p.metadata["game_seed"]) for p in evals] == [20261202, 20261203, 20261204]
    system, user = evals[0].messages
    assert system == {"role": "system", "content": "Play well."} and user["role"] == "user"
    assert user["content"] == evals[0].text and "guess the number between 1 and 20" in evals[0].text
    train = list(itertools.islice(t.train_prompts(seed=5), 4))
    assert train[0].id == "textarena/GuessTheNumber-v0/train/5/0"
    seeds = [int(p.metadata["game_seed"]) for p in train]
    assert all(s >= 2**31 for s in seeds) and len(set(seeds)) == 4  # never an eval game's seed
    assert next(t.train_prompts(seed=5, start=2)) == train[2]  # a resumed trainer continues exactly
    assert [p.metadata["game_seed"] for p in itertools.islice(t.train_prompts(seed=6), 4)] != \
        [p.metadata["game_seed"] for p in train]
    assert task().eval_prompts()[0].messages == [user]  # no system message unless asked for


def test_reset_gives_the_prompts_first_observation_deterministically_per_seed():
    """FrozenLake's first observation (its map) depends on the seed: the same seed gives the same one in
    every instance and in another process (another hash seed), other seeds others; reset's messages are the
    prompt's (the ticket's tokens), and the process's own random state is left as it was."""
    a, b = task("FrozenLake-v0", eval_size=4), task("FrozenLake-v0", eval_size=4)
    assert a.eval_prompts() == b.eval_prompts()
    assert len({p.text for p in a.eval_prompts()}) > 1
    random.seed(123)
    before = random.getstate()
    for p in a.eval_prompts():
        start = b.reset(p)
        assert start.messages == p.messages and start.state.first == p.text
        b.step(start.state, Action(text="[down]"))
    assert random.getstate() == before
    code = textwrap.dedent("""
        import json
        from services.tasks import get_task
        print(json.dumps([p.text for p in get_task("textarena", game="FrozenLake-v0", eval_size=4).eval_prompts()]))
    """)
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": str(REPO)}
        out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                             timeout=120, check=True).stdout
        assert json.loads(out.splitlines()[-1]) == [p.text for p in a.eval_prompts()]


def test_concurrent_games_each_keep_their_own_random_stream():
    """Minesweeper places its mines on the first move, from the game's random state: other games played
    between reset and that move (which reseed Python's global random), or the process's own draws, change
    nothing."""
    t = task("Minesweeper-v0-small")
    p, other = t.eval_prompts()[0], t.eval_prompts()[1]
    alone = t.reset(p)
    random.seed(1)
    board = t.step(alone.state, Action(text="[2 2]")).observations
    interleaved = t.reset(p)
    for _ in range(3):
        t.step(t.reset(other).state, Action(text="[0 0]"))
    random.seed(999)
    assert t.step(interleaved.state, Action(text="[2 2]")).observations == board
    assert board != t.step(t.reset(other).state, Action(text="[2 2]")).observations  # the seed matters


def test_options_are_checked_by_name():
    with pytest.raises(TextArenaError, match=r"task\.options\.game: 'GuessTheNumbr-v0' is not a TextArena game; "
                                             r"did you mean GuessTheNumber-v0"):
        task("GuessTheNumbr-v0")
    with pytest.raises(TextArenaError, match=r"task\.options\.game: name a TextArena game"):
        get_task("textarena")
    with pytest.raises(TextArenaError, match=r"task\.options\.game: 'TicTacToe-v0' .*single-player games"):
        task("TicTacToe-v0")
    with pytest.raises(TextArenaError, match=r"task\.options\.games: unknown option .*did you mean game"):
        task(games="x")
    with pytest.raises(TextArenaError, match=r"task\.options\.eval_seed"):
        task(eval_seed=2**31)


def test_the_documented_run_file_section_builds_the_task():
    page = (REPO / "docs" / "environments.md").read_text()
    block = re.search(r"## A TextArena game\n+```toml\n(.*?)```", page, re.S)
    assert block is not None and len(block.group(1).strip().splitlines()) == 4
    section = tomllib.loads(block.group(1))["task"]
    t = get_task(section["name"], **section["options"])
    assert isinstance(t, TextArenaTask) and t.game == "GuessTheNumber-v0"


def test_the_registry_does_not_import_textarena_until_asked():
    code = ("import sys, services.tasks; print('textarena' in services.tasks.available_tasks(), "
            "'textarena' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.split() == ["True", "False"]


# --- episodes through the loop --------------------------------------------------------------------------


async def test_a_won_game_is_one_episode_whose_reward_is_the_games():
    t = task()
    prompt = t.eval_prompts()[0]
    target = target_of(prompt)
    first = 1 if target != 1 else 20
    out, _ = await play(t, prompt, [f"I start low: [{first}]", f"Then it is [{target}]."])
    assert [turn.role for turn in out.turns] == ["assistant", "tool", "assistant"]
    hint = "higher" if target > first else "lower"
    assert f"The target number is {hint}." in out.turns[1].text and f"[{first}]" not in out.turns[1].text
    assert [turn.reward for turn in out.turns] == [None, None, 1.0]
    assert out.finish_reason == "eos" and out.error is None  # the engine's reason for the last turn
    assert episode_reward(t, prompt, out) == 1.0


async def test_a_lost_game_ends_at_the_games_own_turn_limit_with_its_reward():
    """GuessTheNumber-v0 allows 11 guesses; the reward of a lost game is how close the last guess was."""
    t = task()
    prompt = t.eval_prompts()[1]
    target = target_of(prompt)
    guesses = [g for g in range(1, 21) if g != target][:11]
    out, _ = await play(t, prompt, [f"[{g}]" for g in guesses])
    assistant = [turn for turn in out.turns if turn.role == "assistant"]
    observations = [turn.text for turn in out.turns if turn.role == "tool"]
    assert len(assistant) == 11 and len(observations) == 10
    for g, text in zip(guesses, observations, strict=False):
        assert f"The target number is {'higher' if target > g else 'lower'}." in text
    game_reward = 1 - abs(guesses[-1] - target) / 19
    assert [turn.reward for turn in assistant] == [None] * 10 + [pytest.approx(game_reward)]
    assert out.finish_reason == "eos" and out.error is None
    assert episode_reward(t, prompt, out) == pytest.approx(game_reward)


async def test_an_invalid_move_is_answered_once_then_ends_the_game_with_its_penalty():
    """The game's rule: the first invalid move gets the game's explanation and another try; a second in a row
    ends the game with its penalty (GuessTheNumber: how close the last valid guess was)."""
    t = task()
    prompt = t.eval_prompts()[2]
    target = target_of(prompt)
    first = 1 if target != 1 else 20
    out, _ = await play(t, prompt, [f"[{first}]", "no idea", "[99]"])
    _, _, _, warned, last = out.turns
    assert "You attempted an invalid move" in warned.text and "[no idea]" not in warned.text
    assert last.reward == pytest.approx(1 - abs(first - target) / 19) and out.finish_reason == "eos"


async def test_the_loops_turn_limit_cuts_the_game_without_a_reward():
    t = task()
    prompt = t.eval_prompts()[0]
    wrong = [g for g in range(1, 21) if g != target_of(prompt)]
    out, loop = await play(t, prompt, [f"[{g}]" for g in wrong], max_turns=3)
    assert out.finish_reason == "turn_limit" and out.error is None
    assert [turn.role for turn in out.turns] == ["assistant", "tool"] * 2 + ["assistant"]
    assert all(turn.reward is None for turn in out.turns) and loop.counters["turn_limit"] == 1
    assert episode_reward(t, prompt, out) == 0.0


async def test_a_game_whose_step_raises_ends_only_its_own_episode():
    """A game registered in TextArena's own registry whose step raises, beside a game that is won."""
    import textarena as ta
    from textarena.envs.registration import ENV_REGISTRY

    class Exploding(ta.Env):
        def reset(self, num_players, seed=None):
            self.state = ta.SinglePlayerState(num_players=num_players, seed=seed, max_turns=5)
            self.state.reset(game_state={}, player_prompt_function=lambda player_id, game_state: "Say [go].")

        def step(self, action):
            raise KeyError("the game broke")

    if "RlbusExploding-v0" not in ENV_REGISTRY:
        ta.register(id="RlbusExploding-v0", entry_point=Exploding)
    broken, fine = task("RlbusExploding-v0"), task()
    bp, fp = broken.eval_prompts()[0], fine.eval_prompts()[0]
    assert bp.text == "Say [go]."
    loop = EpisodeLoop(ReplayEngine.of_texts(TOK, ["[1]", f"[{target_of(fp)}]"]), TOK, AgentSection())
    bad, good = await asyncio.gather(loop.run(broken, bp, broken.format_prompt(TOK, bp), PARAMS),
                                     loop.run(fine, fp, fine.format_prompt(TOK, fp), PARAMS))
    assert bad.finish_reason == "error" and "environment: step" in bad.error and "the game broke" in bad.error
    assert [turn.role for turn in bad.turns] == ["assistant"]
    assert good.error is None and good.turns[-1].reward == 1.0  # [1] or the number: won either way
    assert loop.counters["env_errors"] == 1 and loop.counters["errors"] == 1


async def test_a_prompt_of_another_game_or_seedless_ends_the_episode_with_the_reason():
    t, other = task(), task("TowerOfHanoi-v0")
    out, _ = await play(t, other.eval_prompts()[0], ["[1]"])
    assert out.finish_reason == "error" and "TowerOfHanoi-v0" in out.error and "reset" in out.error
