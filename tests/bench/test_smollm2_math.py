"""examples/smollm2_math.toml stays a valid run file, and bench/vs_trl.py's SmolLM2 comparison takes its settings
from it (the pure parts: defaults, wall-clock stop, seconds per step, and the prompts TRL sees). No process started."""

from __future__ import annotations

from itertools import islice
from pathlib import Path

import pytest

from bench._offline_eval import run_task
from bench.vs_trl import (
    COMPARISONS,
    TrlUnavailable,
    apply_defaults,
    eval_prompt_count,
    example_config,
    parse_args,
    past_wall,
    prompt_text,
    rlbus_overrides,
    s_per_step,
    trl_micro_batch,
)
from services.launcher.cli import resolve_target
from services.launcher.runfile import RunFile
from services.lib.engine.config import AutoEngineConfig
from services.tasks import get_task
from services.tasks.models import model_params

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "smollm2_math.toml"


def test_the_example_loads_and_names_its_services():
    assert Path(resolve_target("smollm2_math")) == EXAMPLE  # `rlbus run smollm2_math` finds it
    runfile = RunFile.load(EXAMPLE, env={})
    runfile.check()  # the rules between sections hold for its layout
    assert runfile.launcher.services == {"trainer": 1, "rollout": 1, "judge": 1, "weightsync": 1}
    assert runfile.run.id == "smollm2_math" and runfile.run.dir == "runs/smollm2_math"
    model, cfg = runfile.model, runfile.services.trainer
    assert (model.name, runfile.task.name, model.dtype) == ("smollm2", "word_problems", "bfloat16")
    # it learns within its 30-minute budget: a wall-clock stop, evaluations on the way, the task's prompts
    assert 0 < cfg.max_wall_s <= 1800 and cfg.eval.every > 0 and cfg.eval.prompts > 0
    assert len(run_task(runfile).eval_prompts()) >= cfg.eval.prompts
    # the faster engine for the model: auto picks vLLM for SmolLM2 (134.5 M parameters) where vLLM is installed
    engine = runfile.services.rollout.engine
    assert isinstance(engine, AutoEngineConfig) and engine.picks_vllm(model_params(model.name))
    assert runfile.services.judge.concurrency >= 1


def test_vs_trl_smollm2_takes_every_matched_setting_from_the_example():
    comp = COMPARISONS["smollm2"]
    assert comp.example == EXAMPLE
    runfile = example_config(comp.example, comp)
    assert runfile == RunFile.load(EXAMPLE, env={})  # the example as the launcher reads it, defaults filled in
    assert (runfile.model.name, runfile.task.name) == (comp.model, comp.task)
    # the tiny comparison refuses this example: the bench would compare other models than it says
    with pytest.raises(TrlUnavailable, match="addition with model tiny-addition"):
        example_config(comp.example, COMPARISONS["tiny"])
    # and its own example the other way round
    assert example_config(COMPARISONS["tiny"].example).model.name == "tiny-addition"
    with pytest.raises(TrlUnavailable, match="word_problems with model smollm2"):
        example_config(COMPARISONS["tiny"].example, comp)


def test_defaults_per_model_and_quick():
    tiny = parse_args([])
    assert apply_defaults(tiny) is COMPARISONS["tiny"]
    assert (tiny.steps, tiny.eval_every, tiny.eval_prompts, tiny.trl_threads, tiny.max_wall_s) == (200, 10, 200, 1, 0)
    quick = parse_args(["--quick"])
    apply_defaults(quick)
    assert (quick.steps, quick.eval_every, quick.eval_prompts) == (8, 4, 50)

    small = parse_args(["--model", "smollm2"])
    comp = apply_defaults(small)
    assert (small.steps, small.eval_every, small.trl_threads) == (30, 10, 2)
    cfg = example_config(comp.example, comp).services.trainer
    assert eval_prompt_count(small, cfg) == cfg.eval.prompts  # 0: the example's held-out set size
    explicit = parse_args(["--model", "smollm2", "--quick", "--steps", "7", "--eval-prompts", "9",
                           "--max-wall-s", "120", "--trl-threads", "1"])
    apply_defaults(explicit)
    assert (explicit.steps, explicit.eval_every, explicit.eval_prompts, explicit.trl_threads) == (7, 3, 9, 1)
    assert eval_prompt_count(explicit, cfg) == 9
    with pytest.raises(ValueError):
        apply_defaults(parse_args(["--steps", "0"]))


def test_rlbus_side_gets_the_same_budget_wall_and_eval_set():
    args = parse_args(["--model", "smollm2", "--steps", "12", "--max-wall-s", "300", "--eval-every", "4"])
    comp = apply_defaults(args)
    cfg = example_config(comp.example, comp).services.trainer
    over = rlbus_overrides(args, cfg)
    assert over["services.trainer.total_steps"] == 12
    assert over["services.trainer.max_wall_s"] == 300.0
    assert over["services.trainer.eval.every"] == 4
    assert over["services.trainer.eval.prompts"] == cfg.eval.prompts
    assert over["services.trainer.checkpoint_every"] == 0
    # the tiny comparison as before: the sample budget alone ends the run, its own eval size
    tiny = parse_args([])
    apply_defaults(tiny)
    assert rlbus_overrides(tiny)["services.trainer.max_wall_s"] == 0.0
    assert rlbus_overrides(tiny)["services.trainer.eval.prompts"] == 200


def test_wall_clock_stop_and_seconds_per_step():
    assert not past_wall(10_000.0, 0.0)  # 0: no wall-clock budget
    assert not past_wall(299.9, 300.0)
    assert past_wall(300.0, 300.0) and past_wall(301.0, 300.0)
    assert s_per_step([]) == 0.0 and s_per_step([12.0]) == 0.0
    # the first step (pipeline fill, model warm-up) is left out: (40 - 10) / 3
    assert s_per_step([10.0, 20.0, 30.0, 40.0]) == 10.0
    assert s_per_step([5.0, 6.5]) == 1.5


def test_trl_micro_batches_follow_the_example():
    assert trl_micro_batch("tiny", 128, 64) == 128  # the tiny model: one pass per batch, as the bench always ran
    assert trl_micro_batch("smollm2", 32, 8) == 8  # 4 passes of gradient accumulation, one optimiser step
    assert trl_micro_batch("smollm2", 32, 64) == 32
    assert trl_micro_batch("smollm2", 32, 12) == 32  # does not divide the batch: whole batch


def test_trl_sees_the_same_prompt_tokens_as_rlbus_on_smollm2():
    from transformers import AutoTokenizer

    from services.tasks.smollm2 import find_smollm2_gguf

    gguf = find_smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    task = get_task("word_problems")
    prompts = list(islice(task.train_prompts(0), 20)) + task.eval_prompts()[:20]
    for p in prompts:
        text = prompt_text(tokenizer, task, p)
        assert tokenizer(text)["input_ids"] == task.format_prompt(tokenizer, p)
        assert text.endswith("<|im_start|>assistant\n") and p.text in text
