"""LoRA vs full fine-tuning on the tiny model: bytes per weight version and optimiser step time.

Both learners start from the same model and take the same steps (supervised addition batches stand in
for GRPO batches: what is measured is the size of what changes and the cost of a step, not learning).
After every step the bench encodes what would travel for that version with the store transport's own
codec (``services/lib/weights/encoding.py``, bf16):

* ``full``: the whole state dict (an anchor);
* ``full_delta``: the sparse XOR delta from the previous version (what travels between anchors today);
* ``lora_adapter``: the adapter tensors alone (an anchor of the adapter), and ``lora_adapter_delta``;
* ``lora_merged_delta``: the delta of the merged full weights (what LoRA costs while engines cannot
  apply adapters themselves).

Step time: one forward + backward + AdamW step, configurations interleaved step by step so they share
the machine's load; medians. Ratios name LoRA over full. Last stdout line: one JSON object.

Usage: ``python bench/lora.py [--steps 20] [--batch 128] [--r 8] [--hidden 128] [--lr 1e-4]``
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.lib.weights.encoding import encode_delta, encode_full  # noqa: E402
from services.tasks.addition import AdditionTask  # noqa: E402
from services.tasks.tiny_model import build_char_tokenizer, build_tiny_model, warmup_batch  # noqa: E402
from services.trainer.lora import LoraConfig, adapter_state, apply_lora, merged_state  # noqa: E402


def bf16(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().to(torch.bfloat16).contiguous() for k, v in state.items()}


def step(model, optimizer, batch) -> float:
    input_ids, labels, mask = batch
    t0 = time.perf_counter()
    loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--r", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=128, help="hidden size of the tiny Llama (128: the default model)")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    tokenizer = build_char_tokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        build_tiny_model(tokenizer, seed=0, hidden_size=args.hidden).save_pretrained(tmp)
        from transformers import AutoModelForCausalLM

        full = AutoModelForCausalLM.from_pretrained(tmp)
        lora = apply_lora(AutoModelForCausalLM.from_pretrained(tmp), LoraConfig(r=args.r, alpha=2.0 * args.r))
    params = sum(p.numel() for p in full.parameters())
    adapter_params = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    full_opt = torch.optim.AdamW(full.parameters(), lr=args.lr)
    lora_opt = torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=args.lr)

    task = AdditionTask()
    stream = task.train_prompts(seed=3)

    def batch():
        input_ids, labels = warmup_batch(task, tokenizer, list(itertools.islice(stream, args.batch)))
        return input_ids, labels, (input_ids != tokenizer.pad_token_id).long()

    def layouts():
        return {"full": encode_full(bf16(full.state_dict())), "adapter": encode_full(bf16(adapter_state(lora))),
                "merged": encode_full(bf16(merged_state(lora)))}

    sizes: dict[str, list[int]] = {k: [] for k in ("full", "full_delta", "lora_adapter", "lora_adapter_delta",
                                                   "lora_merged_delta")}
    times: dict[str, list[float]] = {"full": [], "lora": []}
    previous = layouts()
    for i in range(args.steps):
        b = batch()
        order = [("full", full, full_opt), ("lora", lora, lora_opt)]
        for name, model, opt in (order if i % 2 == 0 else order[::-1]):
            times[name].append(step(model, opt, b))
        current = layouts()
        sizes["full"].append(len(current["full"].data))
        sizes["lora_adapter"].append(len(current["adapter"].data))
        for key, layout in (("full_delta", "full"), ("lora_adapter_delta", "adapter"), ("lora_merged_delta", "merged")):
            blob, _ = encode_delta(previous[layout].buf, current[layout].buf,
                                   current[layout].tensors)
            sizes[key].append(len(blob))
        previous = current

    bytes_per_version = {k: int(statistics.median(v)) for k, v in sizes.items()}
    step_s = {k: statistics.median(v[1:] or v) for k, v in times.items()}  # the first step warms caches
    result = {
        "bench": "lora", "model_params": params, "adapter_params": adapter_params, "r": args.r,
        "hidden": args.hidden, "steps": args.steps, "batch": args.batch, "lr": args.lr,
        "bytes_per_version": bytes_per_version,
        "step_s": {k: round(v, 4) for k, v in step_s.items()},
        "ratios": {
            "adapter_vs_full_anchor": round(bytes_per_version["lora_adapter"] / bytes_per_version["full"], 4),
            "adapter_delta_vs_full_delta": round(bytes_per_version["lora_adapter_delta"] / bytes_per_version["full_delta"], 4),
            "merged_delta_vs_full_delta": round(bytes_per_version["lora_merged_delta"] / bytes_per_version["full_delta"], 4),
            "step_lora_vs_full": round(step_s["lora"] / step_s["full"], 3),
        },
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
