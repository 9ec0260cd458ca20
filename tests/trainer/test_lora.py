"""LoRA through peft on the tiny model: exact start, only adapters train, merged and adapter forms agree."""

from __future__ import annotations

import itertools

import pytest

peft = pytest.importorskip("peft")  # the 'lora' extra

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from services.tasks.addition import AdditionTask  # noqa: E402
from services.tasks.tiny_model import ensure_tiny_model, warmup_batch  # noqa: E402
from services.trainer.lora import (  # noqa: E402
    LoraConfig,
    LoraError,
    adapter_state,
    apply_lora,
    merged_state,
    save_adapter,
    save_merged,
)


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread: a 1 M-parameter model gains nothing from two on a loaded 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return ensure_tiny_model(tmp_path_factory.mktemp("lora-model"), seed=0, warmup_steps=5)


def batch(tokenizer, n=32):
    task = AdditionTask()
    input_ids, labels = warmup_batch(task, tokenizer, list(itertools.islice(task.train_prompts(seed=5), n)))
    return input_ids, labels, (input_ids != tokenizer.pad_token_id).long()


def test_lora_learns_and_its_two_saved_forms_agree(model_dir, tmp_path):
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    input_ids, labels, mask = batch(tokenizer)
    with torch.no_grad():
        before = base(input_ids=input_ids, attention_mask=mask).logits
    model = apply_lora(base, LoraConfig(r=4, alpha=8.0))
    with torch.no_grad():  # B starts at zero: the wrapped model is the base model
        assert torch.equal(model(input_ids=input_ids, attention_mask=mask).logits, before)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    total = sum(p.numel() for p in model.parameters())
    adapters = adapter_state(model)
    assert sum(t.numel() for t in adapters.values()) < 0.2 * total

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(20):
        loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0], losses

    model.eval()
    with torch.no_grad():
        after = model(input_ids=input_ids, attention_mask=mask).logits
    # the merged state dict (base names) in a plain model computes what the adapted model does
    plain = AutoModelForCausalLM.from_pretrained(model_dir)
    plain.load_state_dict(merged_state(model))
    with torch.no_grad():
        assert torch.allclose(plain(input_ids=input_ids, attention_mask=mask).logits, after, atol=1e-4)
    # ... and merging left the adapted model as it was
    with torch.no_grad():
        assert torch.allclose(model(input_ids=input_ids, attention_mask=mask).logits, after, atol=1e-5)

    save_merged(model, tokenizer, tmp_path / "merged")
    save_adapter(model, tmp_path / "adapter")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", local_files_only=True)
    reloaded = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), tmp_path / "adapter")
    with torch.no_grad():
        assert torch.allclose(merged(input_ids=input_ids, attention_mask=mask).logits, after, atol=1e-4)
        assert torch.allclose(reloaded(input_ids=input_ids, attention_mask=mask).logits, after, atol=1e-5)


def test_targets_that_match_nothing_are_named(model_dir):
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    with pytest.raises(LoraError, match="match no linear layer .*q_proj"):
        apply_lora(base, LoraConfig(target_modules=["query_key_value"]))
