"""A short run of verifiers environments trains: a real ``rlbus run`` (trainer, rollout with its endpoint,
judge, weightsync on a real nats-server, the tiny model with the ChatML template), ``[task] name =
"verifiers"`` naming an environment written with verifiers' own classes (tests/tasks/verifiers_envs.py):
single-turn (a taskset with two reward functions), multi-turn (an environment answering each turn) and tools
(a taskset serving MCP tools: verifiers starts the tool server per episode, rlbus's harness sends the tools
to the endpoint; the random model writes no call, the tool path itself is tested with scripted calls in
test_verifiers_env.py).
Every episode's model calls go through its session; the judge scores them with the environment's reward
functions; the trainer takes at least one step on them."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import nats
import pytest

from proto import catalog
from services.launcher.accounting import read_all
from services.runtime.natsd import EmbeddedNats
from tests.conftest import run_file, trainer_records
from tests.rollout.conftest import build_tiny_model

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
TEMPLATE = REPO / "examples" / "chat_templates" / "chatml_tools.jinja"


@pytest.mark.timeout(900)
@pytest.mark.parametrize(("env", "rewards"), [
    ("tests.tasks.verifiers_envs", {"contains_answer", "brief"}),
    ("tests.tasks.verifiers_envs:load_dialogue", {"replied_every_turn", "contains_answer", "brief"}),
    ("tests.tasks.verifiers_envs:load_tools", {"contains_answer", "brief"}),
])
def test_a_short_run_of_a_verifiers_environment_trains(tmp_path, env, rewards):
    run_dir = tmp_path / "run"
    # a chat needs more context than the addition model's 64 positions: the character-level model of the
    # rollout tests (random weights; the pipeline is what is under test, not learning), with room for the
    # tools' schemas in the prompt (about 900 characters)
    model = build_tiny_model(tmp_path / "model", max_positions=2048)
    cfg = run_file(tmp_path, model, run_id="vf", model_keys={"chat_template": str(TEMPLATE)},
                   services={"trainer": 1, "rollout": 1, "judge": 1, "weightsync": 1},
                   task="verifiers", task_options={"env": env, "eval_size": 2, "max_new_tokens": 8},
                   trainer={"groups_per_step": 2, "group_size": 2, "total_steps": 2, "max_staleness": 1},
                   rollout={"endpoint": {"enabled": True}, "agent": {"max_turns": 4, "wall_time_s": 120.0}})
    r = subprocess.run([sys.executable, "-m", "services.launcher.cli", "run", str(cfg)], capture_output=True,
                       text=True, timeout=800, env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "run finished at step 2" in r.stderr, r.stderr[-4000:]
    records = trainer_records(run_dir / "metrics.jsonl")
    assert [rec["step"] for rec in records] == [1, 2], records
    trajs = _trajectories(run_dir, "vf")
    train = [t for t in trajs if not t.rollout.is_eval]
    assert len(train) >= 4, trajs
    for t in train:  # each scored by the environment's reward functions, each function's score explained
        assert t.rollout.error is None, t.rollout.error
        assert any(a.role == "assistant" for a in t.rollout.turns)
        (grader,) = [g for g in t.scores if g.grader != "turn_rewards"]
        assert grader.error is None and "weighted mean" in grader.explanation, grader
        assert all(f"{name}=" in grader.explanation for name in rewards), grader.explanation
        assert 0.0 <= t.reward <= 1.0
    if env.endswith(":load_tools"):  # the tools verifiers served reached the model as OpenAI tools
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model)
        assert all('"name": "calc_add"' in tok.decode(t.rollout.prompt_ids) for t in train)


def _trajectories(run_dir: Path, run_id: str) -> list:
    """The run's scored trajectories, read back from its stopped nats-server's store."""
    async def read() -> list:
        with EmbeddedNats(run_dir / "nats", port=None) as server:
            nc = await nats.connect(server.url)
            try:
                msgs = await read_all(nc.jetstream(), catalog.TRAJECTORIES_STREAM.name,
                                      catalog.TRAJECTORIES.wildcard(run_id), catalog.TRAJECTORIES.msg_type)
                return [t for m in msgs for t in catalog.members(m)]
            finally:
                await nc.close()

    return asyncio.run(read())
