"""A user's reward module for ``examples/dataset.toml``: plain functions, named in the run file by import
path (``"examples.data.rewards:close"``), called once per completion with the row's columns.

The run file combines it with the shipped ``exact_match``: exact answers get the full reward, near misses
some, so a group in which no sample is exactly right still says which samples were better.
"""

from __future__ import annotations


def close(prompt: str, completion: str, answer: str, **fields: object) -> float:
    """1.0 for the exact sum, falling by 0.1 per unit of distance to 0.0 at 10 away (or not a number)."""
    try:
        got = int(completion.strip())
    except ValueError:
        return 0.0
    return max(0.0, 1.0 - abs(got - int(answer)) / 10)
