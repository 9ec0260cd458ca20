"""The trainer's rank operations are a table: rank 0 sends an operation's name, a rank runs the function the
table gives for it, and a name that is not in the table stops it with an error (never an attribute lookup)."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from services.trainer import rank_ops
from services.trainer.config import TrainerConfig
from services.trainer.rank_ops import OPS, Op, UnknownRankOp
from services.trainer.ranks import RankGroup

REPO = Path(__file__).resolve().parents[2]


def test_every_operation_has_a_function_and_other_names_are_errors():
    assert set(OPS) == set(Op)
    assert rank_ops.lookup("write_checkpoint") is OPS[Op.WRITE_CHECKPOINT]
    # what ranks used to run by attribute name, and names every object has, are not operations
    for name in ("full_state_dict", "step_input", "__init__", "cfg", ""):
        with pytest.raises(UnknownRankOp, match=rf"no trainer rank operation {name!r} \(the operations: step, "):
            rank_ops.lookup(name)


def test_a_rank_told_to_run_a_name_not_in_the_table_stops_with_an_error(tmp_path, loop_model_dir):
    """A real rank process, initialised by rank 0's own command, then sent a name that is not an operation
    (what rank 0 sent before operations were a table)."""
    log = tmp_path / "rank-1.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "services.trainer.ranks", "--rank", "1"], cwd=REPO,
                                stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT)
    group = RankGroup(TrainerConfig(), tmp_path)  # one rank's config: the rank joins no process group
    group.procs[1] = proc
    group.init(loop_model_dir)
    assert proc.stdin is not None
    proc.stdin.write(pickle.dumps(("load_full_weights", ({},)), protocol=pickle.HIGHEST_PROTOCOL))
    proc.stdin.close()
    assert proc.wait(timeout=120) != 0
    text = log.read_text()
    assert "ready" in text and "UnknownRankOp: no trainer rank operation 'load_full_weights'" in text, text[-3000:]


def test_rank_0_sends_only_operations_of_the_table(tmp_path):
    group = RankGroup(TrainerConfig(), tmp_path)  # no rank started: nothing to send to
    with pytest.raises(UnknownRankOp, match="'save_hf_local'"):
        group.send("save_hf_local", str(tmp_path))  # type: ignore[arg-type]
    group.send(Op.SAVE_HF, str(tmp_path))  # an operation: written to every rank (none here)
