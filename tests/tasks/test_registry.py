"""The task registry: built-ins, decorator registration, entry-point discovery, errors."""

from __future__ import annotations

import importlib
import sys
import textwrap

import pytest

from services.tasks import (
    Prompt,
    Reward,
    Task,
    TaskRegistrationError,
    UnknownTaskError,
    available_tasks,
    get_task,
    register_task,
)
from services.tasks import base as tasks_base


def test_builtins_are_registered_and_satisfy_the_protocol():
    assert {"addition", "word_problems"} <= set(available_tasks())
    for name in ("addition", "word_problems"):
        task = get_task(name)
        assert isinstance(task, Task)
        assert task.name == name


def test_options_reach_the_task():
    assert len(get_task("addition", num_eval=10).eval_prompts()) == 10


def test_unknown_name_lists_the_known_tasks():
    with pytest.raises(UnknownTaskError) as info:
        get_task("no-such-task")
    assert "no-such-task" in str(info.value)
    assert "addition" in str(info.value) and "word_problems" in str(info.value)


class _Echo:
    name = "echo-test"
    max_new_tokens = 4
    stop: list[str] = []

    def train_prompts(self, seed, start=0):
        while True:
            yield Prompt(id=str(start), text="x", metadata={"answer": "x"})
            start += 1

    def eval_prompts(self):
        return [Prompt(id="e", text="x", metadata={"answer": "x"})]

    def reward(self, prompt, completion):
        return Reward(float(completion == prompt.answer))

    def format_prompt(self, tokenizer, prompt):
        return [1]


def test_decorator_registers_and_refuses_a_second_owner(monkeypatch):
    monkeypatch.setattr(tasks_base, "_REGISTRY", dict(tasks_base._REGISTRY))
    register_task("echo-test")(_Echo)
    assert get_task("echo-test").reward(Prompt(id="1", metadata={"answer": "x"}), "x").value == 1.0
    register_task("echo-test")(_Echo)  # the same factory again is fine
    with pytest.raises(TaskRegistrationError, match="already registered"):
        register_task("echo-test")(type("Other", (_Echo,), {}))


def test_factory_that_does_not_build_a_task_is_refused(monkeypatch):
    monkeypatch.setattr(tasks_base, "_REGISTRY", dict(tasks_base._REGISTRY))
    register_task("not-a-task")(lambda: object())
    with pytest.raises(TaskRegistrationError, match="Task protocol"):
        get_task("not-a-task")


def test_entry_point_plugin_is_discovered(tmp_path, monkeypatch):
    # A real installed distribution (dist-info on sys.path) declaring an rlbus.tasks entry point.
    (tmp_path / "rlbus_plugin_demo.py").write_text(
        textwrap.dedent(
            """
            from services.tasks import Prompt, Reward

            class Shout:
                name = "shout"
                max_new_tokens = 8
                stop = []

                def __init__(self, word="hey"):
                    self.word = word

                def train_prompts(self, seed, start=0):
                    while True:
                        yield Prompt(id=f"{seed}/{start}", text=self.word, metadata={"answer": self.word.upper()})
                        start += 1

                def eval_prompts(self):
                    return [Prompt(id="e0", text=self.word, metadata={"answer": self.word.upper()})]

                def reward(self, prompt, completion):
                    return Reward(float(completion == prompt.metadata["answer"]), "shouted?")

                def format_prompt(self, tokenizer, prompt):
                    return list(tokenizer.encode(prompt.text))
            """
        )
    )
    dist = tmp_path / "rlbus_plugin_demo-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: rlbus-plugin-demo\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[rlbus.tasks]\nshout = rlbus_plugin_demo:Shout\nbroken = nowhere_at_all:X\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(tasks_base, "_REGISTRY", dict(tasks_base._REGISTRY))
    importlib.invalidate_caches()
    try:
        assert {"shout", "broken"} <= set(available_tasks())
        task = get_task("shout", word="hello")
        assert task.eval_prompts()[0].answer == "HELLO"
        assert task.reward(task.eval_prompts()[0], "HELLO").value == 1.0
        with pytest.raises(TaskRegistrationError, match="broken"):
            get_task("broken")
        assert get_task("addition").name == "addition"  # a broken plugin breaks nothing else
    finally:
        sys.modules.pop("rlbus_plugin_demo", None)
