"""A black-box agent that rewrites its history mid-episode, through the whole loop: the real trainer, rollout
(endpoint over the torch engine) and judge services over nats-server, on a tiny model over the chat tokenizer.
Each episode is two segments; the trainer takes one step on both segments of every episode (two sequences per
episode) and records each episode ``trained``."""

from __future__ import annotations

import json

import nats
import pytest
from black_box_agents import TruncatesItsHistory
from endpoint_harness import tiny_model, tokenizer

from proto import catalog
from services.launcher import registry
from services.launcher.accounting import read_channel
from services.runtime import service
from services.runtime.config import load_service_config
from tests.conftest import run_file

RUN = "segloop"


@pytest.mark.slow
async def test_an_agent_that_truncates_its_history_trains_on_both_segments(nats_url, tmp_path):
    assert TruncatesItsHistory.name == "black-box-truncating"  # registered by the import
    tok = tokenizer()
    model_dir = tmp_path / "model"
    tiny_model(tok).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    cfg = run_file(tmp_path, model_dir, run_id=RUN, nats_url=nats_url, task="black-box-truncating",
                   trainer={"groups_per_step": 1, "group_size": 2, "total_steps": 1, "max_staleness": 0},
                   rollout={"endpoint": {"enabled": True}, "agent": {"max_turns": 3, "wall_time_s": 60.0}},
                   common={"drain_timeout_s": 5.0})
    group = []
    for name in ("trainer", "rollout", "judge"):
        cfg_cls, factory = registry.load(name)
        group.append((name, factory, load_service_config(name, cfg_cls, cfg), f"{name}-0"))
    assert await service.serve_colocated(group) == 0  # the trainer finished its step; the others stopped

    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    trajectories = await read_channel(js, catalog.TRAJECTORIES, RUN)
    outcomes = await read_channel(js, catalog.OUTCOMES, RUN)
    await nc.close()
    trained = {o.trajectory_id for o in outcomes if o.outcome == "trained"}
    assert len(trained) == 2, [(o.trajectory_id, o.outcome, o.reason) for o in outcomes]
    episodes = [t for t in trajectories if t.msg_id in trained]
    assert len(episodes) == 2
    for t in episodes:
        r = t.rollout
        assert r.error is None and r.metadata["agent_segments"] == "2" and r.metadata["agent_calls"] == "3"
        # segment 1: question, answer, "Sure?", answer; segment 2: its own prompt (the rewritten history)
        assert [turn.role for turn in r.turns] == ["assistant", "tool", "assistant"]
        (second,) = r.extra_segments
        assert "Once more" in tok.decode(second.prompt_ids) and [turn.role for turn in second.turns] == ["assistant"]
        assert all(len(turn.versions) == len(turn.token_ids) for turn in r.all_turns() if turn.role == "assistant")
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    step = next(m for m in metrics if "train/sequences" in m)
    assert step["train/episodes"] == 2.0 and step["train/sequences"] == 4.0  # both segments of each episode
