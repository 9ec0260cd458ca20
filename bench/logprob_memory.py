"""Peak memory and time of the sampled tokens' logprobs (forward + backward) over a large vocabulary:
the plain expression (float32 copies of the vocabulary-wide logits) against ``token_logprobs`` (chunks of
positions, its own backward), on CPU. Each variant runs in a fresh process; its figure is the growth of the
peak resident set over the resident set once the bf16 logits exist.

    .venv/bin/python bench/logprob_memory.py --tokens 1024 --vocab 152064

Prints one JSON line per variant, then a final JSON line with both and their ratio.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def one(variant: str, tokens: int, vocab: int) -> dict:
    import torch

    from services.lib.model_io import token_logprobs

    torch.manual_seed(0)
    logits = torch.randn(1, tokens, vocab, dtype=torch.bfloat16).requires_grad_(True)
    rows = torch.arange(tokens).unsqueeze(0)
    targets = torch.randint(0, vocab, (1, tokens))
    base = _rss_mib()
    t0 = time.perf_counter()
    if variant == "plain":
        x = logits.float() / 0.9
        picked = x.gather(1, rows.unsqueeze(-1).expand(-1, -1, vocab))
        lp = picked.gather(2, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(picked, dim=-1)
    else:
        lp = token_logprobs(logits, rows, targets, 0.9)
    lp.sum().backward()
    elapsed = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"variant": variant, "tokens": tokens, "vocab": vocab, "peak_growth_mib": round(peak - base, 1),
            "logits_mib": round(logits.numel() * 2 / 2**20, 1), "seconds": round(elapsed, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=152064)
    parser.add_argument("--variant", choices=["plain", "chunked"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(one(args.variant, args.tokens, args.vocab)))
        return
    results = {}
    for variant in ("plain", "chunked"):
        out = subprocess.run([sys.executable, __file__, "--variant", variant, "--tokens", str(args.tokens),
                              "--vocab", str(args.vocab)], cwd=REPO, capture_output=True, text=True, check=True,
                             env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
        results[variant] = json.loads(out.stdout.strip().splitlines()[-1])
        print(json.dumps(results[variant]))
    print(json.dumps({"bench": "logprob_memory", **results,
                      "peak_ratio": round(results["chunked"]["peak_growth_mib"] /
                                          max(results["plain"]["peak_growth_mib"], 1e-9), 3)}))


if __name__ == "__main__":
    main()
