"""Agents as commands in the episode's own sandbox: a real bubblewrap sandbox behind the real sandbox service
on nats-server, the real endpoint over the scripted stand-in engine, the agent a Python script run with the
system ``python3`` (its stdlib HTTP client through the sandbox's egress proxy, as any harness would go).
The sandbox reaches the endpoint and nothing else; the trajectory comes from the session; the judge's hidden
tests run in a fork of the sandbox the agent left; a non-zero exit, a flood past the budget and a hang each
end only their own episode, with the reason."""

from __future__ import annotations

import asyncio
import json

from agentic_harness import Bus, ScriptedEngine, chat_tokenizer

from proto.rollouts import Rollout, Turn
from services.lib.sandbox_client import SandboxClient
from services.rollout.black_box import BlackBoxLoop
from services.rollout.command_agent import CommandAgents
from services.rollout.config import AgentSection, EndpointSection
from services.rollout.endpoint import Endpoint
from services.runtime.natsd import free_port
from services.tasks.base import Prompt, Reward
from services.tasks.black_box import CommandAgentTask, is_command_agent
from services.tasks.grader_specs import SandboxTestsSpec
from services.tasks.graders import HiddenTests, SandboxTestsGrader

TOK = chat_tokenizer()

#: the agent: stdlib only; ``.mode`` says how it behaves, ``.probe`` where else it tries to go
AGENT = r'''
import json, os, sys, time, urllib.error, urllib.request
base, key = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]
def chat(messages):
    body = json.dumps({"model": os.environ["RLBUS_MODEL"], "messages": messages, "max_tokens": 40}).encode()
    req = urllib.request.Request(base + "/chat/completions", data=body,
                                 headers={"Authorization": "Bearer " + key, "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["choices"][0]["message"]["content"]
def reach(url, proxy=True):
    opener = urllib.request.build_opener(*([] if proxy else [urllib.request.ProxyHandler({})]))
    try:
        with opener.open(url, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError as e:
        return type(e).__name__
mode = open(".mode").read().strip()
messages = [{"role": "user", "content": open(os.environ["RLBUS_PROMPT_FILE"]).read()}]
answer = chat(messages)
if mode == "ok":
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Sure?"}]
    answer = chat(messages)
    open("answer.txt", "w").write(answer)
    probe = json.load(open(".probe"))
    print(json.dumps({"other_port": reach(probe["other"]), "loopback": reach(probe["loopback"]),
                      "direct": reach(base + "/models", proxy=False)}))
elif mode == "exit":
    sys.stderr.write("boom: the harness broke\n")
    sys.exit(3)
elif mode == "flood":
    while True:
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Again."}]
        answer = chat(messages)  # past the budget: HTTPError 400, and the script exits 1
elif mode == "hang":
    time.sleep(600)
'''


class Scripted(CommandAgentTask):
    name = "scripted-command"
    agent_command = "python3 agent.py"

    def __init__(self, probe: dict[str, str]) -> None:
        self.probe = probe

    def train_prompts(self, seed: int, start: int = 0):
        yield from ()

    def eval_prompts(self) -> list[Prompt]:
        return []

    def sandbox_files(self, prompt: Prompt) -> dict[str, bytes]:
        return {"agent.py": AGENT.encode(), ".mode": prompt.metadata["mode"].encode(),
                ".probe": json.dumps(self.probe).encode()}

    def hidden_tests(self, prompt: Prompt) -> HiddenTests:
        return HiddenTests(command=["sh", "-c", 'test "$(cat answer.txt)" = "Sure: four."'])

    def reward(self, prompt: Prompt, completion: str) -> Reward:
        return Reward(0.0, "")


def prompt(mode: str) -> Prompt:
    return Prompt(id=f"cmd/{mode}", text="What is 2 + 2?", metadata={"mode": mode})


async def test_a_command_agent_reaches_the_endpoint_only_and_its_sandbox_is_graded_in_a_fork(nats_url):
    hits: list[str] = []

    async def other(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hits.append("connected")  # nothing in a sandbox may get here
        writer.close()

    other_server = await asyncio.start_server(other, "0.0.0.0", free_port())
    cfg = AgentSection(max_turns=3, wall_time_s=30.0)
    endpoint = Endpoint(ScriptedEngine(TOK, ["Four.", "Sure: four."]), TOK,
                        EndpointSection(enabled=True, host="0.0.0.0"), "scripted")
    await endpoint.start()
    try:
        async with Bus(nats_url) as bus:
            other_port = other_server.sockets[0].getsockname()[1]
            task = Scripted({"other": f"http://{endpoint.agent_host}:{other_port}/",
                             "loopback": f"http://127.0.0.1:{endpoint.port}/v1/models"})
            assert is_command_agent(task) and endpoint.agent_host not in ("0.0.0.0", "127.0.0.1")
            loop = BlackBoxLoop(endpoint, cfg, CommandAgents(bus.sandboxes, cfg))
            hang_cfg = AgentSection(max_turns=3, wall_time_s=15.0)  # its one call takes ~1 s
            hang_loop = BlackBoxLoop(endpoint, hang_cfg, CommandAgents(bus.sandboxes, hang_cfg))
            ok, exited, flooded, hung = await asyncio.gather(
                loop.run(task, prompt("ok"), {"sample": "0"}), loop.run(task, prompt("exit"), {"sample": "1"}),
                loop.run(task, prompt("flood"), {"sample": "2"}), hang_loop.run(task, prompt("hang"), {"sample": "3"}))

            # the agent's two calls are one sequence; its stdout says where it could not go
            assert ok.error is None and ok.finish_reason == "eos", ok.error
            assert [t.role for t in ok.turns] == ["assistant", "tool", "assistant"]
            assert ok.turns[0].text == "Four." and ok.turns[2].text == "Sure: four."
            assert ok.metadata["agent_calls"] == "2" and int(ok.metadata["agent_tokens"]) == sum(
                len(t.token_ids) for t in ok.turns[::2]) and float(ok.metadata["agent_wall_s"]) > 0
            probes = json.loads(ok.metadata["agent_answer"])
            assert probes["other_port"] == 403 and probes["loopback"] == 403  # the proxy refused both
            assert probes["direct"] in ("URLError", "OSError")  # no route out of the sandbox but the proxy
            assert hits == []
            # handed to the judge, paused; the hidden tests run in a fork and pass on what the agent wrote
            assert ok.handed_off and await bus.state(ok.sandbox_id) == "paused"
            rollout = Rollout(run_id="agentic", task=task.name, group_id="g", prompt_id="cmd/ok", sample_index=0,
                              group_size=1, prompt_ids=ok.prompt_ids or [], turns=ok.turns or [Turn(
                                  role="assistant", token_ids=[1], logprobs=[0.0], versions=[0])],
                              finish_reason=ok.finish_reason, policy_version=0, sandbox_id=ok.sandbox_id,
                              metadata={"mode": "ok"})
            rollout.msg_id = "r-ok"
            score = await SandboxTestsGrader(SandboxTestsSpec(), bus.sandboxes).grade(rollout, task)
            assert score.score == 1.0 and score.error is None, score.explanation
            await bus.sandboxes.destroy(ok.sandbox_id)

            # a non-zero exit while the budget held: an error with the exit code and stderr; sandbox destroyed
            assert exited.finish_reason == "error" and "exited with 3" in exited.error
            assert "boom: the harness broke" in exited.error and exited.sandbox_id is None
            # calls past the budget were refused: the agent's exit is the budget's, and the episode is scored
            assert flooded.error is None and flooded.finish_reason == "turn_limit"
            assert flooded.metadata["agent_calls"] == "3" and flooded.handed_off
            await bus.sandboxes.destroy(flooded.sandbox_id)
            # a command that never exits is cut at the wall time; its one call is its trajectory
            assert hung.error is None and hung.finish_reason == "wall_time" and hung.handed_off
            assert [t.role for t in hung.turns] == ["assistant"]
            await bus.sandboxes.destroy(hung.sandbox_id)
            assert loop.counters["errors"] == 1 and hang_loop.counters["wall_time"] == 1

            # the exec's reply lost after its limit (a client with no margin: the sandbox service replies only
            # after it has cut the command): still the wall time, scored on the session's calls
            hurried = SandboxClient(bus.nc, "agentic", timeout_s=30.0, exec_margin_s=0.0)
            out = await BlackBoxLoop(endpoint, hang_cfg, CommandAgents(hurried, hang_cfg)).run(task, prompt("hang"))
            assert out.error is None and out.finish_reason == "wall_time" and out.handed_off, out.error
            await bus.sandboxes.destroy(out.sandbox_id)

            # an endpoint only on loopback: the sandbox service refuses the entry, and the error says what to set
            local = Endpoint(ScriptedEngine(TOK, ["Four."]), TOK, EndpointSection(enabled=True), "scripted")
            await local.start()
            try:
                out = await BlackBoxLoop(local, cfg, CommandAgents(bus.sandboxes, cfg)).run(task, prompt("ok"))
            finally:
                await local.stop()
            assert out.finish_reason == "error" and f"127.0.0.1:{local.port}" in out.error
            assert 'host = "0.0.0.0"' in out.error and out.sandbox_id is None
    finally:
        await endpoint.stop()
        other_server.close()
