"""A trainer rank group over two "nodes" on this machine: two launchers (``rlbus run``), one per node, each
starting its node's trainer with ``node_rank`` 0 or 1 of ``nnodes = 2``, rendezvous on 127.0.0.1 (gloo).
Node 0's rank 0 drives the loop and talks to the bus; node 1's trainer is the node's agent, which starts
rank 1 and relays node 0's commands to it. The two form one FSDP2 group: the run finishes, its checkpoint
holds a shard per rank, and rank 1 lived under node 1's launcher."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from services.runtime.natsd import free_port, port_is_free
from tests.conftest import run_file, wait_for

pytestmark = pytest.mark.slow


def two_free_ports() -> int:
    """A port P with P + 1 free too (the rendezvous and node 0's command port)."""
    while True:
        port = free_port()
        if port < 65534 and port_is_free(port + 1):
            return port


def test_two_launchers_form_one_rank_group(tmp_path, loop_model_dir):
    port, nats_port = two_free_ports(), free_port()
    devices = {"device": "cpu", "world_size": 2, "nnodes": 2, "master_addr": "127.0.0.1", "master_port": port,
               "rank_timeout_s": 300}
    trainer = {"groups_per_step": 2, "total_steps": 2, "max_staleness": 1, "checkpoint_every": 2}
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    node0.mkdir()
    node1.mkdir()
    cfg0 = run_file(node0, loop_model_dir, run_id="nodes2", services={"trainer": 1, "rollout": 1, "judge": 1},
                    launcher={"auth": False, "nats_port": nats_port},
                    trainer={**trainer, "devices": {**devices, "node_rank": 0}}, rollout={"max_tickets": 8})
    # node 1: only its part of the trainer, on node 0's bus
    cfg1 = run_file(node1, loop_model_dir, run_id="nodes2", services={"trainer": 1},
                    nats_url=f"nats://127.0.0.1:{nats_port}", launcher={"embedded_nats": False, "auth": False},
                    trainer={**trainer, "devices": {**devices, "node_rank": 1}})
    cli = [sys.executable, "-m", "services.launcher.cli", "run"]
    p0 = subprocess.Popen([*cli, str(cfg0)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # node 1 once node 0's bus is up (node 1 may start first too: its agent retries node 0's port)
        wait_for(lambda: not port_is_free(nats_port) or p0.poll() is not None, 120, "node 0's NATS")
        p1 = subprocess.Popen([*cli, str(cfg1)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            _, err0 = p0.communicate(timeout=600)
            _, err1 = p1.communicate(timeout=120)
        finally:
            p1.kill()
    finally:
        p0.kill()
    ranks0, ranks1 = node0 / "run" / "ranks", node1 / "run" / "ranks"
    rank_log = (ranks1 / "rank-1.log").read_text() if (ranks1 / "rank-1.log").exists() else ""
    node1_log = (node1 / "run" / "logs" / "trainer-0.log").read_text()
    assert p0.returncode == 0, err0[-3000:] + node1_log[-2000:] + rank_log[-2000:]
    assert "run finished at step 2" in err0
    assert p1.returncode == 0, err1[-3000:] + node1_log[-2000:]
    # rank 1 was node 1's: started by node 1's trainer (the node agent), trained with rank 0, stopped cleanly
    assert "trainer node 1: ranks [1]" in node1_log
    assert "rank 1 of 2 ready on cpu" in rank_log and "rank 1 stopped" in rank_log
    assert not (ranks0 / "rank-1.pid").exists() and (ranks0 / "rank-0.pid").exists()
    summary = json.loads((node0 / "run" / "summary.json").read_text())
    assert summary["step"] == 2 and summary["version"] == 2
    ckpt = node0 / "run" / "checkpoints" / (node0 / "run" / "checkpoints" / "latest").read_text().strip()
    assert sorted(p.name for p in (Path(ckpt) / "dcp").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
