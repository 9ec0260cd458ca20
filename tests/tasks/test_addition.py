"""The addition task: deterministic stream with a resumable cursor, held-out split, exact reward."""

from __future__ import annotations

import itertools

import pytest

from services.tasks import get_task
from services.tasks.addition import AdditionTask, TaskOptionError


def take(iterator, n):
    return list(itertools.islice(iterator, n))


def test_prompt_shape_and_answer():
    task = AdditionTask()
    for prompt in take(task.train_prompts(seed=3), 50):
        a, b = prompt.text.rstrip("=").split("+")
        assert prompt.text.endswith("=")
        assert 10 <= int(a) <= 99 and 10 <= int(b) <= 99
        assert prompt.answer == str(int(a) + int(b))


def test_stream_is_deterministic_and_resumable():
    first = take(AdditionTask().train_prompts(seed=7), 40)
    again = take(AdditionTask().train_prompts(seed=7), 40)
    resumed = take(AdditionTask().train_prompts(seed=7, start=25), 15)
    other_seed = take(AdditionTask().train_prompts(seed=8), 40)
    assert first == again
    assert resumed == first[25:]
    assert resumed[0].id == "addition/train/7/25"
    assert [p.text for p in other_seed] != [p.text for p in first]


def test_eval_split_is_fixed_distinct_and_held_out():
    task = AdditionTask()
    evals = task.eval_prompts()
    assert len(evals) == 200
    assert evals == AdditionTask().eval_prompts()
    texts = {p.text for p in evals}
    assert len(texts) == 200
    assert not texts & {p.text for p in take(task.train_prompts(seed=0), 5000)}


def test_reward_is_exact_match():
    task = get_task("addition")
    prompt = task.eval_prompts()[0]
    answer = prompt.answer
    assert task.reward(prompt, answer).value == 1.0
    assert task.reward(prompt, f" {answer}\n").value == 1.0
    assert task.reward(prompt, answer + "1").value == 0.0
    wrong = task.reward(prompt, "0")
    assert wrong.value == 0.0 and answer in wrong.explanation


def test_bad_options_are_refused():
    with pytest.raises(TaskOptionError):
        AdditionTask(low=50, high=10)
    with pytest.raises(TaskOptionError):
        AdditionTask(low=1, high=3, num_eval=9)
