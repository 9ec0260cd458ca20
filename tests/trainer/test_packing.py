"""Packed sequences (services/lib/packing.py): the rows they pack into, and logprobs and gradients equal to the
right-padded path's and to each sequence's own unpadded forward, on a real tiny Llama."""

from __future__ import annotations

import pytest
import torch

from services.lib.model_io import sequence_logprobs
from services.lib.packing import (
    VARLEN_ATTENTION,
    pack_rows,
    packed_sequence_logprobs,
    sequence_spans,
    use_varlen_attention,
)
from services.tasks.tiny_model import build_char_tokenizer, build_tiny_model


@pytest.fixture(scope="module")
def tiny():
    tokenizer = build_char_tokenizer()
    return build_tiny_model(tokenizer, seed=0, hidden_size=32, num_layers=2)


def test_rows_are_first_fit_decreasing_and_never_wider_than_the_width():
    lengths = [5, 9, 3, 4, 2, 6]
    rows = pack_rows(lengths, 9)
    assert rows == [[1], [5, 2], [0, 3], [4]]
    assert sorted(i for r in rows for i in r) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in r) <= 9 for r in rows)
    assert pack_rows([12, 3], 10) == [[0], [1]]  # longer than the width: a row of its own
    assert pack_rows([], 4) == []
    with pytest.raises(ValueError, match="width must be >= 1"):
        pack_rows([1], 0)


def solo_logprobs(model, prompt, completion, temperature):
    """log p(completion[j] | prompt + completion[:j]) from the sequence's own unpadded forward."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0].float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return [logp[len(prompt) + j - 1, tok].item() for j, tok in enumerate(completion)]


PROMPTS = [[1, 9, 10, 6], [1, 11, 6, 12, 13, 18], [1], [1, 5, 6], [1, 7]]
COMPLETIONS = [[9, 10, 2], [14], [15, 16, 17, 2, 5, 6, 7, 8, 9, 10, 11], [12, 13], []]
MASKS = [[1, 0, 1], [1], [1] * 11, [0, 1], []]


def test_packed_logprobs_equal_each_sequence_alone(tiny):
    with torch.no_grad():
        lp, mask = packed_sequence_logprobs(tiny, PROMPTS, COMPLETIONS, completion_masks=MASKS, temperature=0.7)
    assert len(pack_rows([len(p) + len(c) for p, c in zip(PROMPTS, COMPLETIONS, strict=True)], 12)) < len(PROMPTS)
    assert lp.shape == mask.shape == (5, 11)
    assert mask[0].tolist()[:4] == [1, 0, 1, 0] and mask[4].sum() == 0
    for i, (p, c) in enumerate(zip(PROMPTS, COMPLETIONS, strict=True)):
        want = solo_logprobs(tiny, p, c, 0.7)
        got = [v if m else want[j] for j, (v, m) in enumerate(zip(lp[i, : len(c)].tolist(), mask[i].tolist(), strict=False))]
        assert got == pytest.approx(want, abs=1e-5)  # no token attended across a sequence boundary
        assert lp[i, len(c) :].abs().sum().item() == 0.0


def test_packed_values_and_gradients_equal_the_padded_path(tiny):
    weights = torch.arange(1, 12, dtype=torch.float32)

    def grads(fn):
        tiny.zero_grad(set_to_none=True)
        lp, mask = fn(tiny, PROMPTS, COMPLETIONS, completion_masks=MASKS, temperature=0.9, pad_token_id=0)
        (lp * weights).sum().backward()
        return lp.detach(), mask, {n: p.grad.clone() for n, p in tiny.named_parameters()}

    padded, padded_mask, padded_grads = grads(sequence_logprobs)
    packed, packed_mask, packed_grads = grads(packed_sequence_logprobs)
    tiny.zero_grad(set_to_none=True)
    assert torch.equal(padded_mask, packed_mask)
    assert torch.allclose(padded, packed, atol=1e-5)
    assert padded_grads.keys() == packed_grads.keys()
    for name, g in padded_grads.items():
        assert torch.allclose(g, packed_grads[name], atol=1e-5), name


def test_bad_input_is_refused_with_the_problem(tiny):
    with pytest.raises(ValueError, match="at least one token"):
        packed_sequence_logprobs(tiny, [[]], [[1]])
    with pytest.raises(ValueError, match="2 prompts but 1 completions"):
        packed_sequence_logprobs(tiny, [[1], [1]], [[2]])
    with pytest.raises(ValueError, match="completion_masks\\[0\\] has 1 entries for 2 tokens"):
        packed_sequence_logprobs(tiny, [[1]], [[2, 3]], completion_masks=[[1]])
    with pytest.raises(ValueError, match="temperature"):
        packed_sequence_logprobs(tiny, [[1]], [[2]], temperature=0)
    lp, mask = packed_sequence_logprobs(tiny, [[1], [1, 2]], [[], []])
    assert lp.shape == mask.shape == (2, 0)


def test_a_transformers_whose_heads_refuse_a_boolean_keep_gets_every_logit_then_the_kept_ones(tiny, monkeypatch):
    # transformers 5.19 (the one vLLM pins; the trainer runs in vLLM's environment on one-GPU runs) slices hidden
    # states with logits_to_keep and fails on a boolean mask: the pass computes every logit and keeps the same ones.
    # A patched head stands in for 5.19's here because this environment has 5.24 (two transformers cannot share
    # one environment); the real 5.19 head runs in .venv-vllm, whose lane trains through it (tests/vllm)
    from services.lib import packing

    with torch.no_grad():
        want, _ = packed_sequence_logprobs(tiny, PROMPTS, COMPLETIONS, completion_masks=MASKS)
    real_forward = type(tiny).forward

    def old_head(self, *args, logits_to_keep=0, **kwargs):
        if isinstance(logits_to_keep, torch.Tensor):
            raise IndexError("too many indices for tensor of dimension 3")
        return real_forward(self, *args, logits_to_keep=logits_to_keep, **kwargs)

    monkeypatch.setattr(type(tiny), "forward", old_head)
    monkeypatch.setattr(packing, "_BOOLEAN_KEEP", None)
    with torch.no_grad():
        got, _ = packed_sequence_logprobs(tiny, PROMPTS, COMPLETIONS, completion_masks=MASKS)
    assert packing._BOOLEAN_KEEP is False
    assert torch.allclose(got, want, atol=1e-6)


def test_sequence_spans_start_where_positions_restart():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5], [5, 6, 0, 1, 1, 2]])
    assert sequence_spans(pos) == [[(0, 3), (3, 5), (5, 6)], [(0, 6)], [(0, 2), (2, 4), (4, 6)]]
    assert sequence_spans(torch.zeros((2, 0), dtype=torch.long)) == [[], []]
    with pytest.raises(ValueError, match="rows, width"):
        sequence_spans(torch.arange(4))


@pytest.fixture
def varlen_pair():
    """Two copies of one tiny model (grouped-query attention: 4 query heads over 2 key/value heads): transformers'
    ``sdpa`` (a block-diagonal mask over each packed row) and attention per packed sequence."""
    tokenizer = build_char_tokenizer()
    mask_model = build_tiny_model(tokenizer, seed=3, hidden_size=32, num_layers=2, num_kv_heads=2)
    varlen_model = build_tiny_model(tokenizer, seed=3, hidden_size=32, num_layers=2, num_kv_heads=2)
    assert mask_model.config._attn_implementation == "sdpa"
    assert use_varlen_attention(varlen_model) and varlen_model.config._attn_implementation == VARLEN_ATTENTION
    return mask_model, varlen_model


def run_with_grads(model, fn, **kw):
    model.zero_grad(set_to_none=True)
    lp, mask = fn(model, PROMPTS, COMPLETIONS, completion_masks=MASKS, temperature=0.9, pad_token_id=0, **kw)
    (lp * torch.arange(1, 12, dtype=torch.float32)).sum().backward()
    return lp.detach(), mask, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_a_call_per_sequence_is_chosen_where_the_scores_it_saves_outweigh_its_calls(monkeypatch):
    from services.lib import packing

    # the measured default: SmolLM2's long-tail rows (4 x 616, 3 sequences of ~205 and a 1-token tail each, 9
    # heads x 64) save (4 x 616^2 - 4 x (3 x 205^2 + 1) / 2) x 576 = 729 M units for 15 extra calls (90 M): per
    # sequence. The tiny model's addition rows (128 x 16, a 14-token sequence and a 2-token tail each, 4 x 32)
    # save 2.6 M units for 255 extra calls: one masked call
    assert packing.per_sequence_pays([[(0, 205), (205, 410), (410, 615), (615, 616)]] * 4, 616, 576)
    assert not packing.per_sequence_pays([[(0, 14), (14, 16)]] * 128, 16, 128)
    monkeypatch.setattr(packing, "CALL_COST_UNITS", 1000.0)
    # one row of 8 holding 2 sequences of 4: 64 scores masked, (16 + 16) / 2 = 16 per sequence, 1 extra call
    assert packing.per_sequence_pays([[(0, 4), (4, 8)]], 8, 100)  # 48 x 100 = 4800 > 1000
    assert not packing.per_sequence_pays([[(0, 4), (4, 8)]], 8, 10)  # 480 < 1000
    assert packing.per_sequence_pays([[(0, 8)]], 8, 1)  # one sequence a row: the causal kernel, no extra call


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("call_cost", [0.0, 1e18], ids=["per-sequence", "one-masked-call"])
def test_attention_per_packed_sequence_gives_the_masked_paths_values_and_gradients(varlen_pair, monkeypatch,
                                                                                    checkpointing, call_cost):
    from services.lib import packing

    monkeypatch.setattr(packing, "CALL_COST_UNITS", call_cost)
    mask_model, varlen_model = varlen_pair
    if checkpointing:  # the backward recomputes each layer: it must take the same attention again
        for m in varlen_pair:
            m.train()
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    want, want_mask, want_grads = run_with_grads(mask_model, packed_sequence_logprobs)
    # not a mock: the spy records each call's shape and passes it to the real kernel, whose results are compared
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, *a, **kw):
        calls.append((q.shape[0], q.shape[2], kw.get("attn_mask") is None and kw.get("is_causal")))
        return real(q, *a, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    got, got_mask, got_grads = run_with_grads(varlen_model, packed_sequence_logprobs)
    monkeypatch.undo()
    lengths = [len(p) + len(c) for p, c in zip(PROMPTS, COMPLETIONS, strict=True)]
    rows = pack_rows(lengths, max(lengths))
    passes = 2 * (2 if checkpointing else 1)  # 2 layers, each again in the backward when checkpointed
    if call_cost == 0.0:  # a causal, unmasked call per packed sequence (and per row tail)
        per_pass = sum(len(r) + (sum(lengths[i] for i in r) < max(lengths)) for r in rows)
        assert len(calls) == passes * per_pass
        assert all(b == 1 and (causal or n == 1) for b, n, causal in calls) and max(n for _, n, _ in calls) == 12
    else:  # one masked call on all the rows
        assert calls == [(len(rows), max(lengths), False)] * passes
    assert torch.equal(got_mask, want_mask) and torch.allclose(got, want, atol=1e-5)
    for name, g in want_grads.items():
        assert torch.allclose(g, got_grads[name], atol=1e-5), name


def test_padded_batches_keep_transformers_sdpa_and_its_mask(varlen_pair):
    mask_model, varlen_model = varlen_pair
    want, _, want_grads = run_with_grads(mask_model, sequence_logprobs)
    got, _, got_grads = run_with_grads(varlen_model, sequence_logprobs)
    assert torch.allclose(got, want, atol=1e-5)
    for name, g in want_grads.items():
        assert torch.allclose(g, got_grads[name], atol=1e-5), name
    with torch.no_grad():  # left padding: a mask the causal rule alone cannot stand for
        ids = torch.tensor([[0, 0, 5, 6, 7], [4, 5, 6, 7, 8]])
        attn = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
        a = mask_model(input_ids=ids, attention_mask=attn).logits
        b = varlen_model(input_ids=ids, attention_mask=attn).logits
    assert torch.allclose(a[:, 2:], b[:, 2:], atol=1e-5)


def test_a_saved_model_does_not_carry_the_attention_setting(varlen_pair, tmp_path):
    """Checkpoints and the final model load anywhere (vLLM, transformers elsewhere): the learner's own attention
    function is not written into config.json."""
    _, varlen_model = varlen_pair
    varlen_model.save_pretrained(tmp_path)
    saved = (tmp_path / "config.json").read_text()
    assert VARLEN_ATTENTION not in saved and "attn_implementation" not in saved


def test_the_spans_are_found_once_a_pass_not_once_a_layer(varlen_pair, monkeypatch):
    from services.lib import packing

    monkeypatch.setattr(packing, "CALL_COST_UNITS", 0.0)
    found = []
    real = packing.sequence_spans

    def counting(position_ids):  # not a mock: counts, then finds the spans with the real function
        found.append(position_ids.shape)
        return real(position_ids)

    monkeypatch.setattr(packing, "sequence_spans", counting)
    _, varlen_model = varlen_pair
    assert varlen_model.config.num_hidden_layers == 2
    run_with_grads(varlen_model, packed_sequence_logprobs)
    assert len(found) == 1  # two layers, one pass: the second layer reused the first one's spans
    position_ids = torch.tensor([[0, 1, 2, 0, 1]])
    assert packing._spans_of_this_pass(position_ids) == [[(0, 3), (3, 5)]]
    position_ids[0, 3:] = torch.tensor([3, 4])  # changed in place: found again, not the stale spans
    assert packing._spans_of_this_pass(position_ids) == [[(0, 5)]]
    assert len(found) == 3
    with torch.inference_mode():  # no version counter to key on: found each time, never a stale answer
        frozen = torch.tensor([[0, 1, 0]])
        assert packing._spans_of_this_pass(frozen) == packing._spans_of_this_pass(frozen) == [[(0, 2), (2, 3)]]
    assert len(found) == 5
