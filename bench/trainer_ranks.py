"""The trainer on 1 rank vs 2 ranks (FSDP2 over gloo) on this CPU: step time, weight gather, checkpoint.

Each configuration runs in a fresh process (rank 0; rank 1 is started by the trainer's own
:class:`~services.trainer.ranks.RankGroup`, as in the service), on the same synthetic GRPO
batches, and the configurations alternate round by round so they share the machine's load:

* ``1rank_1thread``: one rank, one torch thread;
* ``1rank_2threads``: one rank with both cores (the same CPU budget as two ranks);
* ``2ranks_1thread``: two ranks, one thread each.

Figures per configuration (medians over rounds): ``step_s`` (one optimiser step),
``state_dict_s`` (``Learner.state_dict()``: what precedes every weight send; on 2 ranks the
parameter-by-parameter gather onto rank 0), ``checkpoint_s`` (DCP shards + the Hugging Face
directory). Ratios: ``step_2ranks_vs_1rank`` (against one thread), ``step_2ranks_vs_1rank_2threads``
(same cores), ``gather_share_of_step_2ranks``. Last stdout line: one JSON object.

Usage: ``python bench/trainer_ranks.py [--model tiny|medium] [--rounds 3] [--steps 4]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_check_trainer import MODELS, build_model, synthetic_batch  # noqa: E402

MODELS.setdefault("medium", {"hidden_size": 384, "intermediate_size": 1536, "num_hidden_layers": 4,
                             "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 512})

CONFIGS = {"1rank_1thread": (1, 1), "1rank_2threads": (1, 2), "2ranks_1thread": (2, 1)}


async def child(args: argparse.Namespace) -> dict[str, float]:
    import msgspec

    from services.trainer import devices
    from services.trainer.config import TrainerConfig
    from services.trainer.learner import Learner
    from services.trainer.ranks import RankGroup

    cfg = msgspec.convert({"devices": {"device": "cpu", "world_size": args.world, "num_threads": args.threads},
                           "optim": {"lr": 1e-5, "micro_batch_size": 64, "max_tokens_per_micro_batch": args.max_tokens}},
                          TrainerConfig)
    out = Path(args.out)
    group = RankGroup.start(cfg, out) if cfg.devices.world_size > 1 else None
    try:
        if group is not None:
            group.init(Path(args.model_dir))
        learner = Learner(cfg, Path(args.model_dir), devices.resolve(cfg),
                          init_method=group.init_method if group else "", group=group)
        vocab = MODELS[args.model]["vocab_size"]
        times = []
        for i in range(1 + args.steps):  # the first step warms up
            batch = synthetic_batch(i, vocab, args.groups, args.group_size, args.prompt_len, args.completion_len)
            t0 = time.perf_counter()
            learner.step(batch)
            if i:
                times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        learner.state_dict()
        gather = time.perf_counter() - t0
        t0 = time.perf_counter()
        learner.save_checkpoint(out / "checkpoints", 1, {"step": 1})
        ckpt = time.perf_counter() - t0
    finally:
        if group is not None:
            group.close()
    return {"step_s": statistics.median(times), "state_dict_s": gather, "checkpoint_s": ckpt}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", choices=["tiny", "medium"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--completion-len", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--model-dir", default="", help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(asyncio.run(child(args))))
        return
    root = Path(tempfile.mkdtemp(prefix="rlbus-trainer-ranks-"))
    model_dir = build_model(root / args.model, args.model)
    shared = ["--model", args.model, "--steps", str(args.steps), "--groups", str(args.groups), "--group-size",
              str(args.group_size), "--prompt-len", str(args.prompt_len), "--completion-len", str(args.completion_len),
              "--max-tokens", str(args.max_tokens), "--model-dir", str(model_dir)]
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in CONFIGS}
    started = time.perf_counter()
    for r in range(args.rounds):
        for name, (world, threads) in CONFIGS.items():
            out = root / f"{name}-{r}"
            res = subprocess.run([sys.executable, __file__, "--child", "--world", str(world), "--threads",
                                  str(threads), "--out", str(out), *shared], capture_output=True, text=True)
            if res.returncode != 0:
                sys.exit(f"{name} failed:\n{res.stderr[-3000:]}")
            runs[name].append(json.loads(res.stdout.strip().splitlines()[-1]))
            print(name, runs[name][-1], file=sys.stderr, flush=True)
    med = {name: {k: round(statistics.median(x[k] for x in rs), 4) for k in rs[0]} for name, rs in runs.items()}
    result = {
        "model": args.model,
        "batch": f"{args.groups}x{args.group_size} x ({args.prompt_len}+<={args.completion_len}) tokens",
        "rounds": args.rounds,
        **med,
        "step_2ranks_vs_1rank": round(med["2ranks_1thread"]["step_s"] / med["1rank_1thread"]["step_s"], 3),
        "step_2ranks_vs_1rank_2threads": round(med["2ranks_1thread"]["step_s"] / med["1rank_2threads"]["step_s"], 3),
        "gather_share_of_step_2ranks": round(med["2ranks_1thread"]["state_dict_s"] / med["2ranks_1thread"]["step_s"],
                                             3),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
