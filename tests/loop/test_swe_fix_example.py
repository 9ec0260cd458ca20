"""`rlbus run examples/swe_fix.toml`, shortened: stock mini-swe-agent in bubblewrap sandboxes calls the
rollout's endpoint, the judge runs the hidden tests in forks, and the trainer steps on the sessions'
trajectories. The policy is a tiny random chat model (a character-level tokenizer with ChatML specials, saved
like any model directory) in place of SmolLM2: the reward may be zero; the pipeline is what is checked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from services.runtime.natsd import free_port
from tests.agentic.agentic_harness import chat_tokenizer
from tests.conftest import recorded

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
STEPS, GROUPS, GROUP_SIZE, EVAL_PROMPTS = 2, 1, 2, 1  # at most 2 agents at once on 2 cores


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama over printable ASCII + ChatML specials, with room for the stock agent's long prompt."""
    path = tmp_path_factory.mktemp("swe-fix-model")
    tok = chat_tokenizer()
    tok.chat_template = None  # the run file's [model] chat_template renders the tools
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=16384, pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_swe_fix_example_runs_mini_swe_agent_in_sandboxes_and_trains(tmp_path, chat_model_dir):
    run_dir = tmp_path / "run"
    short = {  # the example as shipped, but for the tiny model and a few steps
        "run.dir": run_dir, "launcher.nats_port": free_port(), "model.name": chat_model_dir,
        "task.options.max_tokens": 12, "task.options.num_eval": EVAL_PROMPTS,
        "services.trainer.total_steps": STEPS, "services.trainer.max_wall_s": 0,
        "services.trainer.groups_per_step": GROUPS, "services.trainer.group_size": GROUP_SIZE,
        "services.trainer.eval.prompts": EVAL_PROMPTS, "services.trainer.devices.num_threads": 1,
        "services.rollout.agent.wall_time_s": 300, "services.trainer.max_staleness": 0,
        "services.rollout.max_tickets": 1,
    }
    command = [sys.executable, "-m", "services.launcher.cli", "run", "examples/swe_fix.toml"]
    for key, value in short.items():
        command += ["--set", f"{key}={json.dumps(str(value)) if isinstance(value, Path) else value}"]
    r = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr[-4000:]
    assert f"run finished at step {STEPS}" in r.stderr

    rec = recorded(run_dir, "swe_fix")
    trained = [t for t in rec.trajectories if not t.rollout.is_eval]
    assert len(trained) >= STEPS * GROUPS * GROUP_SIZE
    for t in rec.trajectories:
        rollout = t.rollout
        assert rollout.error is None, rollout.error
        # the stock agent called the endpoint; its session gave the trajectory (its own rendered prompt)
        assert int(rollout.metadata["agent_calls"]) >= 1 and int(rollout.metadata["agent_tokens"]) > 0
        assert float(rollout.metadata["agent_wall_s"]) > 0 and rollout.metadata["agent_exit_code"] == "0"
        assert rollout.prompt_ids  # the agent's first call rendered it: the sample carries it
        assert rollout.turns and rollout.turns[0].role == "assistant" and rollout.turns[0].token_ids
        # the judge ran the hidden tests in a fork of the sandbox the agent left
        (score,) = t.scores
        assert score.grader == "sandbox_tests" and score.error is None
        assert "hidden tests passed" in score.explanation, score.explanation
    # the trainer trained on them
    assert sum(o.outcome == "trained" for o in rec.outcomes) == STEPS * GROUPS * GROUP_SIZE
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "train/reward_mean" in m] == list(range(1, STEPS + 1))
