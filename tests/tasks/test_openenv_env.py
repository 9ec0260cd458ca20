"""The openenv task (services/tasks/openenv_env.py) over the real openenv-core, with real server processes.

The environment is ``examples/openenv_guess.py``, written with openenv-core's own server API, served by the
task in a subprocess on 127.0.0.1 (nothing else is reached). Episodes run through the real episode loop with
``env_harness.ReplayEngine``, an engine stand-in replaying fixed texts: the tiny test model does not play the
game, and a win, a wrong guess and a server killed between two turns each need a known line of play. The
game's number is known from the seed (``random.Random(seed).randint(1, 20)``). Every test checks that no
server process it started survives it.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rollout"))  # env_harness, as tests/rollout use it
sys.path.insert(0, str(Path(__file__).resolve().parent))  # openenv_test_servers (the servers inherit sys.path)
from env_harness import ReplayEngine, tools_tokenizer  # noqa: E402

from proto.rollouts import Rollout  # noqa: E402
from services.judge.service import with_turn_rewards  # noqa: E402
from services.lib.engine.base import SamplingParams  # noqa: E402
from services.rollout.config import AgentSection  # noqa: E402
from services.rollout.episode import EpisodeLoop  # noqa: E402
from services.runtime import lifeline  # noqa: E402
from services.tasks import get_task  # noqa: E402
from services.tasks.base import Prompt, Task  # noqa: E402
from services.tasks.env import Action, is_environment  # noqa: E402
from services.tasks.graders import Grading  # noqa: E402
from services.tasks.openenv_env import OpenEnvError, OpenEnvTask  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TOK = tools_tokenizer()
PARAMS = SamplingParams(max_new_tokens=64)
GUESS = "examples.openenv_guess:GuessTheNumber"


def target_of(prompt) -> int:
    return random.Random(int(prompt.metadata["seed"])).randint(1, 20)


def wrong_for(prompt) -> int:
    return 1 if target_of(prompt) != 1 else 20


def server_pids() -> set[int]:
    """This test process's live server processes (its descendants running the openenv server module)."""
    found = set()
    for pid in lifeline.descendants():
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"services.tasks.openenv_server" in cmd:
            found.add(pid)
    return found


@pytest.fixture(scope="module")
def task():
    """One task (one server) for the module's episode tests; stopped at the end, nothing left running."""
    t = get_task("openenv", server=GUESS, eval_size=4)
    yield t
    t.close()
    assert server_pids() == set()


@pytest.fixture(autouse=True)
def no_stray_servers(request):
    """A test's own tasks stop their servers; the module's task runs one until the module ends."""
    before = server_pids()
    yield
    left = server_pids() - before
    if "task" in request.fixturenames and request.getfixturevalue("task").process.proc is not None:
        left.discard(request.getfixturevalue("task").process.proc.pid)
    assert left == set()


async def play(t: OpenEnvTask, prompt, texts: list[str], engine: ReplayEngine | None = None):
    loop = EpisodeLoop(engine or ReplayEngine.of_texts(TOK, texts), TOK, AgentSection(max_turns=8))
    return await loop.run(t, prompt, t.format_prompt(TOK, prompt), PARAMS), loop


def episode_reward(t: OpenEnvTask, prompt, out) -> float:
    rollout = Rollout(run_id="oe", task="openenv", group_id="g", prompt_id=prompt.id, sample_index=0,
                      group_size=1, prompt_ids=[], turns=out.turns, finish_reason=out.finish_reason,
                      policy_version=0)
    return with_turn_rewards(Grading(t.reward(prompt, "").value, []), rollout).reward


# --- the task by name ------------------------------------------------------------------------------------


def test_the_task_by_name_is_an_environment_with_a_prompt_per_seed(task):
    assert isinstance(task, OpenEnvTask) and isinstance(task, Task) and is_environment(task)
    evals = task.eval_prompts()
    assert [p.id for p in evals] == [f"openenv/eval/{k}" for k in range(4)]
    assert [int(p.metadata["seed"]) for p in evals] == list(range(20261202, 20261206))
    assert evals[0].messages == [{"role": "user", "content": evals[0].text}]
    assert evals[0].text.startswith("I am thinking of a number from 1 to 20.")
    train = [p for p, _ in zip(task.train_prompts(seed=5), range(3), strict=False)]
    assert all(int(p.metadata["seed"]) >= 2**31 for p in train) and len({p.metadata["seed"] for p in train}) == 3
    assert next(task.train_prompts(seed=5, start=2)) == train[2]
    assert len(server_pids()) == 1 and task.process.starts == 1  # started once, lazily, for the prompts


def test_the_registry_does_not_import_openenv_until_asked():
    code = "import sys, services.tasks; print('openenv' in services.tasks.available_tasks(), 'openenv' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.split() == ["True", "False"]


def test_the_documented_run_file_section_builds_the_task():
    page = (REPO / "docs" / "environments.md").read_text()
    block = re.search(r"## An OpenEnv server\n+```toml\n(.*?)```", page, re.S)
    assert block is not None
    section = tomllib.loads(block.group(1))["task"]
    t = get_task(section["name"], **section["options"])
    assert isinstance(t, OpenEnvTask) and t.server == GUESS and t.process.proc is None  # nothing started yet


def test_options_are_checked_by_name():
    with pytest.raises(OpenEnvError, match=r"task\.options\.server: 'examples\.no_such_env:Env' cannot be served: "
                                           r"ModuleNotFoundError: No module named 'examples\.no_such_env'"):
        get_task("openenv", server="examples.no_such_env:Env")
    with pytest.raises(OpenEnvError, match=r"task\.options\.server: .*has no 'Nope'"):
        get_task("openenv", server="examples.openenv_guess:Nope")
    with pytest.raises(OpenEnvError, match=r"task\.options\.server: .*not an OpenEnv Environment subclass"):
        get_task("openenv", server="examples.openenv_guess:GUESSES")
    with pytest.raises(OpenEnvError, match=r"task\.options\.server: name the environment"):
        get_task("openenv")
    with pytest.raises(OpenEnvError, match=r"task\.options\.action: GuessAction has no field 'text'"):
        get_task("openenv", server=GUESS, action="text")
    with pytest.raises(OpenEnvError, match=r"task\.options\.servers: unknown option"):
        get_task("openenv", servers=GUESS)


# --- episodes through the loop ---------------------------------------------------------------------------


async def test_a_won_game_is_one_episode_with_the_servers_turn_rewards(task):
    prompt = task.eval_prompts()[0]
    wrong, target = wrong_for(prompt), target_of(prompt)
    out, _ = await play(task, prompt, [f"Maybe {wrong}?", f"It is {target}."])
    assert [turn.role for turn in out.turns] == ["assistant", "tool", "assistant"]
    assert ("Higher." if target > wrong else "Lower.") in out.turns[1].text and "5 guesses left" in out.turns[1].text
    assert [turn.reward for turn in out.turns] == [0.0, None, 1.0]
    assert out.finish_reason == "eos" and out.error is None
    assert episode_reward(task, prompt, out) == 1.0


async def test_the_servers_done_ends_a_lost_game_and_the_loops_turn_limit_cuts_one():
    t = get_task("openenv", server=GUESS, eval_size=1)
    try:
        prompt = t.eval_prompts()[0]
        wrong = f"{wrong_for(prompt)}"
        lost, _ = await play(t, prompt, [wrong] * 10)
        assert lost.finish_reason == "eos" and lost.error is None
        assert [turn.reward for turn in lost.turns if turn.role == "assistant"] == [0.0] * 6  # six guesses
        assert "No guesses left" not in "".join(turn.text for turn in lost.turns)  # the last observation: unread
        loop = EpisodeLoop(ReplayEngine.of_texts(TOK, [wrong]), TOK, AgentSection(max_turns=2))
        cut = await loop.run(t, prompt, t.format_prompt(TOK, prompt), PARAMS)
        assert cut.finish_reason == "turn_limit" and [turn.role for turn in cut.turns] == ["assistant", "tool",
                                                                                         "assistant"]
    finally:
        t.close()


async def test_two_concurrent_episodes_on_one_server_keep_their_own_state(task):
    a, b = task.eval_prompts()[1], task.eval_prompts()[2]
    assert target_of(a) != target_of(b)
    # session by session: b's number guessed in a's session is wrong there, right in b's
    sa, sb = await task.reset(a), await task.reset(b)
    assert sa.state.pid == sb.state.pid and sa.state.client is not sb.state.client
    miss = await task.step(sa.state, Action(text=str(target_of(b))))
    hit = await task.step(sb.state, Action(text=str(target_of(b))))
    assert not miss.done and miss.reward == 0.0 and hit.done and hit.reward == 1.0
    assert (await task.step(sa.state, Action(text=str(target_of(a)), index=1))).done
    # and two episodes at once through two loops sharing the task (one server)
    (oa, _), (ob, _) = await asyncio.gather(
        play(task, a, [str(wrong_for(a)), str(target_of(a))]), play(task, b, [str(target_of(b))]))
    assert [t.reward for t in oa.turns] == [0.0, None, 1.0] and [t.reward for t in ob.turns] == [1.0]
    assert task.process.starts == 1


async def test_a_server_killed_mid_episode_ends_that_episode_and_the_next_gets_a_fresh_server():
    t = get_task("openenv", server=GUESS, eval_size=1)
    try:
        prompt = t.eval_prompts()[0]
        first = t.process.proc.pid

        class KillingEngine(ReplayEngine):
            """Replays, and SIGKILLs the server before the second assistant turn comes back."""

            async def generate(self, prompt_ids, params):
                if self.requests == 1:
                    os.kill(first, signal.SIGKILL)
                return await super().generate(prompt_ids, params)

        engine = KillingEngine.of_texts(TOK, [str(wrong_for(prompt)), str(target_of(prompt))])
        out, loop = await play(t, prompt, [], engine=engine)
        assert out.finish_reason == "error" and loop.counters["env_errors"] == 1
        assert f"the OpenEnv server {GUESS} (pid {first}) died during step 1: killed by signal 9" in out.error
        assert [turn.reward for turn in out.turns] == [0.0, None, None]
        assert lifeline.start_time(first) is None
        again, _ = await play(t, prompt, [str(target_of(prompt))])
        assert again.error is None and again.turns[-1].reward == 1.0
        assert t.process.starts == 2 and t.process.proc.pid in server_pids() and first not in server_pids()
    finally:
        t.close()


@pytest.mark.parametrize("how, start_timeout_s, reason", [
    ("slow", 1, r"did not start: it did not answer /health within start_timeout_s = 1 s"),
    ("crash", 30, r"did not start: it exited \(exit code 1\); its stderr ends: .*this server cannot start"),
])
async def test_a_server_that_does_not_come_up_fails_the_episode_with_the_reason(monkeypatch, how, start_timeout_s,
                                                                                reason):
    t = get_task("openenv", server="openenv_test_servers:GuessTheNumber", eval_size=1,
                 start_timeout_s=start_timeout_s)
    try:
        monkeypatch.setenv("RLBUS_TEST_OPENENV_SERVER", how)  # after the in-process import: only the server fails
        prompt = Prompt(id="openenv/eval/0", text="x", messages=[{"role": "user", "content": "x"}],
                        metadata={"seed": "1"})
        out, _ = await asyncio.wait_for(play(t, prompt, ["1"]), timeout=30)
        assert out.finish_reason == "error" and out.turns == []
        assert re.search(r"environment: reset: .*the OpenEnv server openenv_test_servers:GuessTheNumber " + reason,
                         out.error, re.S), out.error
    finally:
        t.close()
