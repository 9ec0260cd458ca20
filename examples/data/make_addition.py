"""Writes ``addition.jsonl``: the default example's addition problems as a data file (4,000 distinct rows).

This is how ``examples/dataset.toml``'s data was made; it stands for any JSONL a user brings::

    python examples/data/make_addition.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path


def main(rows: int = 4000, seed: int = 18) -> None:
    rng = random.Random(seed)
    pairs = rng.sample([(a, b) for a in range(10, 100) for b in range(10, 100)], rows)
    out = Path(__file__).with_name("addition.jsonl")
    out.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n" for a, b in pairs))
    print(f"wrote {rows} rows to {out}")


if __name__ == "__main__":
    main()
