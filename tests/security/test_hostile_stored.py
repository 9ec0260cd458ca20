"""Garbage stored on the streams (what anyone with a publish grant can leave there) costs only itself: the
accounting, ``rlbus replay dlq`` and ``rlbus replay step N`` skip each message that does not decode, count it,
say so, and still read every good message (real nats-server, the real CLI as a subprocess)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import nats
import pytest

from proto import catalog, codec
from proto.accounting import OutcomeBatch, TrajectoryOutcome
from proto.deadletter import DeadLetter
from proto.trajectories import ScoredGroup
from services.launcher.accounting import accounting
from services.launcher.replay import replay_step
from services.runtime import bus
from services.runtime.natsd import EmbeddedNats
from tests.distributed.rank_script import batch

pytestmark = pytest.mark.timeout(300)

RUN = "hostile"
#: not msgpack; valid msgpack of the wrong shape; a truncated map
GARBAGE = (b"\xc1\xc1 garbage \xff", codec.msgspec.msgpack.encode({"tag": "scored_group", "items": 7}), b"\x85\xa1a")


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.launcher.cli", *args], capture_output=True, text=True,
                          timeout=240)


async def store_work(js, trajectories) -> None:
    """The run's trajectories (one group message per prompt group), step 1's outcomes, and garbage on both."""
    for g in sorted({t.rollout.group_id for t in trajectories}):
        await bus.publish(js, catalog.TRAJECTORIES.subject(RUN), ScoredGroup.of(
            [t for t in trajectories if t.rollout.group_id == g]))
    for junk in GARBAGE:
        await js.publish(catalog.TRAJECTORIES.subject(RUN), junk)
        await js.publish(catalog.OUTCOMES.subject(RUN), junk)
    await bus.publish(js, catalog.OUTCOMES.subject(RUN), OutcomeBatch(run_id=RUN, outcomes=[TrajectoryOutcome(
        run_id=RUN, trajectory_id=t.msg_id, group_id=t.rollout.group_id, outcome="trained", step=1, version=0,
        sample_version=0, batch_index=i) for i, t in enumerate(trajectories)]))


def trajectories_of_run():
    out = batch(5, groups=2, group_size=2)
    for i, t in enumerate(out):
        t.run_id = t.rollout.run_id = RUN
        t.msg_id = f"t-{i}"
    return out


async def test_accounting_and_replay_dlq_skip_and_count_garbage(nats_url):
    trajectories = trajectories_of_run()
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    try:
        await bus.provision_all(js)
        await store_work(js, trajectories)
        letter = DeadLetter(run_id=RUN, service="judge", original_subject=catalog.ROLLOUTS.subject(RUN),
                            reason="grader crashed", error_type="KeyError", deliveries=3, payload=b"\x80")
        await bus.publish(js, catalog.DEAD_LETTERS.subject(RUN, "rollouts"), letter)
        for junk in GARBAGE:
            await js.publish(catalog.DEAD_LETTERS.subject(RUN, "rollouts"), junk)

        acc = await accounting(js, RUN)
        assert acc["undecodable"] == {"TRAJECTORIES": 3, "OUTCOMES": 3}
        assert acc["published"] == acc["trained"] == len(trajectories) and acc["messages"] == 2
        assert acc["lost"] == 0 and acc["pending"] == 0
    finally:
        await nc.close()

    listed = cli("replay", "dlq", "--family", "rollouts", "--nats-url", nats_url, "--run-id", RUN)
    assert listed.returncode == 0, listed.stderr
    assert "skipped 3 undecodable stored message(s) (3 in DLQ" in listed.stdout
    assert "rlbus.hostile.rollouts from judge after 3 deliveries: KeyError: grader crashed" in listed.stdout
    sent = cli("replay", "dlq", "--family", "rollouts", "--nats-url", nats_url, "--run-id", RUN, "--publish")
    assert sent.returncode == 0 and "re-published 1 message(s)" in sent.stdout, sent.stderr  # the garbage: never


def test_replay_step_skips_and_counts_garbage(tmp_path, loop_model_dir):
    """A run directory holding step 1 (its batch in TRAJECTORIES, its outcomes, the recorded figures): after
    garbage lands on both streams, ``rlbus replay step 1`` still rebuilds the batch bit-identically."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.resolved.json").write_text(json.dumps({
        "run": {"id": RUN, "seed": 0}, "model": {"name": str(loop_model_dir)}, "weights": {"type": "store"},
        "services": {"trainer": {"devices": {"num_threads": 1, "device": "cpu"}}}}))
    trajectories = trajectories_of_run()

    async def store(garbage: bool) -> None:
        with EmbeddedNats(run_dir / "nats", port=None) as server:
            nc = await nats.connect(server.url)
            js = nc.jetstream()
            await bus.provision_all(js)
            if garbage:
                for junk in GARBAGE:
                    await js.publish(catalog.TRAJECTORIES.subject(RUN), junk)
                    await js.publish(catalog.OUTCOMES.subject(RUN), junk)
            else:
                await store_work(js, trajectories)
            await nc.close()

    asyncio.run(store(garbage=False))  # (store_work leaves 3 garbage messages on each stream already)
    metrics = run_dir / "metrics.jsonl"
    metrics.write_text(json.dumps({"step": 1, "optim/grad_norm": 0.0}) + "\n")
    first = replay_step(run_dir, 1)  # what the trainer's code computes for this batch: recorded as step 1
    assert first.samples == len(trajectories) and "skipped 6 undecodable" in first.skipped
    metrics.write_text(json.dumps({"step": 1, **first.recomputed}) + "\n")
    asyncio.run(store(garbage=True))

    out = cli("replay", "step", "1", "--run-dir", str(run_dir))
    assert out.returncode == 0, (out.stdout, out.stderr[-3000:])
    assert out.stdout.count("identical") == 3 and f"{len(trajectories)} trajectories" in out.stdout
    assert "skipped 12 undecodable stored message(s) (6 in OUTCOMES, 6 in TRAJECTORIES" in out.stdout
