"""The benches' offline evaluation with vLLM generating (``bench/_offline_eval.py``, ``--eval-engine vllm``):
on the project's tiny Llama, near-greedy, it gives transformers' ``generate`` figure on the same prompts; a
directory that is no model fails with vLLM's words and the directory's name, not a hang or a zero reward."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench._offline_eval import evaluate_versions, run_task, vllm_held_out_reward
from bench._rlbus_runs import BenchRunError, example_model_dir, example_run_file

REPO = Path(__file__).resolve().parents[2]


def near_greedy_run_file():
    """The addition example evaluated at a temperature so low that sampling is the argmax in both engines."""
    return example_run_file(REPO / "examples" / "addition.toml",
                            ["services.trainer.eval.temperature=0.0001", "services.trainer.eval.samples=1"])


def test_vllm_gives_the_figure_of_hf_generate_on_the_same_prompts():
    runfile = near_greedy_run_file()
    # the example's own warmed-up model (the loop tests' shorter warm-up gets every answer wrong: no figure to
    # compare); built once into the rlbus model cache, offline
    versions = {0: example_model_dir(runfile, 0)}
    hf = evaluate_versions(runfile, versions, eval_prompts=40, threads=2, seed=0, engine="hf")[0]
    vllm = evaluate_versions(runfile, versions, eval_prompts=40, threads=2, seed=0, engine="vllm")[0]
    assert 0.0 < hf < 1.0, hf  # the warmed-up tiny model gets some right, not all: the figure can differ
    # bf16 in vLLM against float32 in transformers: a near-tie may flip one answer of 40, not more
    assert abs(vllm - hf) <= 1 / 40 + 1e-9, (hf, vllm)


def test_a_repeated_request_gives_the_same_reward_so_it_is_made_once(loop_model_dir, monkeypatch):
    """Every side of a bench evaluates the initial model: prompt i seeded seed + i makes vLLM's answer the same
    each time (checked here at a temperature that samples), so the bench asks once."""
    from bench import _offline_eval

    runfile = example_run_file(REPO / "examples" / "addition.toml", ["services.trainer.eval.temperature=1.0",
                                                                     "services.trainer.eval.samples=2"])
    versions = {0: Path(loop_model_dir)}
    first = evaluate_versions(runfile, versions, eval_prompts=30, threads=2, seed=5, engine="vllm")[0]
    monkeypatch.setattr(_offline_eval, "_VLLM_SEEN", {})  # forget it: vLLM generates again
    assert evaluate_versions(runfile, versions, eval_prompts=30, threads=2, seed=5, engine="vllm")[0] == first
    started = []
    real_run = _offline_eval.subprocess.run

    def counting_run(*a, **kw):  # not a mock: counts the processes started, then starts them for real
        started.append(a)
        return real_run(*a, **kw)

    monkeypatch.setattr(_offline_eval.subprocess, "run", counting_run)
    assert evaluate_versions(runfile, versions, eval_prompts=30, threads=2, seed=5, engine="vllm")[0] == first
    assert started == []  # answered from the first request, no vLLM started


def test_a_directory_that_is_no_model_fails_naming_it(tmp_path, loop_model_dir):
    from transformers import AutoTokenizer

    runfile = near_greedy_run_file()
    task = run_task(runfile)
    tokenizer = AutoTokenizer.from_pretrained(loop_model_dir)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(BenchRunError, match=str(tmp_path)):
        vllm_held_out_reward(tmp_path, tokenizer, task, task.eval_prompts()[:2], runfile.services.trainer, seed=0)
