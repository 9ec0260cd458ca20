"""`rlbus schema`: the checked-in JSON Schemas (proto/schemas/) are current, valid, and describe real messages."""

from __future__ import annotations

import json
import subprocess
import sys

import jsonschema
import msgspec
import pytest

from proto import catalog, sandbox
from proto.accounting import OutcomeBatch, TrajectoryOutcome
from proto.metrics import MetricsReport
from proto.rollouts import Rollout, RolloutGroup, Turn
from proto.trajectories import GraderScore, ScoredGroup, ScoredTrajectory
from services.launcher import schema


def test_checked_in_schemas_are_current():
    problems = schema.stale(schema.DEFAULT_DIR)
    assert not problems, "proto/schemas is not current; run `rlbus schema` and commit the files:\n" + "\n".join(problems)


def _validator(name: str) -> jsonschema.Draft202012Validator:
    doc = json.loads((schema.DEFAULT_DIR / name).read_text())
    jsonschema.Draft202012Validator.check_schema(doc)
    return jsonschema.Draft202012Validator(doc)


def test_every_channel_has_a_valid_schema_and_an_index_entry():
    index = json.loads((schema.DEFAULT_DIR / schema.INDEX).read_text())["channels"]
    assert set(index) == set(catalog.CHANNELS)
    for name, c in catalog.CHANNELS.items():
        assert index[name]["subject"] == c.pattern
        _validator(index[name]["schema"])
        if c.reply_type is not None:
            _validator(index[name]["reply_schema"])


def _json(msg: msgspec.Struct) -> object:
    return json.loads(msgspec.json.encode(msg))


def _trajectory() -> ScoredTrajectory:
    rollout = Rollout(run_id="r", task="addition", group_id="g", prompt_id="p", sample_index=0, group_size=2,
                      prompt_ids=[1, 2], finish_reason="eos", policy_version=3,
                      turns=[Turn(role="assistant", token_ids=[4], logprobs=[-0.5], versions=[3], text="7")])
    return ScoredTrajectory(run_id="r", rollout=rollout, reward=1.0, scores=[GraderScore(grader="exact", score=1.0)])


@pytest.mark.parametrize("channel, msg", [
    (catalog.ROLLOUTS, RolloutGroup.of([_trajectory().rollout])),
    (catalog.TRAJECTORIES, ScoredGroup.of([_trajectory()])),
    (catalog.METRICS, MetricsReport(run_id="r", service="trainer", instance="t-0", step=2, values={"a/b": 0.5})),
    (catalog.OUTCOMES, OutcomeBatch(run_id="r", outcomes=[TrajectoryOutcome(
        run_id="r", trajectory_id="x", group_id="g", outcome="trained", step=1, version=1, sample_version=0)])),
    (catalog.SANDBOX_REQUESTS, sandbox.ExecRequest(run_id="r", sandbox_id="s", command=sandbox.Argv(args=["true"]))),
], ids=lambda v: v.name if isinstance(v, catalog.Channel) else type(v).__name__)
def test_real_messages_validate_and_broken_ones_do_not(channel, msg):
    v = _validator(f"{channel.name}.schema.json")
    good = _json(msg)
    v.validate(good)
    wrong_type = {**good, "run_id": 7}
    assert not v.is_valid(wrong_type)
    missing = {k: val for k, val in good.items() if k != "run_id"}
    assert not v.is_valid(missing)


def test_tagged_unions_inside_messages_are_checked():
    v = _validator("sandbox_requests.schema.json")
    good = _json(sandbox.ExecRequest(run_id="r", sandbox_id="s", command=sandbox.Shell(script="echo hi")))
    v.validate(good)
    assert not v.is_valid({**good, "command": ["echo", "hi"]})  # a command is an argv or a shell object
    assert not v.is_valid({**good, "type": "sandbox_nonsense"})


def test_reply_schema_takes_the_replies():
    v = _validator("sandbox_requests.reply.schema.json")
    v.validate(_json(sandbox.ErrorReply(run_id="r", code="not_found", message="no such sandbox")))
    assert not v.is_valid(_json(_trajectory()))


def test_cli_writes_and_checks(tmp_path):
    cli = [sys.executable, "-m", "services.launcher.cli", "schema", "--out", str(tmp_path)]
    r = subprocess.run(cli, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(schema.render())
    assert subprocess.run([*cli, "--check"], capture_output=True, text=True, timeout=120).returncode == 0
    (tmp_path / "metrics.schema.json").write_text("{}\n")
    (tmp_path / "gone.schema.json").write_text("{}\n")
    r = subprocess.run([*cli, "--check"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "metrics.schema.json: out of date" in r.stdout and "gone.schema.json: no such channel" in r.stdout
    assert subprocess.run(cli, capture_output=True, text=True, timeout=120).returncode == 0
    assert not (tmp_path / "gone.schema.json").exists()
    assert (tmp_path / "metrics.schema.json").read_text() == schema.render()["metrics.schema.json"]
