"""Publishing beside the next step (``overlap_publish``) keeps the serial loop's order: a batch's outcomes are
recorded only after the version trained on it was announced, versions go out one by one in order, and every
trajectory is trained exactly once.

The real trainer service runs against a real nats-server with the tiny model and the store transport; the
rollout and judge are played by the resume test's stand-in (it answers every ticket at once), so the trainer
is never waiting for data and its publishes really do run beside the next learner step.
"""

from __future__ import annotations

import asyncio
import json

import nats
import pytest

from proto import codec
from proto.accounting import OutcomeBatch
from proto.weights import WeightAnnouncement
from services.launcher import registry
from services.runtime import service
from tests.conftest import wait_for_async
from tests.trainer.test_resume import RUN, _config, _stand_in

STEPS = 6


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
async def test_outcomes_follow_their_version_and_every_step_trains_once(nats_url, tmp_path, loop_model_dir, overlap):
    nc = await nats.connect(nats_url)
    seen: list[tuple[str, int]] = []  # ("announce", version) | ("trained", version), in arrival order

    async def on_announce(msg) -> None:
        seen.append(("announce", codec.decode(msg.data, WeightAnnouncement).policy_version))

    async def on_outcome(msg) -> None:
        batch = codec.decode(msg.data, OutcomeBatch)
        seen.extend(("trained", o.version) for o in batch.outcomes if o.outcome == "trained")

    # one connection: the trainer's announcements and outcomes arrive in the order it published them
    await nc.subscribe(f"rlbus.{RUN}.weights.announce.main", cb=on_announce)
    await nc.subscribe(f"rlbus.{RUN}.outcomes", cb=on_outcome)
    await nc.flush()
    await _stand_in(nc, [])
    factory = registry.load("trainer")[1]
    cfg = _config(tmp_path, nats_url, loop_model_dir, STEPS, 4, groups_per_step=2, max_staleness=1,
                  overlap_publish=overlap)
    code = await asyncio.wait_for(service.serve("trainer", factory, cfg, "trainer-0"), 240)
    assert code == 0
    # the last step's announcement and outcomes, published before the trainer stopped, reach this connection
    await wait_for_async(lambda: sum(kind == "announce" for kind, _ in seen) == STEPS + 1 and
                         sum(kind == "trained" for kind, _ in seen) == STEPS * 2 * 2, 30,
                         "every version's announcement and every trained outcome")
    await nc.close()

    announced = [v for kind, v in seen if kind == "announce"]
    assert announced == list(range(STEPS + 1))  # version 0, then one per step, in order
    for i, (kind, version) in enumerate(seen):
        if kind == "trained":  # recorded at commit: the step's version was sent (and announced) first
            assert ("announce", version) in seen[:i], (version, seen)
    trained = [v for kind, v in seen if kind == "trained"]
    assert sorted(trained) == trained and len(trained) == STEPS * 2 * 2  # every sample once, steps in order
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["step"] == STEPS and summary["counters"]["trained"] == STEPS * 4
    steps = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
             if "time/step_s" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert all("time/settle_s" in r and "time/publish_s" in r for r in steps)
