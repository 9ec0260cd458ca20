"""Colocated services load their models in threads of one process; transformers is not thread-safe
there (lazy imports race; ``from_pretrained`` switches a process-global default device to ``meta``).
Every load goes through ``services.runtime.loading.HF_LOAD_LOCK``: fresh processes that load the
trainer's policy and the rollout engine's model in two threads at once must all succeed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys, threading
from services.lib.engine.config import TorchEngineConfig
from services.lib.engine.torch_engine import TorchEngine
from services.lib.model_io import load_policy

model_dir = sys.argv[1]
errors = []
barrier = threading.Barrier(2)

def trainer():
    barrier.wait()
    try:
        model, _ = load_policy(model_dir, dtype="float32", device="cpu")
        assert not any(p.is_meta for p in model.parameters())
    except BaseException as e:
        errors.append(f"trainer: {type(e).__name__}: {e}")

def engine():
    barrier.wait()
    try:
        TorchEngine(TorchEngineConfig(num_threads=1), model_dir)._load()
    except BaseException as e:
        errors.append(f"engine: {type(e).__name__}: {e}")

threads = [threading.Thread(target=trainer), threading.Thread(target=engine)]
for t in threads: t.start()
for t in threads: t.join()
print("\\n".join(errors) or "ok")
sys.exit(1 if errors else 0)
"""


@pytest.mark.slow
def test_two_threads_load_models_at_once_in_fresh_processes(loop_model_dir):
    for _ in range(4):  # the import race needs a process that has not imported transformers yet
        r = subprocess.run([sys.executable, "-c", SCRIPT, str(loop_model_dir)], cwd=REPO, capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
