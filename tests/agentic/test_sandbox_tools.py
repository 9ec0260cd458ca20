"""Native tool calls that work in the episode's own sandbox: typed tools given the sandbox handle, command tools.

Real bubblewrap sandboxes behind the real sandbox service on nats-server, the real episode loop and tool
runner, a real chat template with tools (ChatML + a <tools> block); the policy is the scripted stand-in engine
(``agentic_harness.ScriptedEngine``) because the tiny model does not write tool calls.
"""

from __future__ import annotations

import json

import pytest
from agentic_harness import CHATML_TOOLS, Bus, ScriptedEngine, chat_tokenizer

from services.lib.engine.base import SamplingParams
from services.rollout.agent import AgentLoop
from services.rollout.config import AgentSection
from services.rollout.tool_runner import ToolRunner
from services.tasks.base import Prompt, Reward
from services.tasks.env import Action, FunctionEnvironment, Step
from services.tasks.function_tools import ToolDefinitionError, function_schema, tools_by_name
from services.tasks.sandbox_tools import Sandbox, sandbox_command, uses_sandbox
from services.tasks.toolcalls import get_parser

TOK = chat_tokenizer(CHATML_TOOLS, [*["<pad>", "<|im_start|>", "<|im_end|>"]])
HOSTILE = "$(touch pwned) `touch pwned2`; touch pwned3 'quoted'"


async def save(sandbox: Sandbox, path: str, text: str) -> str:
    """Save a file in the work directory.

    Args:
        path: where, relative to the work directory.
        text: the file's content.
    """
    written = await sandbox.write(path, text)
    return f"saved {written} bytes"


async def show(sandbox: Sandbox, path: str) -> str:
    """Show a file.

    Args:
        path: which file.
    """
    return (await sandbox.read(path)).decode()


count_lines = sandbox_command("count_lines", 'wc -l < "$path"', "Count the lines of a file.",
                              path=(str, "the file"))
echo = sandbox_command("echo", 'printf "%s|%s" "$text" "$times"; ls', "Echo a text.", text=str, times=int)


def call(name: str, **arguments: object) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


class NotesEnv(FunctionEnvironment):
    """Tools in the sandbox; the sandbox starts with notes.txt; the step checks the sandbox itself."""

    name = "notes"
    tools = (save, show, count_lines, echo)
    max_new_tokens = 200
    stop: list[str] = []

    def __init__(self) -> None:
        self.seen_in_step: list[str] = []

    def sandbox_files(self, prompt: Prompt) -> dict[str, bytes]:
        return {"notes.txt": b"one\ntwo\nthree\n"}

    async def step(self, state, action: Action) -> Step:
        if action.calls == 0:
            listing = await action.sandbox.exec(["ls"])
            self.seen_in_step.append(listing.stdout)
            return Step(done=True, reward=0.5)
        return Step()

    def train_prompts(self, seed: int, start: int = 0):
        yield from ()

    def eval_prompts(self) -> list[Prompt]:
        return []

    def reward(self, prompt: Prompt, completion: str) -> Reward:
        return Reward(1.0, "")


PROMPT = Prompt(id="notes/0", text="Count the notes.", messages=[{"role": "user", "content": "Count the notes."}])


def test_the_sandbox_parameter_is_not_shown_to_the_model_and_must_be_async():
    schema = function_schema(save)["function"]["parameters"]
    assert list(schema["properties"]) == ["path", "text"] and schema["required"] == ["path", "text"]
    command = function_schema(echo)["function"]
    assert command["name"] == "echo" and command["description"] == "Echo a text."
    assert command["parameters"]["properties"] == {"text": {"type": "string"}, "times": {"type": "integer"}}
    assert function_schema(count_lines)["function"]["parameters"]["properties"]["path"]["description"] == "the file"
    specs = tools_by_name(NotesEnv.tools)
    assert {n: s.sandbox_arg for n, s in specs.items()} == {"save": "sandbox", "show": "sandbox",
                                                            "count_lines": "sandbox", "echo": "sandbox"}

    def sync_tool(sandbox: Sandbox, path: str) -> str:
        """Sync."""
        return path

    with pytest.raises(ToolDefinitionError, match="not async def"):
        tools_by_name([sync_tool])
    with pytest.raises(TypeError, match="identifier"):
        sandbox_command("bad", "true", "Bad.", **{"not-a-name": str})
    assert uses_sandbox(NotesEnv()) and not uses_sandbox(FunctionEnvironment())


async def test_a_sandbox_tool_without_a_sandbox_is_an_error_observation():
    runner = ToolRunner(timeout_s=5.0, max_chars=1000)
    parsed = get_parser("hermes").parse(call("show", path="x"), ["show"])
    [result] = await runner.run_calls(tools_by_name([show]), parsed, sandbox=None)
    assert result.error == "bad_call" and "has none" in result.content


async def test_sandbox_tools_run_in_the_episode_sandbox_paused_between_turns(bus: Bus):
    states: list[list[str]] = []

    async def hook(turn: int, context: str) -> None:  # the sandbox's state while the model generates
        states.append([s.state for s in await bus.sandboxes.sandboxes(expected=1)])

    script = [
        "Saving." + call("save", path="more.txt", text="a\nb\n") + call("count_lines", path="notes.txt"),
        "Again." + call("show", path="more.txt") + call("echo", text=HOSTILE, times=3),
        "Missing." + call("show", path="nothing.txt"),
        "There are 3 notes.",
    ]
    env = NotesEnv()
    loop = AgentLoop(ScriptedEngine(TOK, script, hook=hook), TOK, bus.sandboxes,
                     AgentSection(max_turns=6, wall_time_s=60.0, max_total_tokens=20000))
    out = await loop.run(env, PROMPT, env.format_prompt(TOK, PROMPT), SamplingParams(max_new_tokens=300))
    assert out.error is None and out.finish_reason == "eos", out.error
    assert [t.role for t in out.turns] == ["assistant", "tool"] * 3 + ["assistant"]
    first, second, third = out.turns[1].text, out.turns[3].text, out.turns[5].text
    assert "saved 4 bytes" in first and "exit code 0\nstdout:\n3" in first
    assert "a\nb\n" in second
    # the argument arrived as data: printed as is, nothing it names was run (ls shows no pwned files)
    assert f"{HOSTILE}|3" in second and "pwned" not in second.split(f"{HOSTILE}|3", 1)[1]
    assert "FileNotFoundError" in third and "nothing.txt" in third
    assert out.tool_calls == 5
    assert out.turns[-1].reward == 0.5 and "more.txt" in env.seen_in_step[0] and "notes.txt" in env.seen_in_step[0]
    assert states and all(s == ["paused"] for s in states)  # paused while the model generated
    assert out.handed_off and await bus.state(out.sandbox_id) == "paused"  # to the judge, paused
    await bus.sandboxes.destroy(out.sandbox_id)


async def test_a_failing_environment_ends_its_episode_and_its_sandbox_is_destroyed(bus: Bus):
    class Broken(NotesEnv):
        def sandbox_files(self, prompt: Prompt) -> dict[str, bytes]:
            raise RuntimeError("no files today")

    env = Broken()
    loop = AgentLoop(ScriptedEngine(TOK, ["Hi."]), TOK, bus.sandboxes, AgentSection(wall_time_s=30.0))
    out = await loop.run(env, PROMPT, env.format_prompt(TOK, PROMPT), SamplingParams(max_new_tokens=50))
    assert out.finish_reason == "error" and "no files today" in out.error and out.sandbox_id is None

    class BadStep(NotesEnv):
        async def step(self, state, action: Action) -> Step:
            raise ValueError("step broke")

    env = BadStep()
    out = await loop.run(env, PROMPT, env.format_prompt(TOK, PROMPT), SamplingParams(max_new_tokens=50))
    assert out.finish_reason == "error" and "step broke" in out.error and not out.handed_off
    assert await bus.state(out.sandbox_id) is None  # destroyed by the loop
