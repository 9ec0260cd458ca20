"""Evaluate a model on a task's prompts with plain ``model.generate`` (no bus).

Used by the single-process reference loop, the tiny model's warm-up check and
benchmarks that compare against other tools; the services evaluate through the
rollout engine instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from services.tasks.base import Prompt, Task


@torch.no_grad()
def generate_completions(
    model: Any,
    tokenizer: Any,
    prompt_ids: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    batch_size: int = 256,
) -> tuple[list[list[int]], list[list[float]]]:
    """Sample one completion per prompt; return ``(token ids, behaviour logprobs)`` per completion.

    Prompts are left-padded per batch. Completions end at (and include) EOS, or
    stop at ``max_new_tokens``. Logprobs are of the sampled tokens under the
    sampling distribution (logits / temperature, no top-k/top-p).
    """
    device = next(model.parameters()).device
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    completions: list[list[int]] = []
    logprobs: list[list[float]] = []
    for lo in range(0, len(prompt_ids), batch_size):
        chunk = [list(p) for p in prompt_ids[lo : lo + batch_size]]
        width = max(len(p) for p in chunk)
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk], device=device)
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device)
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            do_sample=True,
            temperature=temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos,
            pad_token_id=pad,
            output_scores=True,
            return_dict_in_generate=True,
        )
        new_tokens = out.sequences[:, width:]
        # out.scores: one [B, V] tensor per step, already divided by the temperature.
        step_logprobs = torch.stack([torch.log_softmax(s.float(), dim=-1) for s in out.scores], dim=1)
        token_logprobs = step_logprobs.gather(2, new_tokens.unsqueeze(-1)).squeeze(-1)
        for row, row_lp in zip(new_tokens.tolist(), token_logprobs.tolist(), strict=True):
            length = row.index(eos) + 1 if eos in row else len(row)
            completions.append(row[:length])
            logprobs.append(row_lp[:length])
    return completions, logprobs


def evaluate_task(
    model: Any,
    tokenizer: Any,
    task: Task,
    prompts: Sequence[Prompt] | None = None,
    *,
    samples_per_prompt: int = 1,
    temperature: float = 1.0,
    max_new_tokens: int | None = None,
) -> float:
    """Mean reward of sampled completions on ``prompts`` (default: the task's eval split)."""
    prompts = list(task.eval_prompts() if prompts is None else prompts)
    repeated = [p for p in prompts for _ in range(samples_per_prompt)]
    ids = [task.format_prompt(tokenizer, p) for p in repeated]
    was_training = model.training
    model.eval()
    completions, _ = generate_completions(
        model, tokenizer, ids, max_new_tokens=max_new_tokens or task.max_new_tokens, temperature=temperature
    )
    model.train(was_training)
    texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
    rewards = [task.reward(p, t).value for p, t in zip(repeated, texts, strict=True)]
    return sum(rewards) / max(1, len(rewards))
