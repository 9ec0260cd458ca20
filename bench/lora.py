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

``--loop``: instead, two real runs of the services (``rlbus run``: trainer, rollout, judge; the addition
task on the tiny model; store transport, anchors every 10 versions), one full fine-tuning and one with
``lora``, and from each the bytes of every stored weight version (the manifests the run's own JetStream
kept: anchors and deltas), the trainer's step and publish times (``time/step_s``, ``time/publish_s``)
and the held-out reward at the start and the end. The runs go one after the other.

Usage: ``python bench/lora.py [--steps 20] [--batch 128] [--r 8] [--hidden 128] [--lr 1e-4]``
       ``python bench/lora.py --loop [--steps 60] [--r 8] [--lr 1e-4] [--lora-lr 1e-3] [--out DIR]``
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


def loop_run_file(run_id: str, run_dir: Path, steps: int, lr: float, lora: dict | None, cache_dir: str) -> str:
    """The run file of one ``--loop`` run (TOML): the addition task on the tiny model, ``lora`` (None: full
    fine-tuning) at learning rate ``lr``, the store transport with an anchor every 10 versions."""
    trainer = f'groups_per_step = 16\ngroup_size = 8\ntotal_steps = {steps}\nmax_staleness = 1\ncheckpoint_every = 0\n'
    if lora is not None:
        trainer += "lora = { " + ", ".join(f"{k} = {v}" for k, v in lora.items()) + " }\n"
    trainer += (f'optim = {{ lr = {lr} }}\nsampling = {{ max_new_tokens = 6 }}\n'
                'eval = { every = 0, prompts = 200, samples = 2 }\ndevices = { num_threads = 1 }\n')
    return (f'[run]\nid = "{run_id}"\ndir = "{run_dir}"\n[launcher]\n'
            'services = { trainer = 1, rollout = 1, judge = 1 }\n'
            f'[model]\nname = "tiny-addition"\ncache_dir = "{cache_dir}"\n[task]\nname = "addition"\n'
            '[weights]\ntype = "store"\nencoding = { anchor_every = 10 }\n'
            f'[services.trainer]\n{trainer}[services.rollout]\nmax_tickets = 32\n'
            'engine = { type = "torch", max_batch_size = 128, num_threads = 1 }\n')


def loop_run(out: Path, name: str, steps: int, lr: float, lora: dict | None, cache_dir: str,
             reuse: bool = False) -> dict:
    """One ``rlbus run`` of the addition task; its stored version sizes, step/publish times and rewards."""
    import asyncio
    import subprocess

    run_id = f"lorabench-{name}"
    run_dir = out / name
    cfg = out / f"{name}.toml"
    cfg.write_text(loop_run_file(run_id, run_dir, steps, lr, lora, cache_dir))
    t0 = time.perf_counter()
    reused = reuse and (run_dir / "summary.json").is_file()
    if not reused:
        done = subprocess.run([sys.executable, "-m", "services.launcher.cli", "run", str(cfg)], capture_output=True,
                              text=True, cwd=Path(__file__).resolve().parents[1])
        if done.returncode != 0:
            raise SystemExit(f"the {name} run failed:\n{done.stderr[-3000:]}")
    wall = None if reused else round(time.perf_counter() - t0, 1)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps_s = [r["time/step_s"] for r in records if "time/step_s" in r][1:]
    publish_s = [r["time/publish_s"] for r in records if "time/publish_s" in r][1:]
    evals = [r["eval/reward"] for r in records if "eval/reward" in r]
    kinds = asyncio.run(_stored_sizes(run_dir, run_id))
    every = kinds["full"] + kinds["delta"]
    # the publisher sends an anchor where a delta would not be smaller, so a run may store no delta at all
    return {"bytes_per_version": int(statistics.mean(every)), "anchor_bytes": int(statistics.median(kinds["full"])),
            "delta_bytes": int(statistics.median(kinds["delta"])) if kinds["delta"] else None,
            "anchors": len(kinds["full"]), "deltas": len(kinds["delta"]), "step_s": round(statistics.median(steps_s), 4),
            "publish_s": round(statistics.median(publish_s), 4), "eval_start": evals[0], "eval_end": evals[-1],
            "wall_s": wall}


async def _stored_sizes(run_dir: Path, run_id: str) -> dict[str, list[int]]:
    """Blob bytes of every stored weight version of a finished run, by kind (from its own JetStream)."""
    import nats

    from services.lib.weights.index import VersionIndex
    from services.runtime.natsd import EmbeddedNats

    with EmbeddedNats(run_dir / "nats", port=None) as server:
        nc = await nats.connect(server.url)
        try:
            index = VersionIndex(nc, run_id)
            sizes: dict[str, list[int]] = {"full": [], "delta": []}
            for version in await index.versions():
                manifest = await index.manifest(version)
                if manifest is not None:
                    sizes[manifest.kind].append(manifest.blob_nbytes)
            return sizes
        finally:
            await nc.close()


def loop_main(args: argparse.Namespace) -> None:
    out = Path(args.out or tempfile.mkdtemp(prefix="rlbus-lora-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    lora = {"r": args.r, "alpha": float(2 * args.r)}
    runs = {"full": loop_run(out, "full", args.steps, args.lr, None, args.cache_dir, args.reuse),
            "lora": loop_run(out, "lora", args.steps, args.lora_lr, lora, args.cache_dir, args.reuse)}
    full, lo = runs["full"], runs["lora"]
    print(json.dumps({"bench": "lora-loop", "steps": args.steps, "lora": lora, "lr": args.lr,
                      "lora_lr": args.lora_lr, "runs": runs, "ratios": {
                          "bytes_per_version_lora_vs_full": round(lo["bytes_per_version"] / full["bytes_per_version"], 4),
                          "anchor_lora_vs_full": round(lo["anchor_bytes"] / full["anchor_bytes"], 4),
                          "step_lora_vs_full": round(lo["step_s"] / full["step_s"], 3),
                          "publish_lora_vs_full": round(lo["publish_s"] / full["publish_s"], 3)}}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--r", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=128, help="hidden size of the tiny Llama (128: the default model)")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--loop", action="store_true", help="two real runs of the services (full, LoRA) instead")
    ap.add_argument("--lora-lr", type=float, default=1e-3, help="--loop: the LoRA run's learning rate")
    ap.add_argument("--cache-dir", default="", help="--loop: where the tiny model is built (default: rlbus's cache)")
    ap.add_argument("--out", default="", help="--loop: directory of the two runs (default: a new temporary one)")
    ap.add_argument("--reuse", action="store_true", help="--loop: read runs already finished in --out again")
    args = ap.parse_args()
    if args.loop:
        loop_main(args)
        return
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
