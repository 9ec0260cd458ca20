"""Model I/O: save/load round trip and per-token logprobs against a plain per-sequence forward."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.lib.model_io import ModelIOError, load_policy, save_policy, sequence_logprobs, token_logprobs
from services.tasks.tiny_model import build_char_tokenizer, build_tiny_model


@pytest.fixture(scope="module")
def tiny():
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, seed=0, hidden_size=32, num_layers=2)
    model.eval()
    return model, tokenizer


def reference_logprobs(model, prompt, completion, temperature=1.0):
    """log p(completion[j] | prompt + completion[:j]) from one unpadded forward pass."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return [logp[len(prompt) + j - 1, tok].item() for j, tok in enumerate(completion)]


def test_logprobs_match_per_sequence_forward(tiny):
    model, _ = tiny
    prompts = [[1, 9, 10, 6], [1, 11, 6, 12, 13, 18], [1, 8]]  # different prompt lengths
    completions = [[9, 10, 2], [14], [15, 16, 17, 2]]  # different completion lengths
    with torch.no_grad():
        logprobs, mask = sequence_logprobs(model, prompts, completions, pad_token_id=0, temperature=0.7)
    assert logprobs.shape == (3, 4) and mask.shape == (3, 4)
    assert mask.tolist() == [[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]]
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        expected = reference_logprobs(model, p, c, temperature=0.7)
        assert logprobs[i, : len(c)].tolist() == pytest.approx(expected, abs=1e-4)
        assert logprobs[i, len(c) :].abs().sum().item() == 0.0


def test_completion_masks_and_gradients(tiny):
    model, _ = tiny
    logprobs, mask = sequence_logprobs(
        model, [[1, 9], [1, 10]], [[11, 12, 2], [13]], completion_masks=[[1, 0, 1], [1]]
    )
    assert mask.tolist() == [[1, 0, 1], [1, 0, 0]]
    (logprobs * mask).sum().backward()
    assert model.model.embed_tokens.weight.grad is not None
    model.zero_grad(set_to_none=True)


def test_empty_prompt_is_refused(tiny):
    model, _ = tiny
    with pytest.raises(ValueError, match="at least one token"):
        sequence_logprobs(model, [[]], [[1]])


def test_save_and_reload_round_trip(tiny, tmp_path, monkeypatch):
    model, tokenizer = tiny
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = save_policy(model, tokenizer, tmp_path / "policy")
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]  # no staging left behind
    # Saving again replaces the directory in place.
    save_policy(model, tokenizer, out)
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    reloaded_tok = AutoTokenizer.from_pretrained(out)
    ids = torch.tensor([[1, 9, 10, 6, 11]])
    with torch.no_grad():
        assert torch.allclose(reloaded(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-6)
    assert reloaded_tok.padding_side == "left"
    assert reloaded_tok.encode("12+3", add_special_tokens=False) == tokenizer.encode(
        "12+3", add_special_tokens=False
    )

    bf16, _ = load_policy(out, dtype="bfloat16")
    assert next(bf16.parameters()).dtype == torch.bfloat16
    with torch.no_grad():
        lp, _ = sequence_logprobs(bf16, [[1, 9]], [[10, 2]])
    assert lp.dtype == torch.float32


def test_load_refuses_a_non_model_dir(tmp_path):
    with pytest.raises(ModelIOError, match="config.json"):
        load_policy(tmp_path)


def plain_token_logprobs(logits, rows, targets, temperature):
    """The unchunked expression :func:`token_logprobs` replaces (full-vocabulary float32 copies)."""
    x = logits.float() / temperature
    picked = x.gather(1, rows.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
    return picked.gather(2, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(picked, dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1, 2, 3, 64])
def test_chunked_token_logprobs_equal_unchunked_values_and_gradients(dtype, chunk):
    gen = torch.Generator().manual_seed(chunk)
    logits = (torch.randn(3, 7, 50, generator=gen) * 3).to(dtype)
    rows = torch.tensor([[0, 1, 2, 3, 6], [2, 3, 4, 6, 6], [5, 6, 6, 6, 6]])  # repeats, like padding
    targets = torch.randint(0, 50, (3, 5), generator=gen)
    upstream = torch.randn(3, 5, generator=gen)
    a = logits.clone().requires_grad_(True)
    b = logits.clone().requires_grad_(True)
    got = token_logprobs(a, rows, targets, 0.7, chunk_positions=chunk)
    want = plain_token_logprobs(b, rows, targets, 0.7)
    assert got.dtype == torch.float32
    assert torch.allclose(got, want, atol=1e-5)
    (got * upstream).sum().backward()
    (want * upstream).sum().backward()
    assert a.grad.dtype == dtype
    # bf16: each path rounds its gradient to bf16 once per contribution (rows that repeat add up there)
    tol = {"atol": 1e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-3, "rtol": 2 ** -6}
    torch.testing.assert_close(a.grad.float(), b.grad.float(), **tol)
    assert a.grad[:, 6].abs().sum() > 0  # the repeated column got every position's share


def test_sequence_logprobs_chunked_gradients_equal_one_chunk(tiny):
    model, _ = tiny
    prompts, completions = [[1, 9, 10], [1, 11]], [[12, 13, 14, 2], [15, 2]]
    grads = []
    for chunk in (1, 1000):
        model.zero_grad(set_to_none=True)
        lp, mask = sequence_logprobs(model, prompts, completions, temperature=0.9, chunk_positions=chunk)
        (lp * mask).sum().backward()
        grads.append((lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    model.zero_grad(set_to_none=True)
    (lp1, g1), (lp2, g2) = grads
    assert torch.allclose(lp1, lp2, atol=1e-6)
    for name in g1:
        assert torch.allclose(g1[name], g2[name], atol=1e-6), name
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        assert lp1[i, : len(c)].tolist() == pytest.approx(reference_logprobs(model, p, c, 0.9), abs=1e-4)


def test_bad_chunk_is_refused(tiny):
    model, _ = tiny
    with pytest.raises(ValueError, match="chunk_positions"):
        sequence_logprobs(model, [[1]], [[2]], chunk_positions=0)
