"""The RL loop with each direct weight transport, chosen by config alone (issue 7).

* broadcast: trainer + 2 rollout engines in a torch.distributed (gloo) group, each its own process;
* inproc: trainer and rollout colocated in one process (``"trainer+rollout" = 1``), tensors handed over.

No weight store is used in either: the test checks that engines generated with the trainer's
newer versions (the per-token versions in the trajectories) and that no weight blob was stored.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys

import nats
import pytest

from proto import catalog
from services.launcher.accounting import read_channel
from services.launcher.runfile import RunFile
from services.launcher.status import collect
from services.lib.weights.index import VersionIndex
from services.runtime.config import ConfigError
from services.runtime.natsd import EmbeddedNats
from tests.conftest import run_file

LAYOUTS = {
    "broadcast": (
        {"trainer": 1, "rollout": 2, "judge": 1},
        {"type": "broadcast", "backend": "gloo", "timeout_s": 120},  # world_size: the launcher's (1 + 2)
    ),
    "inproc": ({"trainer+rollout": 1, "judge": 1}, {"type": "inproc"}),
    # colocated, the engine asleep (its KV cache released) during every learner step
    "inproc-sleep": ({"trainer+rollout": 1, "judge": 1}, {"type": "inproc"}),
}


def _run_three_steps(tmp_path, model_dir, run_id: str, services: dict[str, int],
                     trainer_extra: dict | None = None, rollout_extra: dict | None = None,
                     extra: str = "", weights: dict | None = None) -> dict[str, str]:
    """`rlbus run` of 3 synchronous steps of the tiny model; returns the service logs by file name."""
    run_dir = tmp_path / "run"
    cfg = run_file(tmp_path, model_dir, run_id=run_id, services=services, extra=extra, weights=weights,
                   trainer={"groups_per_step": 2, "total_steps": 3, "max_staleness": 0,
                            **(trainer_extra or {}), "eval": {"prompts": 4}},
                   rollout={"max_tickets": 8, **(rollout_extra or {})})
    r = subprocess.run([sys.executable, "-m", "services.launcher.cli", "run", str(cfg)], capture_output=True,
                       text=True, timeout=600)
    logs = {p.name: p.read_text() for p in (run_dir / "logs").glob("*.log")}
    assert r.returncode == 0, r.stderr[-3000:] + "\n".join(v[-2000:] for v in logs.values())
    assert "run finished at step 3" in r.stderr
    return logs


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_loop_runs_with_direct_transport(tmp_path, loop_model_dir, kind):
    services, transport = LAYOUTS[kind]
    run_dir = tmp_path / "run"
    run_id = f"tr-{kind}"
    engine = {"engine": {"type": "torch", "enable_sleep_mode": True}} if kind == "inproc-sleep" else {}
    logs = _run_three_steps(tmp_path, loop_model_dir, run_id, services, weights=transport, rollout_extra=engine)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["step"] == 3 and summary["version"] == 3
    if kind == "broadcast":
        joined = [name for name, text in logs.items() if "joined broadcast group" in text]
        assert sorted(joined) == ["rollout-0.log", "rollout-1.log"], logs.keys()
        # each applied version names the sha256 its data was verified against: the same on both engines
        applied = [applied_digests(logs[f"rollout-{i}.log"]) for i in (0, 1)]
        assert {1, 2} <= set(applied[0]) and all(d.startswith("sha256:") for d in applied[0].values()), applied
        assert all(applied[0][v] == applied[1][v] for v in set(applied[0]) & set(applied[1])), applied
    else:
        assert sorted(logs) == ["judge-0.log", "trainer+rollout-0.log"]
        colocated = logs["trainer+rollout-0.log"]
        slept = colocated.count("KV cache released"), colocated.count("awake (")
        assert slept == ((3, 3) if kind == "inproc-sleep" else (0, 0)), slept  # once per learner step

    async def read():
        with EmbeddedNats(run_dir / "nats", port=None) as server:
            nc = await nats.connect(server.url)
            js = nc.jetstream()
            trajectories = await read_channel(js, catalog.TRAJECTORIES, run_id)
            streams = [s.config.name for s in await js.streams_info()]
            status = await collect(nc, run_id)
            await nc.close()
            return trajectories, streams, status

    trajectories, streams, status = asyncio.run(read())
    assert status["trainer"]["version"] == 3
    if kind == "broadcast":  # `rlbus status` shows the newest broadcast version
        assert status["weights"]["version"] == 3 and status["weights"]["transport"] == "broadcast", status
    # with max_staleness 0 the last step trains on samples generated at version 2: they reached the engines
    token_versions = {v for t in trajectories for turn in t.rollout.turns for v in turn.versions}
    assert {0, 1, 2} <= token_versions, token_versions
    assert not [s for s in streams if s.startswith("OBJ_")], f"a weight store was used: {streams}"


def applied_digests(log: str) -> dict[int, str]:
    """Version -> digest of every "applied weights version N digest D" line of a rollout log."""
    return {int(v): d for v, d in re.findall(r"applied weights version (\d+) digest (\S+)", log)}


@pytest.mark.slow
def test_the_rollout_log_names_each_applied_versions_verified_digest(tmp_path, loop_model_dir):
    """Through the store: every version the engine applied is logged with the digest its receiver verified,
    and that is the announced manifest's (``<algorithm>:<state_sha256>``), so "never applied a corrupt
    version" can be checked from the log alone."""
    run_id = "tr-digest"
    logs = _run_three_steps(tmp_path, loop_model_dir, run_id, {"trainer": 1, "rollout": 1, "judge": 1})
    applied = applied_digests(logs["rollout-0.log"])
    assert {0, 1, 2} <= set(applied), logs["rollout-0.log"][-3000:]

    async def manifests() -> dict[int, str]:
        with EmbeddedNats(tmp_path / "run" / "nats", port=None) as server:
            nc = await nats.connect(server.url)
            index = VersionIndex(nc, run_id)
            await index.ensure()
            found = {}
            for v in await index.versions():
                m = await index.manifest(v)
                assert m is not None
                found[v] = f"{m.digest}:{m.state_sha256}"
            await nc.close()
            return found

    announced = asyncio.run(manifests())
    assert applied == {v: announced[v] for v in applied}, (applied, announced)
    assert all(d.startswith("blake3:") and len(d) == len("blake3:") + 64 for d in applied.values()), applied


def _check(weights: dict, services: dict[str, int], **sections: dict) -> list[str]:
    """The typed run file's cross-section check for a [weights] section and a launcher layout."""
    return RunFile.from_tree({"weights": weights, "launcher": {"services": services},
                              "services": sections}).check()


def test_launcher_refuses_layouts_the_transport_cannot_serve():
    bc = {"type": "broadcast"}
    # the group's size follows the layout: the launcher derives it for every service it starts
    assert _check(bc, {"trainer": 1, "rollout": 2, "judge": 1}) == ["weights.world_size=3"]
    assert _check({**bc, "world_size": 3}, {"trainer": 1, "rollout": 2}) == []  # set and consistent: accepted
    assert _check({"type": "store"}, {"trainer": 1, "rollout": 5}) == []  # the store serves any layout
    with pytest.raises(ConfigError, match="set it to 4"):
        _check({**bc, "world_size": 3}, {"trainer": 1, "rollout": 3})
    inproc = {"type": "inproc"}
    with pytest.raises(ConfigError, match="colocated"):
        _check(inproc, {"trainer": 1, "rollout": 1})
    assert _check(inproc, {"trainer+rollout": 1, "judge": 2}) == []
    with pytest.raises(ConfigError, match="count to 1"):
        _check(inproc, {"trainer+rollout": 2})
    # a relay serves the store transport only, and needs a scope of its own
    with pytest.raises(ConfigError, match="services.rollout.weights_from"):
        _check(bc, {"trainer": 1, "rollout": 1}, rollout={"weights_from": {"scope": "node1"}})
    with pytest.raises(ConfigError, match="leave weightsync out"):
        _check(inproc, {"trainer+rollout": 1, "weightsync": 1})
    with pytest.raises(ConfigError, match="relay needs its own scope"):
        _check({"type": "store", "scope": "main"}, {"trainer": 1, "weightsync": 1},
               weightsync={"relay": {"scope": "main"}})


@pytest.mark.slow
def test_loop_reads_weights_through_a_relay(tmp_path, loop_model_dir):
    """Engines configured with a relay's scope get every version from the weightsync relay (which
    read it once upstream), not from the trainer's scope: a config change only."""
    logs = _run_three_steps(tmp_path, loop_model_dir, "tr-relay",
                            {"trainer": 1, "rollout": 1, "judge": 1, "weightsync": 1},
                            rollout_extra={"weights_from": {"scope": "node1"}},
                            extra='[services.weightsync]\nrelay = { scope = "node1" }')
    for v in (0, 1, 2):
        assert f"relayed v{v} into scope node1" in logs["weightsync-0.log"]
        assert f"applied weights version {v} " in logs["rollout-0.log"]
