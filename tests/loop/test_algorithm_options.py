"""The algorithm options run end to end in the real trainer (docs/algorithms.md): dynamic sampling drops groups
without reward signal with the reason and admits others in their place, so every step still trains exactly
``groups_per_step`` groups and the accounting identity holds; truncated completions are masked and penalised;
the loss types and mismatch masks report their figures.

The real trainer service runs against a real nats-server with the tiny model. Rollout and judge are played by
this test (a stand-in answering every prompt ticket with scored trajectories it makes up): even-numbered groups
score 1.0 on every sample (no signal), odd-numbered ones 0, 1, 0; sample 0 is cut by the token limit.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections import Counter

import nats
import pytest

from proto import catalog, codec
from proto.prompts import PromptTicket
from proto.rollouts import Rollout, Turn
from proto.trajectories import ScoredTrajectory
from services.launcher import registry
from services.launcher.accounting import accounting, read_channel
from services.runtime import service
from services.runtime.config import load_service_config
from services.runtime.natsd import EmbeddedNats
from services.trainer.admission import Sample
from services.trainer.collect import without_signal
from services.trainer.ledger import group_index
from tests.conftest import run_file

STEPS, GROUPS, SIZE, LIMIT = 2, 2, 3, 4


@pytest.mark.slow
@pytest.mark.parametrize("loss", [
    {"type": "gspo", "is_mode": "icepop", "mismatch": {"mask": "geometric", "low": 0.2, "high": 5.0}},
    {"type": "cispo", "mismatch": {"mask": "token", "low": 0.2, "high": 5.0}},
    {"type": "dr_grpo", "mismatch": {"mask": "sequence", "low": 0.01, "high": 100.0}},
], ids=lambda loss: loss["type"])
async def test_dynamic_sampling_overlong_and_loss_options_in_the_loop(nats_url, tmp_path, loop_model_dir, loss):
    run = f"algo{loss['type'].replace('_', '')}"
    cfg = run_file(tmp_path, loop_model_dir, run_id=run, nats_url=nats_url,
                   trainer={"groups_per_step": GROUPS, "group_size": SIZE, "total_steps": STEPS, "max_staleness": 0,
                            "dynamic_sampling": True, "sampling": {"max_new_tokens": LIMIT},
                            "loss": {**loss, "mask_truncated": True, "overlong_buffer": 2},
                            "eval": {"prompts": 2}})
    cfg_cls, factory = registry.load("trainer")
    loaded = load_service_config("trainer", cfg_cls, cfg)
    trainer = asyncio.create_task(service.serve("trainer", factory, loaded, "trainer-0"))

    nc = await nats.connect(nats_url)
    js = nc.jetstream()

    async def answer(msg) -> None:  # the stand-in rollout + judge
        ticket = codec.decode(msg.data, PromptTicket)
        index = group_index(ticket.group_id)
        no_signal = ticket.is_eval or index is None or index % 2 == 0
        for i in range(ticket.group_size):
            cut = i == 0 and not ticket.is_eval  # LIMIT tokens, finish_reason "length": masked and penalised
            n = LIMIT if cut else 2
            turn = Turn(role="assistant", token_ids=[5, 6, 7, 8][:n], logprobs=[-1.0, -1.5, -2.0, -1.2][:n],
                        versions=[ticket.policy_version] * n, text="x")
            rollout = Rollout(run_id=run, task=ticket.task, group_id=ticket.group_id, prompt_id=ticket.prompt_id,
                              sample_index=i, group_size=ticket.group_size, prompt_ids=ticket.prompt_ids,
                              turns=[turn], finish_reason="length" if cut else "eos",
                              policy_version=ticket.policy_version, is_eval=ticket.is_eval)
            traj = ScoredTrajectory(run_id=run, rollout=rollout, reward=1.0 if no_signal else float(i % 2))
            traj.msg_id = f"{run}-{ticket.group_id}-s{i}"
            await js.publish(f"rlbus.{run}.trajectories", codec.encode(traj), headers={"Nats-Msg-Id": traj.msg_id})

    await nc.subscribe(f"rlbus.{run}.prompts", cb=answer)
    code = await asyncio.wait_for(trainer, 300)
    assert code == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["step"] == STEPS

    outcomes = [o for o in await read_channel(js, catalog.OUTCOMES, run) if o.outcome != "eval"]
    trained = [o for o in outcomes if o.outcome == "trained"]
    # every step trained exactly groups_per_step groups, all of them odd-numbered (with signal)
    groups_per_step = Counter(step for step, _ in {(o.step, o.group_id) for o in trained})
    assert groups_per_step == {s: GROUPS for s in range(1, STEPS + 1)}, groups_per_step
    assert all(group_index(o.group_id) % 2 == 1 for o in trained)  # type: ignore[operator]
    filtered = [o for o in outcomes if o.outcome == "dropped"]
    assert filtered and all(o.reason.startswith("filtered: no reward signal (dynamic sampling), all 3 rewards 1")
                            for o in filtered), [o.reason for o in filtered]
    assert {group_index(o.group_id) % 2 for o in filtered} == {0}  # type: ignore[operator]
    assert Counter(o.group_id for o in filtered) == {g: SIZE for g in {o.group_id for o in filtered}}  # whole groups
    acc = await accounting(js, run)
    await nc.close()
    assert acc["lost"] == 0 and acc["multiple_outcomes"] == 0 and acc["identity_holds"], acc

    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in steps if "losses/total" in m]
    assert len(steps) == STEPS
    for m in steps:
        assert 0.0 < m["trainer/filtered_frac"] < 1.0  # groups 0, 2, ... were filtered before each step
        # the groups admitted in their place came through the same bound: (max_staleness + 1) * groups_per_step
        assert m["trainer/in_flight_peak"] <= GROUPS and m["trainer/admission_bound"] == GROUPS
        assert m["overlong/truncated_frac"] == pytest.approx(1 / SIZE)  # sample 0 of each group
        # at the limit: the full penalty (-1) on one sample of three; the others (2 tokens) are within the buffer
        assert m["overlong/penalty_mean"] == pytest.approx(-1 / SIZE)
        for key in ("mismatch/kl", "mismatch/masked_frac", "mismatch/ratio_p05", "mismatch/ratio_p50",
                    "mismatch/ratio_p95"):
            assert key in m, key
        assert m["mismatch/ratio_p05"] <= m["mismatch/ratio_p50"] <= m["mismatch/ratio_p95"]
        assert m["mismatch/kl"] >= 0.0


def _sample(i: int, reward: float, error: str | None = None) -> Sample:
    turn = Turn(role="assistant", token_ids=[5], logprobs=[-1.0], versions=[0], text="x")
    rollout = Rollout(run_id="r", task="t", group_id="g00000000", prompt_id="p", sample_index=i, group_size=3,
                      prompt_ids=[1], turns=[turn], finish_reason="error" if error else "eos", policy_version=0,
                      error=error)
    return Sample(key=f"s{i}", group_id="g00000000", sample_index=i, version=0,
                  item=ScoredTrajectory(run_id="r", rollout=rollout, reward=reward))


def test_a_group_without_signal_is_told_by_its_successful_samples():
    assert without_signal([_sample(0, 1.0), _sample(1, 0.0), _sample(2, 1.0)]) == ""
    assert without_signal([_sample(0, 0.5), _sample(1, 0.5), _sample(2, 0.5)]) == (
        "filtered: no reward signal (dynamic sampling), all 3 rewards 0.5")
    # a failed sample (reward 0 by the judge) does not give the group a signal: it is never trained
    assert without_signal([_sample(0, 0.0, "sandbox died"), _sample(1, 1.0), _sample(2, 1.0)]).endswith(
        "all 2 rewards 1")
    # every sample failed: not this filter's (the step drops them with their errors)
    assert without_signal([_sample(i, 0.0, "engine error") for i in range(3)]) == ""


@pytest.mark.slow
def test_the_options_together_in_a_short_rlbus_run(tmp_path, loop_model_dir):
    """Real rollout engine and judges (`rlbus run`, separate processes): the engine's behaviour logprobs meet the
    trainer's, so the mismatch figures are real; every option on at once; nothing is lost."""
    run_dir = tmp_path / "run"
    cfg = run_file(tmp_path, loop_model_dir, run_id="algoe2e",
                   services={"trainer": 1, "rollout": 1, "judge": 1, "weightsync": 1},
                   trainer={"groups_per_step": 2, "total_steps": 3, "max_staleness": 1, "dynamic_sampling": True,
                            "dynamic_sampling_bound": 2, "sampling": {"max_new_tokens": 6},
                            "loss": {"type": "gspo", "mask_truncated": True, "overlong_buffer": 2, "is_mode": "icepop",
                                     "is_cap": 5.0, "mismatch": {"mask": "geometric", "low": 0.5, "high": 2.0}}},
                   rollout={"max_tickets": 8}, weights={"type": "store"})
    r = subprocess.run([sys.executable, "-m", "services.launcher.cli", "run", str(cfg)], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in steps if "losses/total" in m]
    assert len(steps) == 3
    for m in steps:
        # the untrained tiny model mostly scores 0 everywhere: filtering stops at the bound, 2 x groups_per_step
        assert m["trainer/filtered_groups"] <= 2 * 2 and 0.0 <= m["overlong/truncated_frac"] <= 1.0
        assert m["mismatch/ratio_p05"] <= m["mismatch/ratio_p50"] <= m["mismatch/ratio_p95"] and m["mismatch/kl"] >= 0

    async def read() -> tuple[dict, list]:
        with EmbeddedNats(run_dir / "nats", port=None) as server:
            nc = await nats.connect(server.url)
            js = nc.jetstream()
            acc = await accounting(js, "algoe2e")
            outcomes = await read_channel(js, catalog.OUTCOMES, "algoe2e")
            await nc.close()
            return acc, outcomes

    acc, outcomes = asyncio.run(read())
    assert acc["lost"] == 0 and acc["multiple_outcomes"] == 0 and acc["identity_holds"], acc
    trained = {(o.step, o.group_id) for o in outcomes if o.outcome == "trained"}
    assert Counter(step for step, _ in trained) == {1: 2, 2: 2, 3: 2}  # groups_per_step, every step
    reasons = {o.reason.split(":")[0] for o in outcomes if o.outcome == "dropped"}
    assert reasons <= {"filtered", "stale"}, reasons
