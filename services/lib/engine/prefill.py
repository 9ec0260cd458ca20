"""How the torch engine prefills newcomers: which prompts share a forward pass, and its padded inputs.

Prefill is where padding costs the most (a short prompt padded to a long one computes the difference for
nothing) and where GRPO groups save the most (``group_size`` requests with one prompt). This policy is
plain arithmetic on token ids, so it lives here, apart from
:class:`~services.lib.engine.torch_engine.TorchEngine`'s decode loop, which calls it once per admission:

* :func:`prefill_chunks` — identical prompts are prefilled once (the engine copies their cache rows);
  distinct ones longest first, in chunks of similar length;
* :func:`left_padded` — a chunk's ``input_ids``, validity mask and position ids, left-padded to its longest
  prompt as :class:`~services.lib.engine.kv_cache.PaddedBatchCache` expects.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

Prompt = tuple[int, ...]


def prefill_chunks(prompts: Iterable[Prompt]) -> list[list[Prompt]]:
    """Distinct ``prompts``, longest first (ties in given order), in chunks whose prompts are each at least 3/4
    as long as the chunk's first."""
    chunks: list[list[Prompt]] = []
    for prompt in sorted(dict.fromkeys(prompts), key=len, reverse=True):
        if chunks and 4 * len(prompt) >= 3 * len(chunks[-1][0]):
            chunks[-1].append(prompt)
        else:
            chunks.append([prompt])
    return chunks


def left_padded(prompts: Sequence[Prompt]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, valid, position_ids)`` of shape ``[len(prompts), longest]`` (CPU), padding on the left."""
    longest = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), longest), dtype=torch.long)
    valid = torch.zeros((len(prompts), longest), dtype=torch.bool)
    positions = torch.zeros((len(prompts), longest), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        n = len(prompt)
        ids[i, longest - n:] = torch.tensor(prompt, dtype=torch.long)
        valid[i, longest - n:] = True
        positions[i, longest - n:] = torch.arange(n)
    return ids, valid, positions
