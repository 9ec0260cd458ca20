"""A LoRA run of the real services learns, and only adapters travel.

``rlbus run`` (trainer, rollout with the torch engine, judge: separate processes on one embedded NATS) trains
the tiny model on 2-digit addition with ``lora = { r = 8, alpha = 16 }``. The model is warm-started to
about 28 % (300 supervised steps, built once here: ~1 min); 60 GRPO steps lift the held-out reward
(200 prompts x 2 samples, about ±0.03 of sampling noise) by well over 0.05. The run's own JetStream then
shows every stored weight version holding only adapter tensors, at a small fraction of the model's bytes;
``rlbus replay`` recomputes one of its steps bit-identically; and the run leaves the final model merged and
as a peft adapter directory.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import nats
import pytest

from services.lib.weights.index import VersionIndex
from services.lib.weights.lora_merge import ADAPTER_KEY
from services.runtime.natsd import EmbeddedNats
from tests.conftest import run_file

pytestmark = pytest.mark.slow

RUN = "lorarun"


@pytest.fixture(scope="module")
def warm_model_dir(tmp_path_factory):
    from services.tasks.tiny_model import DEFAULT_WARMUP_STEPS, ensure_tiny_model

    return ensure_tiny_model(tmp_path_factory.mktemp("lora-run-model"), seed=0, warmup_steps=DEFAULT_WARMUP_STEPS)


async def _stored_manifests(run_dir):
    with EmbeddedNats(run_dir / "nats", port=None) as server:
        nc = await nats.connect(server.url)
        try:
            index = VersionIndex(nc, RUN)
            return [m for m in [await index.manifest(v) for v in await index.versions()] if m is not None]
        finally:
            await nc.close()


def test_a_lora_run_learns_and_sends_only_adapters(tmp_path, warm_model_dir):
    run_dir = tmp_path / "run"
    cfg = run_file(tmp_path, warm_model_dir, run_id=RUN, services={"trainer": 1, "rollout": 1, "judge": 1},
                   trainer={"groups_per_step": 16, "group_size": 8, "total_steps": 60, "max_staleness": 1,
                            "lora": {"r": 8, "alpha": 16.0},
                            "optim": {"lr": 1e-3},
                            "eval": {"prompts": 200, "samples": 2}},
                   rollout={"max_tickets": 32}, weights={"type": "store", "encoding": {"anchor_every": 10}})
    r = subprocess.run([sys.executable, "-m", "services.launcher.cli", "run", str(cfg)], capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]

    # it learns: the training reward of the last 10 steps is well above the first 10 (each a mean over 1,280
    # sampled completions), and the held-out reward (200 prompts x 2 samples, a noisier figure) did not fall
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [(m["step"], m["eval/reward"]) for m in metrics if "eval/reward" in m]
    assert [s for s, _ in evals] == [0, 60]
    train = [m["train/reward_mean"] for m in metrics if "train/reward_mean" in m]
    assert len(train) == 60
    first, last = sum(train[:10]) / 10, sum(train[-10:]) / 10
    assert last > first + 0.05, (first, last, evals)
    assert evals[-1][1] > evals[0][1], evals

    # only adapters travelled: every stored version (anchors and deltas) names adapter tensors only
    manifests = asyncio.run(_stored_manifests(run_dir))
    assert {m.kind for m in manifests} == {"full", "delta"}
    model_bytes = (warm_model_dir / "model.safetensors").stat().st_size
    for m in manifests:
        names = {t.name for t in m.tensors}
        assert ADAPTER_KEY in names and all(n == ADAPTER_KEY or n.endswith((".lora_A", ".lora_B")) for n in names)
        assert m.full_nbytes < 0.1 * model_bytes

    # a step of the LoRA run recomputes bit-identically from the run directory (the adapter version it started
    # from, loaded onto the base model)
    from services.launcher.replay import replay_step

    replayed = replay_step(run_dir, 30)
    assert replayed.identical, replayed.report()

    # the final model, merged (a plain Hugging Face directory) and as an adapter directory
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["step"] == 60 and summary["final_adapter"] == str(run_dir / "final_adapter")
    merged = AutoModelForCausalLM.from_pretrained(run_dir / "final_model", local_files_only=True)
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(warm_model_dir), run_dir / "final_adapter")
    import torch

    ids = torch.tensor([[1, 5, 9, 3, 4]])
    with torch.no_grad():
        assert torch.allclose(merged(input_ids=ids).logits, adapted(input_ids=ids).logits, atol=1e-5)
