"""How one optimiser step's batch is cut: across ranks, then into micro-batches. Pure bookkeeping.

* :func:`split_across_ranks` gives each rank a share of the sequences with about the same number
  of tokens (longest first, each to the rank with the fewest tokens so far).
* :func:`micro_batches` cuts one rank's share into forward/backward passes bounded by a row count
  and a budget of *padded* tokens (rows x the longest row: what a pass actually computes). Rows
  are taken longest first, so rows of similar length share a pass and little is padding. A row
  longer than the budget runs alone.
* :func:`minibatches` cuts a whole batch into the optimiser steps of one PPO pass
  (``ppo_epochs`` / ``minibatches``), balanced by tokens like the ranks; each minibatch is
  then planned (ranks, micro-batches) on its own.
* :func:`plan` does both and pads every rank to the same number of passes (an empty pass is a
  no-op forward/backward), because FSDP's collectives need every rank in every pass.

The loss of every pass is normalised by the whole (mini)batch's count (``total``), so the gradients of
all passes on all ranks add up to the gradient of the whole batch in one pass.
"""

from __future__ import annotations


def split_across_ranks(lengths: list[int], world_size: int) -> list[list[int]]:
    """Indices of ``lengths`` per rank, balanced by tokens; each rank's indices in ascending order."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    shares: list[list[int]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(world_size), key=lambda r: (load[r], len(shares[r]), r))
        shares[r].append(i)
        load[r] += lengths[i]
    return [sorted(s) for s in shares]


def micro_batches(indices: list[int], lengths: list[int], max_rows: int, max_tokens: int = 0) -> list[list[int]]:
    """Cut ``indices`` into passes of at most ``max_rows`` rows and ``max_tokens`` padded tokens (0: no bound)."""
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
    out: list[list[int]] = []
    current: list[int] = []
    width = 0
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        new_width = max(width, lengths[i])
        fits = len(current) < max_rows and (not max_tokens or (len(current) + 1) * new_width <= max_tokens)
        if current and not fits:
            out.append(current)
            current, new_width = [], lengths[i]
        current.append(i)
        width = new_width
    if current:
        out.append(current)
    return out


def plan(lengths: list[int], world_size: int, max_rows: int, max_tokens: int = 0) -> list[list[list[int]]]:
    """Per rank, its passes (lists of row indices); every rank has the same number, empty ones padding."""
    per_rank = [micro_batches(share, lengths, max_rows, max_tokens)
                for share in split_across_ranks(lengths, world_size)]
    passes = max((len(p) for p in per_rank), default=0)
    return [p + [[] for _ in range(passes - len(p))] for p in per_rank]


def minibatches(lengths: list[int], n: int) -> list[list[int]]:
    """``n`` minibatches of about equal tokens (fewer when there are fewer rows); indices ascending in each.

    Deterministic (the same cut for every rank and every epoch), so each minibatch mixes long and short
    rows rather than sorting the batch by length.
    """
    if n < 1:
        raise ValueError(f"the number of minibatches must be >= 1, got {n}")
    return [share for share in split_across_ranks(lengths, min(n, max(len(lengths), 1))) if share]
