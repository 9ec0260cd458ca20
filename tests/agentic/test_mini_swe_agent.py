"""mini-swe-agent, unchanged, as a command agent: the shipped driver (examples/swe_fix/run_mini_swe_agent.py)
builds its stock DefaultAgent + LocalEnvironment + LitellmModel (litellm's OpenAI provider) from its default
config, in a real bubblewrap sandbox whose ``python3`` imports the packages installed beside rlbus
(``python_packages``), against the real endpoint through the sandbox's egress proxy. The policy is the scripted
stand-in engine writing hermes tool calls (the tiny model writes none): it fixes the planted bug, then submits.
The session records both calls as one sequence and the judge's hidden tests pass in a fork."""

from __future__ import annotations

import json

from agentic_harness import CHATML_TOOLS, Bus, ScriptedEngine, chat_tokenizer

from proto.rollouts import Rollout
from services.rollout.black_box import BlackBoxLoop
from services.rollout.command_agent import CommandAgents
from services.rollout.config import AgentSection, EndpointSection
from services.rollout.endpoint import Endpoint
from services.tasks import get_task
from services.tasks.grader_specs import SandboxTestsSpec
from services.tasks.graders import SandboxTestsGrader

TOK = chat_tokenizer(CHATML_TOOLS)


def bash(command: str) -> str:
    return f"<tool_call>{json.dumps({'name': 'bash', 'arguments': {'command': command}})}</tool_call>"


async def test_stock_mini_swe_agent_fixes_the_bug_in_its_sandbox_and_the_hidden_tests_pass(nats_url):
    task = get_task("swe_fix", max_tokens=200)
    prompt = next(p for p in task.train_prompts(seed=0) if p.metadata["bug"] == "total_skips_last_line")
    script = ["I will fix the slice." + bash("sed -i 's/in lines\\[:-1\\])/in lines)/' inventory/pricing.py"),
              "Done." + bash("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")]
    cfg = AgentSection(max_turns=4, max_total_tokens=20000, wall_time_s=120.0)
    endpoint = Endpoint(ScriptedEngine(TOK, script), TOK, EndpointSection(enabled=True, host="0.0.0.0"),
                        "scripted")
    await endpoint.start()
    try:
        async with Bus(nats_url, python_packages=True) as bus:
            loop = BlackBoxLoop(endpoint, cfg, CommandAgents(bus.sandboxes, cfg))
            out = await loop.run(task, prompt, {"sample": "0"})
            assert out.error is None, out.error
            assert json.loads(out.metadata["agent_answer"]) == {"exit_status": "Submitted", "calls": 2}
            assert out.metadata["agent_calls"] == "2" and out.finish_reason == "eos"
            # one sequence: the agent's two turns, the tool result between them (masked), rendered by the template
            assert [t.role for t in out.turns] == ["assistant", "tool", "assistant"]
            assert "<returncode>0</returncode>" in out.turns[1].text
            first = TOK.decode(out.prompt_ids)
            assert '"name": "bash"' in first and prompt.text in first  # the stock tool and the issue, rendered
            assert out.handed_off
            rollout = Rollout(run_id="agentic", task="swe_fix", group_id="g", prompt_id=prompt.id, sample_index=0,
                              group_size=1, prompt_ids=out.prompt_ids, turns=out.turns,
                              finish_reason=out.finish_reason, policy_version=0, sandbox_id=out.sandbox_id,
                              metadata=dict(prompt.metadata))
            rollout.msg_id = "r-mini"
            score = await SandboxTestsGrader(SandboxTestsSpec(), bus.sandboxes).grade(rollout, task)
            assert score.score == 1.0, score.explanation
            assert "4/4 hidden tests passed" in score.explanation
            # the repository the agent left still has the bug's fix; the fork did not change it
            fixed = (await bus.sandboxes.read_file(out.sandbox_id, "inventory/pricing.py")).decode()
            assert "lines[:-1]" not in fixed
            await bus.sandboxes.destroy(out.sandbox_id)
    finally:
        await endpoint.stop()
