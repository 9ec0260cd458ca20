"""``rlbus replay dlq``: a dead-lettered rollout is listed with why it failed and, with ``--publish``, sent to
its original subject again under a new message id, with ``--fix`` after changing fields (real nats-server, the
real CLI)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import nats

from proto import catalog, codec
from proto.deadletter import DeadLetter
from proto.rollouts import Rollout, Turn
from services.launcher.accounting import read_all
from services.runtime import bus

RUN = "dlqrun"


def rollout() -> Rollout:
    return Rollout(run_id=RUN, task="addition", group_id="g1", prompt_id="p1", sample_index=0, group_size=1,
                   prompt_ids=[1, 2], turns=[Turn(role="assistant", token_ids=[3], logprobs=[-0.5], versions=[0],
                                                   text="3")], finish_reason="stop", policy_version=0)


def cli(url: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.launcher.cli", "replay", "dlq", "--family", "rollouts",
                           "--nats-url", url, "--run-id", RUN, *extra], capture_output=True, text=True, timeout=120)


def test_dead_letters_are_listed_and_republished(nats_url):
    original = rollout()
    original.msg_id = "r-1"

    async def setup() -> None:
        nc = await nats.connect(nats_url)
        js = nc.jetstream()
        await bus.provision_all(js)
        letter = DeadLetter(run_id=RUN, service="judge", original_subject=catalog.ROLLOUTS.subject(RUN),
                            reason="grader crashed: KeyError 'answer'", error_type="KeyError", deliveries=5,
                            headers={"Nats-Msg-Id": "r-1", "traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"},
                            payload=codec.encode(original))
        await bus.publish(js, catalog.DEAD_LETTERS.subject(RUN, "rollouts"), letter)
        await nc.close()

    asyncio.run(setup())
    listed = cli(nats_url)
    assert listed.returncode == 0, listed.stderr
    assert "rlbus.dlqrun.rollouts from judge after 5 deliveries: KeyError: grader crashed" in listed.stdout
    assert "re-published" not in listed.stdout
    assert "no dead letters of family 'trajectories'" in subprocess.run(
        [sys.executable, "-m", "services.launcher.cli", "replay", "dlq", "--family", "trajectories", "--nats-url",
         nats_url, "--run-id", RUN], capture_output=True, text=True, timeout=120).stdout

    for _ in range(2):  # each replay is a new message (a fresh id), not de-duplicated away
        sent = cli(nats_url, "--publish")
        assert sent.returncode == 0 and "re-published 1 message(s)" in sent.stdout, sent.stderr

    async def read() -> list[Rollout]:
        nc = await nats.connect(nats_url)
        got = await read_all(nc.jetstream(), "ROLLOUTS", catalog.ROLLOUTS.subject(RUN), Rollout)
        await nc.close()
        return got

    got = asyncio.run(read())
    assert len(got) == 2 and all(r == original for r in got)

    # --fix: a field changed before the payload goes out again; a bad fix sends nothing and says why
    for bad, why in ((["--fix", "no_such_field=1"], "has no field 'no_such_field'"),
                     (["--fix", "policy_version=\"late\""], "refused, so nothing was sent: cannot decode"),
                     (["--fix", "turns.0.versions.0=1", "--fix", "oops"], "expected PATH=VALUE")):
        r = cli(nats_url, *bad)
        assert r.returncode != 0 and why in r.stderr, (bad, r.stdout, r.stderr)
    fixed = cli(nats_url, "--fix", "policy_version=3", "--fix", "turns.0.text=\"three\"")
    assert fixed.returncode == 0 and "re-published 1 message(s) with 2 fix(es)" in fixed.stdout, fixed.stderr
    got = asyncio.run(read())
    assert len(got) == 3 and got[2].policy_version == 3 and got[2].turns[0].text == "three"
    assert got[2].turns[0].token_ids == original.turns[0].token_ids and got[2].msg_id == original.msg_id


def test_status_watch_redraws_in_place(nats_url):
    async def setup() -> None:
        nc = await nats.connect(nats_url)
        await bus.provision_all(nc.jetstream())
        await nc.close()

    asyncio.run(setup())
    r = subprocess.run([sys.executable, "-m", "services.launcher.cli", "status", "--watch", "0.2", "--times", "2",
                        "--nats-url", nats_url, "--run-id", RUN], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    frames = r.stdout.split("\x1b[H\x1b[J")[1:]
    assert len(frames) == 2 and all(f"run {RUN}" in f and "every 0.2s" in f for f in frames)
    bad = subprocess.run([sys.executable, "-m", "services.launcher.cli", "status", "--watch", "0", "--nats-url",
                          nats_url, "--run-id", RUN], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "positive period" in bad.stderr
