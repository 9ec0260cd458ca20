"""Per-token logprobs of completions with the sequences *packed* into rows instead of padded.

:func:`~services.lib.model_io.sequence_logprobs` right-pads every ``prompt + completion`` to the longest one:
with heavy-tailed completion lengths (a few near the token limit, most short) most of what a pass computes is
padding. :func:`packed_sequence_logprobs` gives the same result from less work:

1. **Pack.** The sequences go first-fit-decreasing into rows as wide as the longest of them (:func:`pack_rows`),
   each sequence's ``position_ids`` restarting at 0. With no attention mask, transformers reads the restarts as
   packed sequences and builds a block-diagonal causal mask: no token attends across a sequence boundary, and
   every sequence sees exactly the positions it would alone. A row's unused tail is one more (ignored) sequence.
   On a CPU learner (``optim.varlen_attention``) the model's attention is :func:`varlen_sdpa_attention`
   instead: causal SDPA on each sequence's own columns, no mask, a fraction of the row x row work.
2. **Logits only where a completion token is predicted.** ``logits_to_keep`` is a boolean ``[rows, width]`` mask
   of the positions that predict a completion token, so the language-model head and the log-softmax skip the
   prompts and the row tails (transformers answers with ``[predictions, vocab]`` logits).
3. **Chunked float32 log-softmax** (:func:`~services.lib.model_io.token_logprobs`) on those columns, then the
   values go back to the padded ``[B, T]`` layout the loss takes.

The result equals the padded path's (same model, same tokens; floating-point order aside) with gradients
through the same parameters; ``bench/learner.py`` measures what it saves.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from services.lib.model_io import completion_loss_mask, token_logprobs


class PackingError(RuntimeError):
    """The model cannot take packed rows (an older transformers)."""


def pack_rows(lengths: Sequence[int], width: int) -> list[list[int]]:
    """Indices of ``lengths`` packed first-fit-decreasing into rows of at most ``width`` tokens (a longer
    sequence gets a row of its own). Deterministic: ties keep index order."""
    if width < 1:
        raise ValueError(f"the packed row width must be >= 1, got {width}")
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for r, room in enumerate(free):
            if lengths[i] <= room:
                rows[r].append(i)
                free[r] -= lengths[i]
                break
        else:
            rows.append([i])
            free.append(max(width - lengths[i], 0))
    return rows


def packed_position_ids(lengths: Sequence[int], rows: Sequence[Sequence[int]], width: int) -> Tensor:
    """``[len(rows), width]`` positions of sequences of ``lengths`` packed into ``rows`` (:func:`pack_rows`):
    each sequence counts from 0 where it starts, and a row's unused tail counts from 0 too (one more sequence,
    ignored by the loss), so :func:`sequence_spans` finds every sequence from the restarts."""
    position_ids = torch.zeros((len(rows), width), dtype=torch.long)
    for r, members in enumerate(rows):
        offset = 0
        for i in members:
            position_ids[r, offset : offset + lengths[i]] = torch.arange(lengths[i])
            offset += lengths[i]
        position_ids[r, offset:] = torch.arange(width - offset)
    return position_ids


def packed_sequence_logprobs(
    model: nn.Module,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    *,
    completion_masks: Sequence[Sequence[int]] | None = None,
    pad_token_id: int = 0,
    temperature: float = 1.0,
    chunk_positions: int | None = None,
) -> tuple[Tensor, Tensor]:
    """:func:`~services.lib.model_io.sequence_logprobs`'s result (``(logprobs [B, T], loss_mask [B, T])``, same
    arguments) computed on packed rows; see the module docstring."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if len(prompt_ids) != len(completion_ids):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(completion_ids)} completions")
    if any(len(p) == 0 for p in prompt_ids):
        raise ValueError("every prompt needs at least one token (e.g. BOS) to condition the first completion token")
    device = next(model.parameters()).device
    batch = len(prompt_ids)
    completion_lens = [len(c) for c in completion_ids]
    loss_mask = completion_loss_mask(completion_lens, completion_masks)
    max_completion = max(completion_lens, default=0)
    if max_completion == 0:
        return torch.zeros((batch, 0), device=device), loss_mask.to(device)

    # 1. pack: token ids and restarting positions per row; where each sequence landed
    lengths = [len(p) + len(c) for p, c in zip(prompt_ids, completion_ids, strict=True)]
    width = max(lengths)
    rows = pack_rows(lengths, width)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    position_ids = packed_position_ids(lengths, rows, width)
    # per row: (sequence, column predicting each of its completion tokens, that token)
    predictions: list[list[tuple[int, int, int]]] = []
    for r, members in enumerate(rows):
        offset, row_predictions = 0, []
        for i in members:
            seq = list(prompt_ids[i]) + list(completion_ids[i])
            input_ids[r, offset : offset + len(seq)] = torch.tensor(seq, dtype=torch.long)
            first = offset + len(prompt_ids[i]) - 1  # the column predicting completion token 0
            row_predictions += [(i, first + j, tok) for j, tok in enumerate(completion_ids[i])]
            offset += len(seq)
        predictions.append(row_predictions)

    # 2. logits only at the positions that predict a completion token: a boolean [rows, width] mask, which
    # transformers' heads take as logits_to_keep and answer with [predictions, V] in row-major order
    keep = torch.zeros((len(rows), width), dtype=torch.bool)
    for r, row in enumerate(predictions):
        keep[r, [col for _, col, _ in row]] = True
    n = int(keep.sum())
    logits = _kept_logits(model, input_ids.to(device), position_ids.to(device), keep.to(device))
    if logits.dim() != 2 or logits.shape[0] != n:
        raise PackingError(f"the model answered a boolean logits_to_keep with logits of shape {tuple(logits.shape)}, "
                           f"not ({n}, vocab): set optim.packing = false")

    # 3. float32 log-softmax, chunked, on the predictions; then back to [B, T]
    order = [(i, col, tok) for row in predictions for i, col, tok in sorted(row, key=lambda x: x[1])]
    targets = torch.tensor([[tok for _, _, tok in order]], dtype=torch.long, device=device)
    flat = token_logprobs(logits.unsqueeze(0), torch.arange(n, device=device).unsqueeze(0), targets, temperature,
                          chunk_positions=chunk_positions)[0]
    dst_seq, dst_pos, counts = [], [], [0] * batch
    for i, _, _ in order:  # a sequence's predictions are in column order: its j-th is completion token j
        dst_seq.append(i)
        dst_pos.append(counts[i])
        counts[i] += 1
    logprobs = torch.zeros((batch, max_completion), dtype=flat.dtype, device=device)
    logprobs = logprobs.index_put((torch.tensor(dst_seq, device=device), torch.tensor(dst_pos, device=device)), flat)
    loss_mask = loss_mask.to(device)
    return logprobs * loss_mask, loss_mask


#: whether this transformers' causal-LM heads take a boolean ``logits_to_keep`` (5.24 does; the older one vLLM
#: pins, 5.19, indexes with it and fails); None until the first packed pass finds out
_BOOLEAN_KEEP: bool | None = None


def _kept_logits(model: nn.Module, input_ids: Tensor, position_ids: Tensor, keep: Tensor) -> Tensor:
    """``[kept positions, V]`` logits in row-major order: the head computes only those where transformers takes a
    boolean ``logits_to_keep``; elsewhere every position's logits are computed and the kept ones taken (the same
    numbers, more memory)."""
    global _BOOLEAN_KEEP
    if _BOOLEAN_KEEP is not False:
        try:
            logits = model(input_ids=input_ids, position_ids=position_ids, logits_to_keep=keep, use_cache=False).logits
            _BOOLEAN_KEEP = True
            return logits
        except IndexError:  # "too many indices": this head slices hidden states with it
            if _BOOLEAN_KEEP:
                raise
            _BOOLEAN_KEEP = False
    return model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits[keep]


# --- attention within each packed sequence ----------------------------------------------------------------------
#: the attention implementation :func:`use_varlen_attention` sets: SDPA run once per packed sequence
VARLEN_ATTENTION = "rlbus_varlen_sdpa"


def sequence_spans(position_ids: Tensor) -> list[list[tuple[int, int]]]:
    """Per row of ``position_ids`` ``[rows, width]``, the ``[start, end)`` columns of each packed sequence: a
    sequence starts at column 0 and wherever a position does not follow the one before it by 1 (packed rows
    restart at 0)."""
    if position_ids.dim() != 2:
        raise ValueError(f"position_ids must be [rows, width], got shape {tuple(position_ids.shape)}")
    rows, width = position_ids.shape
    if width == 0:
        return [[] for _ in range(rows)]
    out = []
    for row in _sequence_starts(position_ids).cpu().tolist():
        cols = [c for c, s in enumerate(row) if s] + [width]
        out.append(list(zip(cols[:-1], cols[1:], strict=True)))
    return out


def _sequence_starts(position_ids: Tensor) -> Tensor:
    """``[rows, width]`` booleans: True where a packed sequence starts (column 0, and wherever a position does
    not follow the one before it by 1)."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return starts


#: the last ``position_ids`` whose spans were found (a weak reference and its version counter) and the spans:
#: every layer of a pass gets the same tensor, so the spans are found once a pass, not once a layer
_SPANS_MEMO: list[Any] = [None, -1, None]


def _spans_of_this_pass(position_ids: Tensor) -> list[list[tuple[int, int]]]:
    """:func:`sequence_spans` of ``position_ids``, found again only for another tensor or one changed in place
    (an inference-mode tensor has no version counter: found every time)."""
    if position_ids.is_inference():
        return sequence_spans(position_ids)
    ref, version, spans = _SPANS_MEMO
    if ref is not None and ref() is position_ids and version == position_ids._version:
        return spans
    spans = sequence_spans(position_ids)
    _SPANS_MEMO[:] = [weakref.ref(position_ids), position_ids._version, spans]
    return spans


def varlen_sdpa_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                          attention_mask: Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                          **kwargs: object) -> tuple[Tensor, None]:
    """transformers' attention-function interface (``query [B, Hq, T, D]``, ``key``/``value [B, Hkv, T, D]``;
    answers ``[B, T, Hq, D]``): causal SDPA on each packed sequence of each row on its own, found from the
    restarts of ``position_ids``. A block-diagonal mask over the whole row (the ``sdpa`` path for packed rows)
    makes the kernel compute every row x row block and mask most of it away; per sequence, the causal kernel
    computes about ``sum(L_i^2) / 2`` scores instead of ``width^2``. Where that saves less than the extra calls
    cost (:func:`per_sequence_pays`: many short sequences, narrow rows) it is one call on the whole rows under
    the block-diagonal mask, built here. The learner's passes only: with a mask (the
    model built one), without ``position_ids``, or with a cache (queries shorter than keys) it is transformers'
    own ``sdpa``. :func:`varlen_mask` builds a mask only for a call with a padding mask (a padded batch), so
    packed rows and unpadded batches come here without one."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    position_ids = kwargs.get("position_ids")
    q_len = query.shape[2]
    if attention_mask is not None or not isinstance(position_ids, Tensor) or q_len != key.shape[2] or q_len < 2:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    spans = _spans_of_this_pass(position_ids)
    if position_ids.shape[0] != query.shape[0]:  # one row of positions for every row of the batch
        position_ids = position_ids.expand(query.shape[0], -1)
        spans = spans * query.shape[0]
    gqa = query.shape[1] != key.shape[1]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if not per_sequence_pays(spans, q_len, query.shape[1] * query.shape[3]):
        # one call on whole rows under the block-diagonal causal mask (many short sequences)
        ids = torch.cumsum(_sequence_starts(position_ids).long(), dim=1)  # which sequence each column is in
        causal = torch.ones(q_len, q_len, dtype=torch.bool, device=query.device).tril()
        mask = ((ids.unsqueeze(2) == ids.unsqueeze(1)) & causal).unsqueeze(1)
        out = sdpa(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=gqa)
        return out.transpose(1, 2).contiguous(), None
    rows = []
    for b, row in enumerate(spans):
        parts = [sdpa(query[b : b + 1, :, s:e], key[b : b + 1, :, s:e], value[b : b + 1, :, s:e], dropout_p=dropout,
                      is_causal=e - s > 1, scale=scaling, enable_gqa=gqa) for s, e in row]
        rows.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=2))
    out = rows[0] if len(rows) == 1 else torch.cat(rows, dim=0)
    return out.transpose(1, 2).contiguous(), None


#: the fixed cost of one attention call (forward + backward, on a slice), in attention work: score x (heads x
#: head_dim) units. Measured on this project's 2-core CPU machine: a call ~0.8 ms, a unit ~0.14 ns, so ~6 M
#: units (``bench/learner.py`` measures the result on SmolLM2; the tiny model's 16-token rows stay masked)
CALL_COST_UNITS = 6e6


def per_sequence_pays(spans: Sequence[Sequence[tuple[int, int]]], width: int, heads_x_dim: int) -> bool:
    """Whether a call per packed sequence beats one masked call over the whole rows: the scores it saves
    (``rows x width^2`` computed under the mask against ``sum(L_i^2) / 2`` causal ones) outweigh the fixed cost
    of its extra calls (:data:`CALL_COST_UNITS` each)."""
    calls = sum(len(row) for row in spans)
    per_sequence = sum((e - s) ** 2 for row in spans for s, e in row) / 2
    saved = (len(spans) * width * width - per_sequence) * heads_x_dim
    return saved > (calls - 1) * CALL_COST_UNITS



def varlen_mask(*args: object, attention_mask: Tensor | None = None, **kwargs: object) -> Tensor | None:
    """transformers' mask interface for :data:`VARLEN_ATTENTION`: no mask where the call has no padding mask
    (packed rows, or one sequence per row: :func:`varlen_sdpa_attention` keeps attention within each sequence
    from ``position_ids``), else ``sdpa``'s own mask (a padded batch then takes transformers' ``sdpa`` path)."""
    from transformers.masking_utils import sdpa_mask

    if attention_mask is None:
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def use_varlen_attention(model: nn.Module) -> bool:
    """Make ``model``'s attention :func:`varlen_sdpa_attention` (registered with transformers once). False, and
    the model unchanged, where it cannot: a model whose attention does not go through transformers' attention
    interface, or one set to another implementation than ``sdpa`` (eager, flash-attention on a GPU). The
    backward of a checkpointed layer recomputes it with the same attention (the model's setting, not a
    context around the forward)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) not in ("sdpa", VARLEN_ATTENTION):
        return False
    if VARLEN_ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(VARLEN_ATTENTION, varlen_sdpa_attention)
        AttentionMaskInterface.register(VARLEN_ATTENTION, varlen_mask)
    can_set = getattr(model, "_can_set_attn_implementation", None)
    if can_set is None or not can_set():
        return False
    model.set_attn_implementation(VARLEN_ATTENTION)
    return model.config._attn_implementation == VARLEN_ATTENTION
