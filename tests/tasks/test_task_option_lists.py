"""Task options take lists where the task declares them (``reward = ["a", "b"]``, ``stop = [...]``), in the
run file's one ``[task]`` section (which trainer, rollout and judge all read), from a file, an ``RLBUS__``
variable or ``--set``; the comma form stays readable; a list for a one-value option, or a list of lists, is
refused naming the key."""

from __future__ import annotations

import pytest

from services.judge.config import JudgeConfig
from services.runtime.config import ConfigError, load_service_config
from services.tasks import get_task
from services.tasks.base import TaskOptionTypeError
from services.trainer.config import TrainerConfig

TOML = """
[task]
name = "dataset"
options = { path = "d.jsonl", reward = ["exact_match", "last_number"], reward_weights = [1, 2.5], stop = ["\\n", "."] }
"""


def test_list_options_from_a_file_reach_the_task_in_trainer_and_judge(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(TOML)
    trainer = load_service_config("trainer", TrainerConfig, path, env={}).task
    judge = load_service_config("judge", JudgeConfig, path, env={}).task
    assert trainer.options["reward"] == ["exact_match", "last_number"]
    for options in (trainer.options_for("dataset"), judge.options_for("dataset")):
        task = get_task("dataset", **options)
        assert task.reward_names == ["exact_match", "last_number"]
        assert task.reward_weights == [1.0, 2.5]
        assert task.reward_spec == "exact_match*1, last_number*2.5"
    assert get_task("dataset", **trainer.options).stop == ["\n", "."]
    assert judge.options_for("addition") == {}  # another task than the run's gets its own defaults


def test_lists_from_set_and_env_and_the_comma_form_give_the_same_task(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[task]\nname = "dataset"\noptions = { path = "d.jsonl" }\n')
    by_set = load_service_config("trainer", TrainerConfig, path, env={}, overrides=[
        'task.options.reward=["exact_match", "last_number"]']).task
    by_env = load_service_config("trainer", TrainerConfig, path, env={
        "RLBUS__TASK__OPTIONS__REWARD": '["exact_match", "last_number"]'}).task
    commas = get_task("dataset", path="d.jsonl", reward="exact_match, last_number")
    for cfg in (by_set, by_env):
        assert cfg.options["reward"] == ["exact_match", "last_number"]
        assert get_task("dataset", **cfg.options).reward_spec == commas.reward_spec


def test_a_list_for_a_one_value_option_is_refused_naming_the_key():
    with pytest.raises(TaskOptionTypeError, match=r"task\.options\.low: task 'addition' takes one value"):
        get_task("addition", low=[10, 20])
    assert get_task("addition", low=10, high=40).eval_prompts()  # one value: fine


def test_nested_lists_are_refused_by_the_config_naming_the_key(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[task]\noptions = { stop = [["a"]] }\n')
    with pytest.raises(ConfigError, match=r"task\.options.*expected `bool \| int \| float \| str`"):
        load_service_config("trainer", TrainerConfig, path, env={})
