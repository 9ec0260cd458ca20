"""A Python black-box agent whose ``solve`` takes the episode's sandbox: a real bubblewrap sandbox behind the real
sandbox service on nats-server, the real endpoint over the scripted stand-in engine. The agent's code runs here;
what it writes and execs goes to its sandbox, whose egress reaches the endpoint; the judge's hidden tests grade
that sandbox in a fork. An agent that raises, or an episode cancelled, leaves no sandbox behind; the plain
two-argument ``solve`` still runs without one."""

from __future__ import annotations

import asyncio
from typing import Any

from agentic_harness import Bus, ScriptedEngine, chat_tokenizer

from proto.rollouts import Rollout
from services.rollout.black_box import BlackBoxLoop
from services.rollout.command_agent import CommandAgents
from services.rollout.config import AgentSection, EndpointSection
from services.rollout.endpoint import Endpoint
from services.tasks.base import Prompt, Reward
from services.tasks.black_box import (
    PROMPT_FILE,
    AgentEndpoint,
    BlackBoxAgentTask,
    needs_sandbox,
    solve_takes_sandbox,
)
from services.tasks.grader_specs import SandboxTestsSpec
from services.tasks.graders import HiddenTests, SandboxTestsGrader

TOK = chat_tokenizer()

#: run in the sandbox: the endpoint's model list through the sandbox's egress proxy (its HTTP status)
PROBE = "import os, urllib.request; print(urllib.request.urlopen(os.environ['BASE'] + '/models', timeout=10).status)"


class Boxed(BlackBoxAgentTask):
    name = "python-sandboxed"

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}  # what each episode's agent saw, by mode
        self.parked = asyncio.Event()  # the "park" agent is inside its sandbox and waits forever

    def train_prompts(self, seed: int, start: int = 0):
        yield from ()

    def eval_prompts(self) -> list[Prompt]:
        return []

    def sandbox_files(self, prompt: Prompt) -> dict[str, bytes]:
        return {"probe.py": PROBE.encode()}

    async def solve(self, endpoint: AgentEndpoint, prompt: Prompt, sandbox: Any) -> str:
        mode = prompt.metadata["mode"]
        seen = self.seen[mode] = {"sandbox_id": sandbox.sandbox_id}
        seen["prompt_file"] = (await sandbox.read(PROMPT_FILE)).decode()
        r = await endpoint.openai().chat.completions.create(
            model=endpoint.model, messages=[{"role": "user", "content": prompt.text}], max_tokens=40)
        answer = r.choices[0].message.content
        await sandbox.write("answer.txt", answer)
        if mode == "raise":
            raise RuntimeError("the agent broke")
        if mode == "park":
            self.parked.set()
            await asyncio.Event().wait()
        probe = await sandbox.exec("python3 probe.py", env={"BASE": endpoint.base_url})
        seen["probe"] = (probe.exit_code, probe.stdout.strip(), probe.stderr)
        return answer

    def hidden_tests(self, prompt: Prompt) -> HiddenTests:
        return HiddenTests(command=["sh", "-c", 'test "$(cat answer.txt)" = "Four."'])

    def reward(self, prompt: Prompt, completion: str) -> Reward:
        return Reward(0.0, "")


class Plain(BlackBoxAgentTask):
    name = "python-plain"

    async def solve(self, endpoint: AgentEndpoint, prompt: Prompt) -> str:
        r = await endpoint.openai().chat.completions.create(
            model=endpoint.model, messages=[{"role": "user", "content": prompt.text}], max_tokens=40)
        return r.choices[0].message.content


def prompt(mode: str) -> Prompt:
    return Prompt(id=f"py/{mode}", text="What is 2 + 2?", metadata={"mode": mode})


async def test_a_python_agent_works_in_its_sandbox_which_the_judge_grades_and_a_failed_one_is_destroyed(nats_url):
    cfg = AgentSection(max_turns=3, wall_time_s=60.0)
    endpoint = Endpoint(ScriptedEngine(TOK, ["Four."]), TOK, EndpointSection(enabled=True, host="0.0.0.0"),
                        "scripted")
    await endpoint.start()
    try:
        async with Bus(nats_url) as bus:
            task = Boxed()
            assert solve_takes_sandbox(task) and needs_sandbox(task)
            assert not solve_takes_sandbox(Plain()) and not needs_sandbox(Plain())
            loop = BlackBoxLoop(endpoint, cfg, CommandAgents(bus.sandboxes, cfg))
            ok, raised, plain = await asyncio.gather(
                loop.run(task, prompt("ok"), {"sample": "0"}), loop.run(task, prompt("raise"), {"sample": "1"}),
                loop.run(Plain(), prompt("plain")))

            # the model call is the trajectory; the sandbox had the prompt file, and its exec reached the endpoint
            assert ok.error is None and ok.finish_reason == "eos", ok.error
            assert [t.role for t in ok.turns] == ["assistant"] and ok.turns[0].text == "Four."
            assert ok.metadata["agent_answer"] == "Four." and ok.metadata["agent_calls"] == "1"
            assert task.seen["ok"]["prompt_file"] == "What is 2 + 2?"
            assert task.seen["ok"]["probe"][:2] == (0, "200"), task.seen["ok"]["probe"]
            # handed to the judge, paused; the hidden tests run in a fork and pass on what the agent wrote
            assert ok.sandbox_id == task.seen["ok"]["sandbox_id"] and ok.handed_off
            assert await bus.state(ok.sandbox_id) == "paused"
            rollout = Rollout(run_id="agentic", task=task.name, group_id="g", prompt_id="py/ok", sample_index=0,
                              group_size=1, prompt_ids=ok.prompt_ids or [], turns=ok.turns,
                              finish_reason=ok.finish_reason, policy_version=0, sandbox_id=ok.sandbox_id,
                              metadata={"mode": "ok"})
            rollout.msg_id = "r-ok"
            score = await SandboxTestsGrader(SandboxTestsSpec(), bus.sandboxes).grade(rollout, task)
            assert score.score == 1.0 and score.error is None, score.explanation
            await bus.sandboxes.destroy(ok.sandbox_id)

            # the agent raised after writing into its sandbox: an error, and the sandbox destroyed
            assert raised.finish_reason == "error" and "RuntimeError: the agent broke" in raised.error
            assert raised.sandbox_id is None and not raised.handed_off
            gone = task.seen["raise"]["sandbox_id"]
            assert [e.kind for e in await bus.events(gone)][-1] == "destroyed"
            assert await bus.state(gone) is None

            # the plain two-argument solve: no sandbox
            assert plain.error is None and plain.sandbox_id is None and plain.turns[0].text == "Four."

            # an episode cancelled while its agent works: the sandbox is destroyed, not handed over
            run = asyncio.create_task(loop.run(task, prompt("park")))
            await task.parked.wait()
            run.cancel()
            assert (await asyncio.gather(run, return_exceptions=True))[0].__class__ is asyncio.CancelledError
            parked = task.seen["park"]["sandbox_id"]
            assert [e.kind for e in await bus.events(parked)][-1] == "destroyed"
            assert await bus.state(parked) is None
    finally:
        await endpoint.stop()
