"""The tiny model: tokenizer, build, cache, reload offline, determinism, warm-up learns."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.tasks.addition import AdditionTask
from services.tasks.evaluate import generate_completions
from services.tasks.tiny_model import (
    build_char_tokenizer,
    build_tiny_model,
    ensure_tiny_model,
    supervised_warmup,
    warmup_batch,
)
from tests.tasks.conftest import TEST_WARMUP_STEPS


def test_char_tokenizer_round_trip():
    tok = build_char_tokenizer()
    ids = tok.encode("12+34=46", add_special_tokens=False)
    assert len(ids) == 8
    assert tok.decode(ids) == "12+34=46"
    assert tok.padding_side == "left"
    assert len({tok.bos_token_id, tok.eos_token_id, tok.pad_token_id}) == 3


def test_default_size_is_about_one_million_parameters():
    model = build_tiny_model(build_char_tokenizer())
    assert 0.9e6 < sum(p.numel() for p in model.parameters()) < 1.2e6


def test_warmup_batch_masks_the_prompt():
    tok = build_char_tokenizer()
    task = AdditionTask()
    prompts = [p for p, _ in zip(task.train_prompts(seed=0), range(2), strict=False)]
    input_ids, labels = warmup_batch(task, tok, prompts)
    prompt_len = len(task.format_prompt(tok, prompts[0]))
    assert (labels[:, :prompt_len] == -100).all()
    answer = tok.decode([t for t in labels[0].tolist() if t >= 0])
    assert answer == prompts[0].answer + "<eos>"


def test_ensure_builds_once_and_reloads_offline(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    stamp = (tiny_model_dir / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model(tiny_model_dir.parent, seed=0, warmup_steps=TEST_WARMUP_STEPS) == tiny_model_dir
    assert (tiny_model_dir / "model.safetensors").stat().st_mtime_ns == stamp  # cached, not rebuilt
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    task = AdditionTask()
    prompt_ids = [task.format_prompt(tok, p) for p in task.eval_prompts()[:4]]
    torch.manual_seed(0)
    completions, logprobs = generate_completions(model, tok, prompt_ids, max_new_tokens=6)
    assert len(completions) == 4
    for ids, lps in zip(completions, logprobs, strict=True):
        assert 1 <= len(ids) <= 6 and len(lps) == len(ids)
        assert all(lp <= 0.0 for lp in lps)


def test_build_is_deterministic_and_warmup_learns():
    tok = build_char_tokenizer()
    task = AdditionTask()
    models = [build_tiny_model(tok, seed=5, hidden_size=32, num_layers=1) for _ in range(2)]
    losses = []
    for model in models:
        losses.append([])
        record = losses[-1]
        supervised_warmup(
            model,
            tok,
            task,
            steps=12,
            seed=5,
            batch_size=16,
            lr=3e-3,
            on_step=lambda _step, loss, record=record: record.append(loss),
        )
    assert losses[0] == losses[1]
    first, second = models[0].state_dict(), models[1].state_dict()
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert sum(losses[0][-3:]) / 3 < 0.9 * sum(losses[0][:3]) / 3


def test_generate_logprobs_agree_with_the_trainer_and_eval_scores(tiny_model_dir):
    from services.lib.model_io import load_policy, sequence_logprobs
    from services.tasks.evaluate import evaluate_task

    model, tok = load_policy(tiny_model_dir)
    task = AdditionTask(num_eval=16)
    prompt_ids = [task.format_prompt(tok, p) for p in task.eval_prompts()]
    torch.manual_seed(1)
    completions, behaviour = generate_completions(model, tok, prompt_ids, max_new_tokens=6, temperature=0.8)
    with torch.no_grad():
        logprobs, mask = sequence_logprobs(
            model, prompt_ids, completions, pad_token_id=tok.pad_token_id, temperature=0.8
        )
    for i, row in enumerate(behaviour):
        assert logprobs[i, : len(row)].tolist() == pytest.approx(row, abs=1e-4)
    assert mask.sum().item() == sum(len(c) for c in completions)
    reward = evaluate_task(model, tok, task, samples_per_prompt=2)
    assert 0.0 <= reward <= 1.0
