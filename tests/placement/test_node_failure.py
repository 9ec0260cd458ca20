"""A rank group over two nodes fails as one, with real processes: node 1's agent killed -> node 0's group
fails at once, naming the node; node 0 gone -> node 1's agent stops its ranks and exits non-zero."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from services.runtime.natsd import free_port, port_is_free
from services.trainer.config import TrainerConfig
from services.trainer.ranks import RankGroup, rank_pid
from tests.conftest import wait_for

REPO = Path(__file__).resolve().parents[2]


def config(port: int) -> TrainerConfig:
    return msgspec.convert({"devices": {"device": "cpu", "world_size": 2, "nnodes": 2, "master_addr": "127.0.0.1",
                                        "master_port": port, "rank_timeout_s": 60}}, TrainerConfig)


def start_agent(cfg: TrainerConfig, run_dir: Path) -> subprocess.Popen[bytes]:
    devices = msgspec.json.encode(msgspec.structs.replace(cfg.devices, node_rank=1)).decode()
    code = ("import sys, msgspec; from pathlib import Path; from services.trainer.config import DevicesConfig; "
            "from services.trainer.nodes import node_agent; "
            f"sys.exit(node_agent(msgspec.json.decode({devices!r}, type=DevicesConfig), Path({str(run_dir)!r})))")
    return subprocess.Popen([sys.executable, "-c", code], cwd=REPO)


def port_pair() -> int:
    while True:
        port = free_port()
        if port < 65534 and port_is_free(port + 1):
            return port


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


@pytest.mark.parametrize("who", ["node 1's agent", "node 0"])
def test_a_lost_node_fails_the_whole_group(tmp_path, who):
    cfg = config(port_pair())
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    agent = start_agent(cfg, node1)

    async def main() -> tuple[str, int | None]:
        group = RankGroup.start(cfg, node0)  # one rank per node: no local ranks here
        try:
            await asyncio.to_thread(group._join_nodes)
            rank1 = wait_for(lambda: rank_pid(node1, 1), 60, "node 1's rank started")
            if who == "node 0":
                group._fail("node 0 stops (as if it died)")  # closes its link to node 1
                return group.reason, agent.wait(60)
            agent.send_signal(signal.SIGKILL)
            await asyncio.wait_for(group.failed.wait(), 60)
            wait_for(lambda: not alive(rank1), 60, "node 1's rank stopped with its agent")  # PR_SET_PDEATHSIG
            return group.reason, None
        finally:
            group.closing = True

    try:
        reason, code = asyncio.run(main())
    finally:
        agent.kill()
        agent.wait()
    if who == "node 0":
        assert code == 1  # the agent saw node 0 go and stopped, non-zero (its launcher restarts it)
        assert not alive(rank_pid(node1, 1) or 0)
    else:
        assert "trainer rank 1" in reason and "node 1" in reason and "exited with code 1" in reason
