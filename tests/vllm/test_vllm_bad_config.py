"""A bad vLLM engine key in a run file stops `rlbus run` at start-up with the key named, non-zero, and
promptly: the launcher checks the whole typed run file before it starts anything, so no service is started
(nor restarted) on a file that cannot work."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import run_file

pytestmark = pytest.mark.slow


def test_a_misspelt_vllm_engine_key_stops_the_run_naming_it(tmp_path, loop_model_dir):
    cfg = run_file(tmp_path, loop_model_dir, run_id="badvllm", services={"trainer": 1, "rollout": 1, "judge": 1},
                   trainer={"groups_per_step": 2, "total_steps": 2},
                   rollout={"engine": {"type": "vllm", "max_num_seq": 4}})  # the key is max_num_seqs
    r = subprocess.run([sys.executable, "-m", "services.launcher.cli", "run", str(cfg)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "configuration error: config key services.rollout.engine.max_num_seq: unknown key" in r.stderr, \
        r.stderr[-3000:]
    assert "started " not in r.stderr and not (tmp_path / "run" / "logs").exists(), r.stderr[-3000:]
