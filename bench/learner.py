"""The learner near the machine's limit: the SmolLM2 learner step's achieved FLOP/s against the measured peak
GEMM FLOP/s of the same cores, bf16 and fp32, with the profile of the rest and the levers measured side by side.

1. **Peak.** ``torch.matmul`` at the model's own GEMM shapes (tokens x hidden x intermediate, hidden x
   hidden, intermediate x hidden, completion tokens x hidden x vocabulary), bf16 and fp32, on ``--threads``
   threads; the peak of a dtype is its fastest shape (median of ``--gemm-repeats`` timings). The machine is
   shared and its load moves, so the fastest shape is timed again just before and after every timed step,
   and each side's fraction of peak is taken against the mean of its own probes.
2. **The step.** The trainer's own :class:`~services.trainer.learner.Learner` (``examples/smollm2_math.toml``'s
   ``[services.trainer]``, ``micro_batch_size`` 8 so the batch is one pass, ``max_new_tokens`` 512) steps
   (forward + backward + AdamW) on one group of 8 sequences at the long-tail workload's shapes: prompts of
   ~100 tokens, completions of heavy-tailed (log-normal) lengths up to 512 tokens, printed with the figures.
3. **FLOPs** (the model's, whatever the layout computes)::

       flops = 6 * N_body * T  +  6 * V * H * C  +  6 * n_layers * d_attn * sum_i L_i^2 / ... (causal: see below)

   with ``N_body`` the parameters outside the (tied) embedding / LM head, ``T`` every token of every sequence
   (prompt + completion), ``V * H`` the LM head, ``C`` the completion tokens (the only logits the loss needs),
   ``L_i`` sequence i's length and ``d_attn = heads * head_dim``: attention's QK^T and AV are ``2 * L^2 * d``
   FLOPs each forward, half of it under the causal mask, times 3 for forward + backward:
   ``6 * n_layers * d_attn * L_i^2 / 2 * 2 = 6 * n_layers * d_attn * L_i^2``. ``executed`` applies the same
   formula to what a layout computes (padded rows, logits at every kept position, attention over whole rows or
   per packed sequence and row tail).
   Achieved FLOP/s = flops / step time; the headline is its fraction of the dtype's peak.
4. **Sides** (same batches, ``--warmup`` untimed rounds then ``--steps`` timed ones):

   * ``padded``: right-padded rows, logits from the shortest prompt's last token on (the trainer before
     packing, ``optim.packing = false``);
   * ``packed-all-logits``: packed rows (:mod:`services.lib.packing`) but logits at every position: the
     lever "logits only for completion tokens" is this side against ``packed``;
   * ``packed-plain-logsoftmax``: as ``packed`` with the unchunked float32 ``log_softmax`` + gather instead of
     the chunked one (:func:`services.lib.model_io.token_logprobs`): the log-softmax lever;
   * ``packed-masked-attention``: as ``packed`` with transformers' ``sdpa`` attention over each whole row under
     a block-diagonal mask instead of once per packed sequence: the ``optim.varlen_attention`` lever;
   * ``packed``: packed rows, logits only where a completion token is predicted, attention per packed
     sequence (``optim.packing`` and ``optim.varlen_attention``, the defaults).

   bf16 runs every side, fp32 ``packed`` (its fraction of the fp32 peak; each SmolLM2 step costs minutes
   on two shared cores, so the levers are measured in bf16 only), each dtype's sides on one Learner,
   interleaved round by round. Before bf16's rounds, ``padded``'s and ``packed``'s bf16 logprobs of the first
   batch (no gradient) are compared with the float32 model's (``logprob_error_vs_fp32``): the layouts compute
   the same thing, so their errors are bf16's own (fp32's exactness: ``tests/trainer/test_packing.py``).
   Ratios: step time over step time, and ``*_load_normalised``: fraction of peak over fraction of peak (every
   side does the same useful FLOPs, and each fraction is against the GEMM rate probed around its own steps).
5. **Profile.** Phases of every step (model forward, optimiser, the rest: log-softmax, loss, backward), and
   one more step of bf16 ``packed`` under ``torch.profiler``: self CPU time by
   kind of op (GEMMs, attention, log-softmax family, dtype casts, optimiser, the rest) and the top ops; and
   the GEMMs' own rate (the GEMM FLOPs the layout executes / time in GEMM ops).

    .venv/bin/python bench/learner.py                 (SmolLM2-135M; several minutes)
    .venv/bin/python bench/learner.py --quick         (the tiny model, small shapes: seconds)

The machine is shared and noisy: compare ratios within one invocation. Progress goes to stderr; the last
stdout line is one JSON object of the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import random
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from proto.rollouts import Rollout, Turn  # noqa: E402
from proto.trajectories import ScoredTrajectory  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "smollm2_math.toml"
#: (name, packing, logits at every position, unchunked log-softmax, attention over whole rows under a mask)
SIDES: dict[str, tuple[bool, bool, bool, bool]] = {
    "padded": (False, False, False, False),
    "packed-all-logits": (True, True, False, False),
    "packed-plain-logsoftmax": (True, False, True, False),
    "packed-masked-attention": (True, False, False, True),
    "packed": (True, False, False, False),
}
FP32_SIDES = ("packed",)
PROFILED = ("packed",)
GOAL = 0.40
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
log = logging.getLogger("rlbus.bench.learner")


# --- the batch ------------------------------------------------------------------------------------------


def completion_lengths(n: int, median: float, limit: int, rng: random.Random) -> list[int]:
    """``n`` heavy-tailed (log-normal, sigma 1) completion lengths, at least 1, capped at ``limit``; the longest
    is set to ``limit`` (a long-tail batch always has a completion at the token limit)."""
    lengths = [max(1, min(limit, int(rng.lognormvariate(math.log(median), 1.0)))) for _ in range(n)]
    lengths[lengths.index(max(lengths))] = limit
    return lengths


def make_batch(shape: dict[str, Any], vocab: int, eos: int, step: int) -> list[ScoredTrajectory]:
    """One group: ``shape["sequences"]`` prompts of ~``prompt`` tokens with completions of ``lengths``, random
    token ids (a learner's cost does not depend on which tokens), rewards mixing 1 and 0."""
    rng = random.Random(1000 + step)
    out = []
    for i, n in enumerate(shape["lengths"]):
        prompt = [rng.randrange(3, vocab) for _ in range(shape["prompt"] + rng.randint(-8, 8))]
        ids = [rng.randrange(3, vocab) for _ in range(n - 1)] + [eos]
        turn = Turn(role="assistant", token_ids=ids, logprobs=[-rng.uniform(0.01, 2.5) for _ in ids],
                    versions=[0] * len(ids), text="")
        rollout = Rollout(run_id="bench", task="long_tail", group_id=f"s{step}", prompt_id=f"p{step}",
                          sample_index=i, group_size=len(shape["lengths"]), prompt_ids=prompt, turns=[turn],
                          finish_reason="length" if n == shape["limit"] else "eos", policy_version=0)
        out.append(ScoredTrajectory(run_id="bench", rollout=rollout, reward=float(i % 2)))
    return out


# --- FLOPs ----------------------------------------------------------------------------------------------


def model_dims(model: Any) -> dict[str, int]:
    cfg = model.config
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    outside = embed.numel() + (0 if head is embed else head.numel())
    return {"params": sum(p.numel() for p in model.parameters()),
            "body_params": sum(p.numel() for p in model.parameters()) - outside,
            "head_params": head.numel(), "layers": int(cfg.num_hidden_layers), "hidden": int(cfg.hidden_size),
            "intermediate": int(cfg.intermediate_size), "vocab": int(cfg.vocab_size),
            "d_attn": int(cfg.num_attention_heads) * head_dim}


def flops(dims: dict[str, int], tokens: int, logits: int, attention_sq: int) -> dict[str, float]:
    """The formula of the module docstring: body, LM head, attention (forward + backward)."""
    body = 6.0 * dims["body_params"] * tokens
    head = 6.0 * dims["head_params"] * logits
    attn = 6.0 * dims["layers"] * dims["d_attn"] * attention_sq
    return {"body": body, "head": head, "attention": attn, "total": body + head + attn}


def layout(side: str, prompts: list[int], completions: list[int], heads_x_dim: int) -> dict[str, int]:
    """What a side's layout computes: rows x width tokens, logit positions, sum of squared row widths."""
    from services.lib.packing import pack_rows, packed_position_ids, per_sequence_pays, sequence_spans

    packing, all_logits, _, masked = SIDES[side]
    lengths = [p + c for p, c in zip(prompts, completions, strict=True)]
    width = max(lengths)
    if packing:
        rows = pack_rows(lengths, width)
        logits = len(rows) * width if all_logits else sum(completions)
        # per sequence (the spans the learner's attention finds: each sequence and each row's unused tail) or
        # the whole row under a mask: the learner takes the first only where it pays (per_sequence_pays)
        spans = sequence_spans(packed_position_ids(lengths, rows, width))
        per_sequence = sum((e - s) ** 2 for row in spans for s, e in row)
        whole_rows = masked or not per_sequence_pays(spans, width, heads_x_dim)
        return {"rows": len(rows), "width": width, "tokens": len(rows) * width, "logits": logits,
                "attention_sq": len(rows) * width * width if whole_rows else per_sequence,
                "attention": "whole rows, masked" if whole_rows else "per sequence"}
    keep_cols = width - (min(prompts) - 1)
    return {"rows": len(lengths), "width": width, "tokens": len(lengths) * width,
            "logits": len(lengths) * (width if all_logits else keep_cols), "attention_sq": len(lengths) * width * width}


# --- peak GEMM ------------------------------------------------------------------------------------------


def gemm_rate(shape: tuple[int, int, int], dtype: torch.dtype, min_s: float) -> float:
    """GFLOP/s of ``torch.matmul`` of ``[m, k] x [k, n]`` over at least ``min_s`` seconds."""
    m, k, n = shape
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    torch.matmul(a, b)
    reps, t0 = 0, time.perf_counter()
    while reps == 0 or time.perf_counter() - t0 < min_s:
        torch.matmul(a, b)
        reps += 1
    return 2.0 * m * k * n * reps / (time.perf_counter() - t0) / 1e9


def gemm_peak(dims: dict[str, int], tokens: int, completion: int, dtype: torch.dtype, repeats: int,
              min_s: float) -> dict[str, Any]:
    """GFLOP/s of ``torch.matmul`` at the model's GEMM shapes; the peak is the fastest shape's median."""
    h, i, v = dims["hidden"], dims["intermediate"], dims["vocab"]
    shapes = {"tokens x hidden x intermediate": (tokens, h, i), "tokens x hidden x hidden": (tokens, h, h),
              "tokens x intermediate x hidden": (tokens, i, h), "completion x hidden x vocab": (completion, h, v)}
    rates = {name: float(f"{statistics.median(gemm_rate(mkn, dtype, min_s) for _ in range(repeats)):.4g}")
             for name, mkn in shapes.items()}
    best = max(rates, key=lambda k: rates[k])
    return {"gflops_by_shape": rates, "peak_gflops": rates[best], "peak_shape": list(shapes[best])}


# --- the sides ------------------------------------------------------------------------------------------


def plain_token_logprobs(logits: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                         *, chunk_positions: int | None = None) -> torch.Tensor:
    """The unchunked expression: float32 copies of the whole vocabulary-wide logits, log_softmax, gather."""
    batch = torch.arange(rows.shape[0], device=rows.device).unsqueeze(1)
    x = logits[batch, rows].float() / temperature
    return torch.log_softmax(x, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


@contextlib.contextmanager
def side_patches(learner: Any, side: str) -> Iterator[None]:
    """The side's layout on ``learner``: packed or padded (the learner's own switch, ``optim.packing``); with
    ``all_logits`` the model computes logits at every position (then keeps what was asked for); ``plain``: the
    unchunked log-softmax in place of :func:`services.lib.model_io.token_logprobs`."""
    from services.lib import model_io, packing
    from services.lib.packing import packed_sequence_logprobs

    packed, all_logits, plain, masked = SIDES[side]
    model = learner.model
    saved = model_io.token_logprobs, packing.token_logprobs, learner.logprobs
    attention = model.config._attn_implementation
    if masked:  # transformers' sdpa: a block-diagonal mask over each packed row
        model.set_attn_implementation("sdpa")
    learner.logprobs = packed_sequence_logprobs if packed else model_io.sequence_logprobs
    if all_logits:
        from transformers.modeling_utils import slice_logits_to_keep

        forward = model.forward

        def every_logit(*args: Any, logits_to_keep: Any = 0, **kwargs: Any) -> Any:
            out = forward(*args, logits_to_keep=0, **kwargs)
            if not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
                out.logits = slice_logits_to_keep(out.logits, logits_to_keep)
            return out

        model.forward = every_logit
    if plain:
        model_io.token_logprobs = packing.token_logprobs = plain_token_logprobs
    try:
        yield
    finally:
        model_io.token_logprobs, packing.token_logprobs, learner.logprobs = saved
        if masked:
            model.set_attn_implementation(attention)
        if all_logits:
            del model.forward


class PhaseTimer:
    """Wall time of the model's forward passes and of the optimiser's steps (hooks), per learner step; the
    rest of a step is the log-softmax, the loss, the backward and the bookkeeping."""

    def __init__(self, learner: Any) -> None:
        self.forward_s = self.optimiser_s = 0.0
        self._t = 0.0
        learner.model.register_forward_pre_hook(self._start)
        learner.model.register_forward_hook(lambda *_: self._stop("forward_s"))
        learner.optimizer.register_step_pre_hook(self._start)
        learner.optimizer.register_step_post_hook(lambda *_: self._stop("optimiser_s"))

    def _start(self, *_: Any) -> None:
        self._t = time.perf_counter()

    def _stop(self, what: str) -> None:
        setattr(self, what, getattr(self, what) + time.perf_counter() - self._t)

    def take(self) -> tuple[float, float]:
        out = self.forward_s, self.optimiser_s
        self.forward_s = self.optimiser_s = 0.0
        return out


def make_learner(model_dir: Path, dtype: str, threads: int) -> Any:
    from bench._rlbus_runs import example_run_file
    from services.trainer import devices
    from services.trainer.learner import Learner

    runfile = example_run_file(EXAMPLE, overrides=[
        "services.trainer.optim.micro_batch_size=8",
        "services.trainer.sampling.max_new_tokens=512", f"services.trainer.devices.num_threads={threads}"])
    cfg = runfile.services.trainer
    return Learner(cfg, model_dir, devices.resolve(cfg, dtype=dtype))


BUCKETS: list[tuple[str, tuple[str, ...]]] = [
    ("gemm", ("mm", "matmul", "linear", "mkldnn")),
    ("attention", ("attention", "sdpa")),
    ("optimiser", ("adam", "_foreach", "optimizer")),
    ("log-softmax family", ("logsumexp", "softmax", "gather", "scatter", "index", "exp")),
    ("dtype casts and copies", ("copy_", "_to_copy", "aten::to", "clone", "contiguous")),
]


def profile_step(learner: Any, batch: list[ScoredTrajectory], gemm_flops: float) -> dict[str, Any]:
    """Self CPU time of one step by kind of op (``BUCKETS``, first match), the top ops, the GEMMs' own rate."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        learner.step(batch)
    ops = [(e.key, e.self_cpu_time_total / 1e6) for e in prof.key_averages()]
    total = sum(s for _, s in ops) or 1.0
    buckets: dict[str, float] = {}
    for name, s in ops:
        low = name.lower()
        kind = next((b for b, subs in BUCKETS if any(x in low for x in subs)), "other (norms, activations, ...)")
        buckets[kind] = buckets.get(kind, 0.0) + s
    gemm_s = buckets.get("gemm", 0.0)
    return {"self_cpu_s": round(total, 3),
            "share": {k: round(v / total, 3) for k, v in sorted(buckets.items(), key=lambda kv: -kv[1])},
            "top_ops": [[n, round(s, 3)] for n, s in sorted(ops, key=lambda x: -x[1])[:10]],
            "gemm_gflops": round(gemm_flops / gemm_s / 1e9, 1) if gemm_s else None}


def side_figures(side: str, times: list[dict[str, float]], dims: dict[str, int], prompts: list[int],
                 completions: list[int], peak: float) -> dict[str, Any]:
    """A side's step time (median of its timed steps), phases, FLOPs and achieved fraction of ``peak``."""
    tokens = sum(prompts) + sum(completions)
    useful = flops(dims, tokens, sum(completions), sum((p + c) ** 2 for p, c in zip(prompts, completions, strict=True)))
    shape_of = layout(side, prompts, completions, dims["d_attn"])
    executed = flops(dims, shape_of["tokens"], shape_of["logits"], shape_of["attention_sq"])
    step_s = statistics.median(t["step_s"] for t in times)
    phases = {k: round(statistics.median(t[k] for t in times), 3) for k in ("forward_s", "optimiser_s")}
    phases["rest_s (log-softmax, loss, backward)"] = round(step_s - sum(phases.values()), 3)
    return {"step_s_median": round(step_s, 3), "step_s": [round(t["step_s"], 3) for t in times], "phases": phases,
            "layout": shape_of, "useful_tflop": round(useful["total"] / 1e12, 4),
            "executed_tflop": round(executed["total"] / 1e12, 4),
            "achieved_gflops": float(f"{useful['total'] / step_s / 1e9:.4g}"),
            "fraction_of_peak": float(f"{useful['total'] / step_s / 1e9 / peak:.4g}"),
            "executed_fraction_of_peak": float(f"{executed['total'] / step_s / 1e9 / peak:.4g}")}


def logprob_agreement(learner: Any, sides: tuple[str, ...], batch: list[ScoredTrajectory]) -> dict[str, Any]:
    """``padded`` and ``packed``'s logprobs of the batch's completion tokens (no gradient) against the same model
    in float32 (padded, no autocast): the largest and the mean absolute difference of each. Packing changes
    the layout, not the maths, so its error is of the size of the dtype's own."""
    from services.trainer.step_input import StepInput

    if not {"padded", "packed"} <= set(sides):
        return {}
    inp = StepInput.of(batch, learner.cfg)
    got = {}
    with torch.no_grad():
        for side in ("fp32", "padded", "packed"):
            with side_patches(learner, "padded" if side == "fp32" else side), \
                    (contextlib.nullcontext() if side == "fp32" else learner._autocast()):
                got[side], mask = learner.logprobs(learner.model, inp.prompts, inp.completions,
                                                   completion_masks=inp.masks, pad_token_id=learner.pad_id,
                                                   temperature=learner.cfg.sampling.temperature)
    out = {}
    for side in ("padded", "packed"):
        diff = (got[side].float() - got["fp32"]).abs() * mask
        out[side] = {"max": round(float(diff.max()), 5), "mean": round(float(diff.sum() / mask.sum()), 5)}
    return out


def run_dtype(dtype: str, sides: tuple[str, ...], args: argparse.Namespace, model_dir: Path,
              dims: dict[str, int], batches: list[list[ScoredTrajectory]],
              peak_shape: tuple[int, int, int]) -> dict[str, dict[str, Any]]:
    """Every side of ``dtype`` on one Learner, interleaved: ``--warmup`` rounds, then ``--steps`` timed rounds,
    each round every side once (the order reversed every other round: the machine is shared). Around every
    timed step the GEMM rate at the peak's shape is measured again (the machine's load moves): a side's
    fraction of peak is taken against the mean of those probes."""
    learner = make_learner(model_dir, dtype, args.threads)
    timer = PhaseTimer(learner)
    times: dict[str, list[dict[str, float]]] = {s: [] for s in sides}
    diff = logprob_agreement(learner, sides, batches[0]) if dtype == "bfloat16" else {}
    for k in range(args.warmup + args.steps):
        for side in (sides if k % 2 == 0 else tuple(reversed(sides))):
            with side_patches(learner, side):
                before = gemm_rate(peak_shape, DTYPES[dtype], args.gemm_min_s) if k >= args.warmup else 0.0
                timer.take()
                t0 = time.perf_counter()
                learner.step(batches[k % len(batches)])
                dt = time.perf_counter() - t0
                fwd, opt = timer.take()
                after = gemm_rate(peak_shape, DTYPES[dtype], args.gemm_min_s) if k >= args.warmup else 0.0
            if k >= args.warmup:
                times[side].append({"step_s": dt, "forward_s": fwd, "optimiser_s": opt,
                                    "peak_gflops": (before + after) / 2})
            log.info("%s/%s round %d: %.2f s (forward %.2f, optimiser %.2f)", dtype, side, k, dt, fwd, opt)
    prompts = [len(t.rollout.prompt_ids) for t in batches[0]]
    completions = [sum(len(turn.token_ids) for turn in t.rollout.turns) for t in batches[0]]
    out = {}
    for side in sides:
        peak = statistics.mean(t["peak_gflops"] for t in times[side])
        out[side] = side_figures(side, times[side], dims, prompts, completions, peak)
        out[side]["peak_gflops_around_steps"] = float(f"{peak:.4g}")
        if side in diff:
            out[side]["logprob_error_vs_fp32"] = diff[side]
        if dtype == "bfloat16" and side in PROFILED and not args.no_profile:
            executed = flops(dims, out[side]["layout"]["tokens"], out[side]["layout"]["logits"], 0)
            with side_patches(learner, side):
                out[side]["profile"] = profile_step(learner, batches[0], executed["total"])
    del learner
    return out


def bench(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from services.tasks.models import resolve_model

    torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    with torch.device("meta"):  # the shapes only: no memory
        dims = model_dims(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir)))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(args.seed)
    shape = {"sequences": args.sequences, "prompt": args.prompt, "limit": args.limit,
             "lengths": completion_lengths(args.sequences, args.median, args.limit, rng)}
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 2
    batches = [make_batch(shape, dims["vocab"], eos, s) for s in range(2)]
    prompts = [len(t.rollout.prompt_ids) for t in batches[0]]
    tokens = sum(prompts) + sum(shape["lengths"])
    log.info("model %s, %s; completions %s", args.model, dims, shape["lengths"])
    dtypes = DTYPES
    peaks = {name: gemm_peak(dims, tokens, sum(shape["lengths"]), dt, args.gemm_repeats, args.gemm_min_s)
             for name, dt in dtypes.items()}
    log.info("peak GEMM: %s", {k: v["peak_gflops"] for k, v in peaks.items()})
    sides: dict[str, dict[str, Any]] = {}
    for dtype in dtypes:
        names = tuple(s for s in SIDES if s in args.sides) if dtype == "bfloat16" else FP32_SIDES
        if dtype == "float32" and args.no_fp32:
            continue
        for side, figures in run_dtype(dtype, names, args, model_dir, dims, batches,
                                       tuple(peaks[dtype]["peak_shape"])).items():
            sides[f"{dtype}/{side}"] = figures
    bf = {k.split("/", 1)[1]: v for k, v in sides.items() if k.startswith("bfloat16/")}
    best = max(bf, key=lambda k: bf[k]["fraction_of_peak"])

    def speedup(a: str, b: str) -> float | None:
        if a not in sides or b not in sides:
            return None
        return round(sides[a]["step_s_median"] / sides[b]["step_s_median"], 3)

    ratios = {"bf16_packed_speedup_over_padded": speedup("bfloat16/padded", "bfloat16/packed"),
              "bf16_completion_logits_speedup": speedup("bfloat16/packed-all-logits", "bfloat16/packed"),
              "bf16_chunked_logsoftmax_speedup": speedup("bfloat16/packed-plain-logsoftmax", "bfloat16/packed"),
              "bf16_varlen_attention_speedup": speedup("bfloat16/packed-masked-attention", "bfloat16/packed"),
              "bf16_over_fp32_step_packed": speedup("float32/packed", "bfloat16/packed")}

    def normalised(a: str, b: str) -> float | None:  # the same useful FLOPs: the ratio of the fractions of peak
        if a not in sides or b not in sides:
            return None
        return round(sides[b]["fraction_of_peak"] / sides[a]["fraction_of_peak"], 3)

    ratios.update({f"{k}_load_normalised": normalised(*pair) for k, pair in (
        ("bf16_packed_speedup_over_padded", ("bfloat16/padded", "bfloat16/packed")),
        ("bf16_completion_logits_speedup", ("bfloat16/packed-all-logits", "bfloat16/packed")),
        ("bf16_chunked_logsoftmax_speedup", ("bfloat16/packed-plain-logsoftmax", "bfloat16/packed")),
        ("bf16_varlen_attention_speedup", ("bfloat16/packed-masked-attention", "bfloat16/packed")))})
    lengths = shape["lengths"]
    return {"bench": "learner", "model": args.model, "threads": args.threads, "dims": dims,
            "batch": {"sequences": len(lengths), "prompt_tokens": prompts, "completion_tokens": lengths,
                      "completion_mean": round(sum(lengths) / len(lengths), 1),
                      "completion_median": statistics.median(lengths), "completion_max": max(lengths),
                      "tokens": tokens},
            "flops_formula": "6*N_body*T + 6*V*H*C + 6*n_layers*d_attn*sum(L_i^2) (causal attention: "
                             "QK^T and AV 2*L^2*d each, halved, x3 forward+backward)",
            "peak": peaks, "sides": sides, "ratios": ratios,
            "goal": {"bf16_best_side": best, "bf16_fraction_of_peak": bf[best]["fraction_of_peak"],
                     "goal": GOAL, "met": bf[best]["fraction_of_peak"] >= GOAL}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the tiny model at small shapes, one step a side (seconds)")
    p.add_argument("--model", default="smollm2", help="builtin model or Hugging Face directory")
    p.add_argument("--threads", type=int, default=2, help="torch threads (the machine's cores)")
    p.add_argument("--sequences", type=int, default=8)
    p.add_argument("--prompt", type=int, default=100, help="prompt tokens (each +-8)")
    p.add_argument("--median", type=float, default=80.0, help="median completion tokens (log-normal, sigma 1)")
    p.add_argument("--limit", type=int, default=512, help="the completion token limit (the longest has it)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--gemm-repeats", type=int, default=3)
    p.add_argument("--gemm-min-s", type=float, default=0.5, help="seconds per GEMM timing")
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--sides", default=",".join(SIDES), help="bf16 sides to run, comma-separated")
    p.add_argument("--no-fp32", action="store_true", help="skip the fp32 step")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.sides = [x for x in args.sides.split(",") if x]
    if unknown := [x for x in args.sides if x not in SIDES]:
        p.error(f"--sides: unknown {unknown}; choose from {list(SIDES)}")
    if args.quick:
        args.model, args.prompt, args.median, args.limit = "tiny-addition", 12, 6.0, 24
        args.sequences, args.warmup, args.steps, args.gemm_repeats, args.gemm_min_s = 4, 0, 1, 1, 0.02
        args.threads = 1  # a tiny model's step is mostly dispatch: one thread, no barriers to wait on
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    print(json.dumps(bench(args)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
