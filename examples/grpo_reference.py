"""Single-process GRPO on the tiny model + addition: the calibration reference (no bus).

Runs the same loss, optimiser and model I/O the trainer service uses, with
``model.generate`` as the sampler, to find settings that learn and to measure
what a run without services achieves. Prints one JSON line per evaluation
(``eval_reward``), one per ``--log-every`` steps (``train_reward``, ``loss``,
``grad_norm``) and a summary JSON line at the end (with ``param_change``, the L2
norm of what the run changed in the weights).

    .venv/bin/python examples/grpo_reference.py --budget-s 300
    .venv/bin/python examples/grpo_reference.py --steps 20 --log-every 1   # a quick look
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--cache-dir", type=Path, default=Path(".cache/rlbus"), help="where the tiny model is built"
    )
    p.add_argument(
        "--model-dir", type=Path, default=None, help="start from this HF dir instead of the tiny model"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--warmup-steps", type=int, default=None, help="supervised warm-up steps of the tiny model"
    )
    p.add_argument("--prompts-per-step", type=int, default=16)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=6)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument(
        "--aggregation", choices=["seq_mean_token_mean", "token_mean"], default="seq_mean_token_mean"
    )
    p.add_argument("--is-mode", choices=["tis", "decoupled", "none"], default="tis")
    p.add_argument("--no-std", action="store_true", help="do not divide advantages by the group std")
    p.add_argument(
        "--budget-s", type=float, default=300.0, help="stop after this many seconds of RL (no eval)"
    )
    p.add_argument("--max-steps", "--steps", dest="max_steps", type=int, default=100_000, help="stop after N steps")
    p.add_argument("--eval-every", type=int, default=25, help="evaluate every N steps")
    p.add_argument("--eval-samples", type=int, default=1, help="samples per held-out prompt")
    p.add_argument("--save-dir", type=Path, default=None, help="save the trained model here (a HF directory)")
    p.add_argument("--log-every", type=int, default=0, help="print a JSON line of the step's figures every N steps")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)

    import torch

    from services.lib.model_io import load_policy, save_policy, sequence_logprobs
    from services.tasks import get_task
    from services.tasks.evaluate import evaluate_task, generate_completions
    from services.tasks.tiny_model import DEFAULT_WARMUP_STEPS, ensure_tiny_model
    from services.trainer.loss import group_advantages, grpo_loss
    from services.trainer.optim import build_optimizer, optimizer_step

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    started = time.monotonic()
    model_dir = args.model_dir or ensure_tiny_model(
        args.cache_dir, seed=args.seed, warmup_steps=args.warmup_steps or DEFAULT_WARMUP_STEPS
    )
    model, tokenizer = load_policy(model_dir)
    task = get_task("addition")
    optimizer = build_optimizer(model, lr=args.lr)
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    stream = task.train_prompts(seed=args.seed)

    def evaluate(step: int, rl_seconds: float) -> float:
        state = torch.random.get_rng_state()
        torch.manual_seed(10_000 + step)
        reward = evaluate_task(model, tokenizer, task, samples_per_prompt=args.eval_samples)
        torch.random.set_rng_state(state)
        line = {
            "step": step,
            "rl_s": round(rl_seconds, 1),
            "wall_s": round(time.monotonic() - started, 1),
            "eval_reward": reward,
        }
        print(json.dumps(line), flush=True)
        return reward

    curve = [(0, 0.0, evaluate(0, 0.0))]
    rl_seconds, step = 0.0, 0
    last: dict[str, float] = {}  # the newest step's figures
    while step < args.max_steps and rl_seconds < args.budget_s:
        t0 = time.monotonic()
        # 1. Sample a group of completions per prompt with the current policy.
        prompts = [next(stream) for _ in range(args.prompts_per_step)]
        members = [p for p in prompts for _ in range(args.group_size)]
        prompt_ids = [task.format_prompt(tokenizer, p) for p in members]
        model.eval()
        completions, behaviour = generate_completions(
            model, tokenizer, prompt_ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature
        )
        # 2. Score and turn rewards into group-relative advantages.
        texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
        rewards = [task.reward(p, t).value for p, t in zip(members, texts, strict=True)]
        advantages = group_advantages(rewards, [p.id for p in members], normalize_std=not args.no_std)
        # 3. Policy-gradient step on the GRPO loss.
        model.train()
        logprobs, mask = sequence_logprobs(
            model, prompt_ids, completions, pad_token_id=tokenizer.pad_token_id, temperature=args.temperature
        )
        behaviour_lp = torch.zeros_like(logprobs)
        for i, row in enumerate(behaviour):
            behaviour_lp[i, : len(row)] = torch.tensor(row)
        loss, metrics = grpo_loss(
            logprobs, behaviour_lp, advantages, mask, aggregation=args.aggregation, is_mode=args.is_mode
        )
        loss.backward()
        metrics |= optimizer_step(model, optimizer, max_grad_norm=args.max_grad_norm)
        step += 1
        rl_seconds += time.monotonic() - t0
        last = {
            "step": step,
            "train_reward": sum(rewards) / len(rewards),
            "loss": metrics["losses/total"],
            "grad_norm": metrics["optim/grad_norm"],
        }
        if args.log_every and step % args.log_every == 0:
            print(json.dumps(last), flush=True)
        if step % args.eval_every == 0:
            logging.info(
                "step %d reward %.3f %s",
                step,
                sum(rewards) / len(rewards),
                {k: round(v, 4) for k, v in metrics.items()},
            )
            curve.append((step, rl_seconds, evaluate(step, rl_seconds)))
    if curve[-1][0] != step:
        curve.append((step, rl_seconds, evaluate(step, rl_seconds)))
    start, best = curve[0][2], max(c[2] for c in curve)
    with torch.no_grad():
        change = sum(float((p - initial[n]).float().pow(2).sum()) for n, p in model.named_parameters()) ** 0.5
    summary = {
        "start_eval_reward": start,
        "final_eval_reward": curve[-1][2],
        "best_eval_reward": best,
        "gain_points": round(100 * (curve[-1][2] - start), 1),
        "steps": step,
        "final_train_reward": last.get("train_reward"),
        "final_loss": last.get("loss"),
        "param_change": change,
        "rl_s": round(rl_seconds, 1),
        "s_per_step": round(rl_seconds / max(1, step), 3),
        "wall_s": round(time.monotonic() - started, 1),
        "settings": {k: str(v) for k, v in vars(args).items()},
    }
    if args.save_dir:
        save_policy(model, tokenizer, args.save_dir)
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
