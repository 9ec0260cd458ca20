"""A reward module that raises while it is imported stops `rlbus run` once, as a configuration error naming
`task.options.reward` and the error, and the run exits non-zero (it used to crash-loop the trainer six
times with a bare traceback and exit 0). A real `rlbus run` subprocess, the module on PYTHONPATH."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import run_file

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(900)
def test_a_reward_module_raising_at_import_fails_the_run_once_naming_the_key(tmp_path, tiny_model_dir):
    site = tmp_path / "site"
    site.mkdir()
    (site / "raising_rewards_27.py").write_text("SCALE = 1 / 0  # a bug at import time\n\n"
                                                "def score(prompt, completion, **fields):\n    return 1.0\n")
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+1=", "answer": str(a + 1)}) + "\n" for a in range(20)))
    cfg = run_file(tmp_path, tiny_model_dir, run_id="badreward", services={"trainer": 1},
                   task="dataset", task_options={"path": str(data), "reward": "raising_rewards_27:score"},
                   trainer={"groups_per_step": 2, "total_steps": 2})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)])}
    r = subprocess.run([sys.executable, "-m", "services.launcher.cli", "run", str(cfg)], capture_output=True,
                       text=True, timeout=600, env=env, cwd=tmp_path)
    assert r.returncode == 1, (r.returncode, r.stderr[-3000:])
    err = r.stderr
    # said once, with the key, the module's error and where; the trainer was not restarted
    assert err.count("stopped on a configuration error, not restarting it") == 1, err[-3000:]
    assert ("task.options.reward: reward 'raising_rewards_27:score': importing module 'raising_rewards_27' "
            "raised ZeroDivisionError: division by zero (at ") in err, err[-3000:]
    assert "raising_rewards_27.py:1)" in err
    assert "restarting in" not in err and "crashed" not in err, err[-3000:]
    assert "run failed: trainer" in err
