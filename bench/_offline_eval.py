"""Evaluate an rlbus run after it finished, off its clock: the RL benches' ``offline`` evaluation.

In the loop the trainer evaluates through its own rollout engine, on the same cores as training, so an
evaluation round slows the run it measures (and an asynchronous run, which has no idle core to hide it
in, more than a synchronous one). Offline, the run evaluates nothing in the loop (:func:`offline_overrides`)
and checkpoints every ``eval_every`` steps, which :class:`bench._rlbus_runs.VersionKeeper` keeps
(``run_rlbus(..., keep_versions=True)``); after the run each kept version and the initial model are
evaluated here with :func:`held_out_reward` (``evaluate_task``: HF ``generate``, float32) and placed at the
trainer clock time of the step that made it (:func:`bench._rlbus_runs.offline_curve`). ``bench/vs_trl.py``
evaluates TRL's side with the same :func:`held_out_reward`, its clock stopped meanwhile.
"""

from __future__ import annotations

import json
import logging
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from bench._rlbus_runs import (
    KEPT_DIR,
    BenchRunError,
    EvalPoint,
    RunResult,
    checkpoint_cost,
    kept_versions,
    offline_curve,
    read_metrics,
)

log = logging.getLogger("rlbus.bench")


def offline_overrides(eval_every: int) -> dict[str, object]:
    """Config keys of an offline-evaluated run: no evaluation in the loop, a checkpoint every ``eval_every``
    steps. The trainer still evaluates at its start and end with ``eval.every = 0`` (no key turns that off),
    so those shrink to one prompt, one sample: the start round would otherwise compete with the first steps
    (the end round comes after the last step, off the clock)."""
    return {
        "services.trainer.eval.every": 0,
        "services.trainer.eval.prompts": 1,
        "services.trainer.eval.samples": 1,
        "services.trainer.checkpoint_every": eval_every,
    }


def held_out_reward(model: Any, tokenizer: Any, task: Any, eval_set: list[Any], cfg: Any) -> float:
    """One evaluation: ``evaluate_task`` (HF ``generate``) on ``eval_set``, ``cfg.eval.samples`` samples a
    prompt at ``cfg.eval.temperature``, the trainer's completion length (``cfg``: a ``TrainerConfig``, the
    run file's ``[services.trainer]``). Torch threads are the caller's."""
    from services.tasks.evaluate import evaluate_task

    return evaluate_task(model, tokenizer, task, eval_set, samples_per_prompt=cfg.eval.samples,
                         temperature=cfg.eval.temperature, max_new_tokens=cfg.sampling.max_new_tokens or task.max_new_tokens)


#: the script that generates with vLLM, run under the vLLM environment's interpreter
VLLM_EVAL = Path(__file__).with_name("_vllm_eval.py")
#: the most seconds one version's vLLM evaluation may take (start-up included)
VLLM_EVAL_TIMEOUT_S = 1800.0
#: rewards of vLLM evaluations made in this process, by request: every side of a bench evaluates the initial
#: model, and vLLM's per-prompt seeds make a repeated request's answer the same, so it is made once
_VLLM_SEEN: dict[tuple[Any, ...], float] = {}


def vllm_held_out_reward(model_dir: Path, tokenizer: Any, task: Any, eval_set: list[Any], cfg: Any, *,
                         seed: int, dtype: str = "bfloat16") -> float:
    """:func:`held_out_reward`'s figure with vLLM generating: the same prompts (``cfg.eval.samples`` a
    prompt), temperature and completion length, the completions scored here by the task's reward. vLLM
    runs in its own process under :func:`services.launcher.environments.vllm_python` (``bench/_vllm_eval.py``),
    which loads ``model_dir`` in ``dtype``.

    Raises:
        BenchRunError: vLLM failed, took over :data:`VLLM_EVAL_TIMEOUT_S`, or answered something else than one
            completion per prompt.
    """
    from services.launcher.environments import vllm_python

    repeated = [p for p in eval_set for _ in range(cfg.eval.samples)]
    key = (str(Path(model_dir).resolve()), tuple(p.id for p in repeated), cfg.eval.temperature,
           cfg.sampling.max_new_tokens or task.max_new_tokens, seed, dtype)
    if key in _VLLM_SEEN:  # prompt i is seeded seed + i: the same request gives the same completions
        log.info("vllm eval of %s: the same request as before, reward %.3f", Path(model_dir).name, _VLLM_SEEN[key])
        return _VLLM_SEEN[key]
    request = {"model": str(model_dir), "prompts": [list(task.format_prompt(tokenizer, p)) for p in repeated],
               "temperature": cfg.eval.temperature, "max_tokens": cfg.sampling.max_new_tokens or task.max_new_tokens,
               "seed": seed, "dtype": dtype}
    try:
        proc = subprocess.run([vllm_python(), str(VLLM_EVAL)], input=json.dumps(request), capture_output=True,
                              text=True, timeout=VLLM_EVAL_TIMEOUT_S, cwd=VLLM_EVAL.parents[1])
    except subprocess.TimeoutExpired as e:
        raise BenchRunError(f"vLLM evaluation of {model_dir} took over {VLLM_EVAL_TIMEOUT_S:.0f}s") from e
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        # the root cause is usually far above the last lines (vLLM's engine core prints it, then the client's
        # own traceback follows): the whole log is kept and named
        with tempfile.NamedTemporaryFile("w", prefix="rlbus-vllm-eval-", suffix=".log", delete=False) as f:
            f.write(proc.stderr)
        raise BenchRunError(f"vLLM evaluation of {model_dir} exited with {proc.returncode} (its whole log: "
                            f"{f.name}): {proc.stderr.strip()[-2000:]}")
    try:
        answer = json.loads(lines[-1])
    except json.JSONDecodeError as e:
        raise BenchRunError(f"vLLM evaluation of {model_dir}: not a JSON answer: {lines[-1][:200]!r}") from e
    completions = answer.get("completions") if isinstance(answer, dict) else None
    if not isinstance(completions, list) or len(completions) != len(repeated):
        raise BenchRunError(f"vLLM evaluation of {model_dir}: {len(repeated)} prompts, answer {str(answer)[:200]}")
    log.info("vllm eval of %s: load %.1fs, generate %.1fs", model_dir.name, answer["load_s"], answer["generate_s"])
    texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
    rewards = [task.reward(p, t).value for p, t in zip(repeated, texts, strict=True)]
    _VLLM_SEEN[key] = sum(rewards) / max(1, len(rewards))
    return _VLLM_SEEN[key]


def run_task(runfile: Any) -> Any:
    """The run file's ``[task]``, built with its options."""
    from services.tasks import get_task

    name = runfile.task.name
    return get_task(name, **runfile.task.options_for(name))


def evaluate_versions(runfile: Any, versions: dict[int, Path], *, eval_prompts: int, threads: int,
                      seed: int, engine: str = "hf") -> dict[int, float]:
    """``{step: reward}`` of model directories ``{step: dir}`` (step 0: the initial model) on the run file's
    ``[task]``'s first ``eval_prompts`` held-out prompts (0: all), with its ``[services.trainer]`` eval
    settings. ``engine`` "hf": each loaded in float32 and evaluated with :func:`held_out_reward` on
    ``threads`` torch threads, the torch RNG seeded once with ``seed``; "vllm": :func:`vllm_held_out_reward`
    (every core, prompt ``i`` seeded ``seed + i``)."""
    import torch

    from services.lib.model_io import load_policy

    if engine not in ("hf", "vllm"):
        raise ValueError(f"evaluation engine {engine!r}: expected 'hf' or 'vllm'")
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    cfg = runfile.services.trainer
    task = run_task(runfile)
    eval_set = task.eval_prompts()[: eval_prompts or None]
    rewards = {}
    for step, path in sorted(versions.items()):
        if engine == "vllm":
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
            rewards[step] = vllm_held_out_reward(path, tokenizer, task, eval_set, cfg, seed=seed)
        else:
            model, tokenizer = load_policy(path, "float32")
            rewards[step] = held_out_reward(model, tokenizer, task, eval_set, cfg)
            del model
        log.info("offline eval (%s) of step %d (%s): reward %.3f", engine, step, path.name, rewards[step])
    return rewards


def run_curve(r: RunResult, runfile: Any, model_dir: Path, *, eval_every: int, eval_prompts: int, threads: int,
              seed: int, engine: str = "hf") -> tuple[list[EvalPoint], dict[str, Any]]:
    """The run's curve from its kept versions (every ``eval_every``-th step and the last) and the initial
    model ``model_dir``, evaluated on ``runfile``'s task and eval settings (:func:`evaluate_versions`), placed at the steps' trainer clock times; and figures about it (checkpoint cost,
    offline eval time, versions the keeper missed)."""
    metrics = read_metrics(r.run_dir / "metrics.jsonl")
    done = [int(m["step"]) for m in metrics if "trainer/version" in m]
    last = max(done, default=0)
    kept = kept_versions(r.run_dir / KEPT_DIR)
    wanted = {s for s in done if s % eval_every == 0} | {last}
    versions = {0: model_dir, **{s: p for s, p in kept.items() if s in wanted}}
    missing = sorted(wanted - set(versions))
    if missing:
        log.warning("%s: versions of steps %s were pruned before the bench kept them", r.label, missing)
    t0 = time.monotonic()
    curve = offline_curve(metrics, evaluate_versions(runfile, versions, eval_prompts=eval_prompts, threads=threads,
                                                     seed=seed, engine=engine))
    writes = [v for s, v in r.checkpoint_write_s.items() if s < last]  # the last one is written after the clock
    return curve, {
        "eval_s_total": round(time.monotonic() - t0, 1),
        "versions_missing": missing,
        "checkpoint_write_s_mean": round(sum(writes) / len(writes), 3) if writes else None,
        **checkpoint_cost(metrics, eval_every),
    }
