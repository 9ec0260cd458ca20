"""The trainer's learner on an accelerator: step time and training tokens/s, bf16 mixed precision vs float32.

Runs the real :class:`services.trainer.learner.Learner` (the code the trainer service runs: autocast
bf16 with float32 master weights, token-budget micro-batches, AdamW, the weight gather that
precedes a send) on synthetic GRPO batches, for two Llama models built here from ``LlamaConfig``
with random weights, nothing downloaded:

* ``tiny``: hidden 128, 4 layers, vocab 512 (~1.2 M parameters);
* ``qwen152k``: Qwen2.5's 151,936-token vocabulary (hidden 896, 4 layers, untied; ~0.3 B parameters), the
  memory peak of the logprobs at 16k tokens per micro-batch;
* ``smollm2``: SmolLM2-135M's shape (hidden 576, 30 layers, 9 heads / 3 KV heads, vocab 49,152,
  tied embeddings; ~135 M parameters), random init.

Per model and dtype: median step time over ``--steps`` timed steps (after ``--warmup``), training
tokens/s (prompt + completion tokens of the batch / step time), the time of ``Learner.state_dict()``
(what precedes every weight send) and peak device memory. ``bf16_vs_fp32_step`` is the ratio of
the two dtypes' step times measured side by side. Last stdout line: one JSON object.

Usage::

    python bench/gpu_check_trainer.py                       # CUDA, both models, bf16 and fp32
    python bench/gpu_check_trainer.py --device cpu --models tiny --steps 1 --warmup 0   # a CPU smoke run

Needs torch, transformers, tokenizers, safetensors and msgspec (the trainer's config).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import msgspec  # noqa: E402
import torch  # noqa: E402

MODELS = {
    "tiny": {"hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4,
             "num_key_value_heads": 4, "vocab_size": 512},
    # Qwen2.5's 151,936-token vocabulary on a short stack: the logprobs of 16k tokens x 152k vocabulary are the
    # memory peak of a real model's step (untied, as Qwen2.5-1.5B+)
    "qwen152k": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 4, "num_attention_heads": 14,
                 "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": False},
    "smollm2": {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                "num_key_value_heads": 3, "vocab_size": 49152},
}


def build_model(out: Path, name: str, seed: int = 0) -> Path:
    """A random-init Llama of shape ``name`` with a word-level tokenizer, saved as a Hugging Face directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    shape = MODELS[name]
    if (out / "config.json").is_file():
        return out
    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3}
    vocab.update({f"t{i}": i for i in range(4, shape["vocab_size"])})
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>",
                                        pad_token="<pad>", unk_token="<unk>", padding_side="left")
    config = LlamaConfig(**{"tie_word_embeddings": True, **shape}, max_position_embeddings=2048, bos_token_id=1,
                         eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def synthetic_batch(seed: int, vocab: int, groups: int, group_size: int, prompt_len: int, completion_len: int):
    """Scored trajectories with random tokens, rewards and behaviour logprobs (lengths vary by up to 25 %)."""
    from proto.rollouts import Rollout, Turn
    from proto.trajectories import ScoredTrajectory

    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = [1] + [rng.randrange(4, vocab) for _ in range(prompt_len - 1)]
        for i in range(group_size):
            n = max(1, int(completion_len * rng.uniform(0.75, 1.0)))
            turn = Turn(role="assistant", token_ids=[rng.randrange(4, vocab) for _ in range(n)],
                        logprobs=[-rng.uniform(0.5, 4.0) for _ in range(n)], versions=[0] * n, text="")
            rollout = Rollout(run_id="bench", task="bench", group_id=f"g{seed}-{g}", prompt_id=f"p{g}",
                              sample_index=i, group_size=group_size, prompt_ids=prompt, turns=[turn],
                              finish_reason="length", policy_version=0)
            out.append(ScoredTrajectory(run_id="bench", rollout=rollout, reward=rng.random()))
    return out


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure(model_dir: Path, name: str, args: argparse.Namespace, dtype: str) -> dict[str, float]:
    from services.trainer import devices
    from services.trainer.config import TrainerConfig
    from services.trainer.learner import Learner

    cfg = msgspec.convert({"devices": {"device": args.device, "num_threads": args.threads},
                           "optim": {"lr": 1e-5, "micro_batch_size": 64, "max_tokens_per_micro_batch": args.max_tokens,
                                     "gradient_checkpointing": args.checkpointing}}, TrainerConfig)
    placement = devices.resolve(cfg, dtype=dtype)  # the run's [model] dtype
    if placement.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    learner = Learner(cfg, model_dir, placement)
    vocab = MODELS[name]["vocab_size"]
    times, tokens = [], []
    for i in range(args.warmup + args.steps):
        batch = synthetic_batch(i, vocab, args.groups, args.group_size, args.prompt_len, args.completion_len)
        _sync(placement.device)
        t0 = time.perf_counter()
        metrics = learner.step(batch)
        _sync(placement.device)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
            tokens.append(sum(len(t.rollout.prompt_ids) + len(t.rollout.turns[0].token_ids) for t in batch))
        if metrics.get("optim/skipped"):
            raise RuntimeError(f"{name} {dtype}: a step was skipped (non-finite gradient)")
    t0 = time.perf_counter()
    sent = learner.state_dict()
    _sync(placement.device)
    state_dict_s = time.perf_counter() - t0
    step_s = statistics.median(times)
    out = {
        "params_m": round(sum(p.numel() for p in learner.model.parameters()) / 1e6, 2),
        "step_s_median": round(step_s, 4),
        "train_tokens_per_s": round(statistics.median(tokens) / step_s, 1),
        "state_dict_s": round(state_dict_s, 4),
        "sent_dtype": str(next(iter(sent.values())).dtype).removeprefix("torch."),
        "loss_finite": bool(torch.isfinite(torch.tensor(metrics["losses/total"]))),
    }
    if placement.device.startswith("cuda"):
        out["peak_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    del learner, sent
    if placement.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="trainer device (cuda, cuda:N, cpu)")
    p.add_argument("--models", default="tiny,smollm2")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--completion-len", type=int, default=384)
    p.add_argument("--max-tokens", type=int, default=16384, help="max_tokens_per_micro_batch")
    p.add_argument("--checkpointing", action="store_true", help="gradient (activation) checkpointing")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    p.add_argument("--dir", default="", help="where the models are built (default: a temporary directory)")
    args = p.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit(f"--device {args.device}: no CUDA device here (torch {torch.__version__}); use --device cpu")
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="rlbus-gpu-check-"))
    started = time.perf_counter()
    result: dict[str, object] = {"device": args.device, "torch": torch.__version__,
                                 "batch": f"{args.groups}x{args.group_size} x ({args.prompt_len}+"
                                          f"<={args.completion_len}) tokens", "models": {}}
    if args.device.startswith("cuda"):
        result["gpu"] = torch.cuda.get_device_name(torch.device(args.device))
    for name in args.models.split(","):
        model_dir = build_model(root / name, name)
        per = {dtype: measure(model_dir, name, args, dtype) for dtype in args.dtypes.split(",")}
        if "bfloat16" in per and "float32" in per:
            per["bf16_vs_fp32_step"] = round(per["bfloat16"]["step_s_median"] / per["float32"]["step_s_median"], 3)
        result["models"][name] = per  # type: ignore[index]
        print(json.dumps({name: per}), file=sys.stderr, flush=True)
    result["wall_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
