"""Word problems: answers consistent with the question, final-number reward, chat formatting."""

from __future__ import annotations

import itertools
import re

import pytest

from services.tasks.tiny_model import build_char_tokenizer
from services.tasks.word_problems import WordProblemsTask, parse_final_number


def solve(question: str) -> int:
    n = [int(x) for x in re.findall(r"\d+", question)]
    if "more" in question and "lost" in question:
        return n[0] - n[1] + n[2]
    if "more" in question:
        return n[0] + n[1]
    if "away" in question:
        return n[0] - n[1]
    return n[0] * n[1]


def test_answers_match_the_questions():
    task = WordProblemsTask()
    for prompt in itertools.islice(task.train_prompts(seed=0), 200):
        assert prompt.answer == str(solve(prompt.text))
        assert prompt.messages[-1]["role"] == "user"
        assert prompt.text in prompt.messages[-1]["content"]


def test_stream_resumes_and_eval_is_held_out():
    task = WordProblemsTask(num_eval=50)
    stream = list(itertools.islice(task.train_prompts(seed=1), 30))
    assert list(itertools.islice(task.train_prompts(seed=1, start=10), 20)) == stream[10:]
    eval_texts = {p.text for p in task.eval_prompts()}
    assert len(eval_texts) == 50
    assert not eval_texts & {p.text for p in itertools.islice(task.train_prompts(seed=1), 3000)}


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("The answer is 12.", 12.0),
        ("7 + 5 = 12", 12.0),
        ("1,200 apples", 1200.0),
        ("none", None),
        ("-3", -3.0),
    ],
)
def test_parse_final_number(completion, expected):
    assert parse_final_number(completion) == expected


def test_reward_uses_the_last_number():
    task = WordProblemsTask(num_eval=5)
    prompt = task.eval_prompts()[0]
    assert task.reward(prompt, f"Let me think. So the answer is {prompt.answer}").value == 1.0
    assert task.reward(prompt, f"{prompt.answer} is wrong, it is 99999").value == 0.0
    assert task.reward(prompt, "no idea").value == 0.0


def test_format_prompt_applies_the_chat_template():
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}={% endfor %}"
    task = WordProblemsTask(num_eval=2, system_prompt="1+1")
    prompt = task.eval_prompts()[0]
    ids = task.format_prompt(tokenizer, prompt)
    text = tokenizer.decode(ids)
    assert text.startswith("1+1=")  # the system turn, then the user turn (digits survive the char vocab)
    assert text.endswith("=")


def test_instruction_option_replaces_the_text_after_the_question():
    default = WordProblemsTask(num_eval=3).eval_prompts()[0]
    assert default.messages[-1]["content"].endswith("Answer with the final number only.")
    steps = WordProblemsTask(num_eval=3, instruction="  Think step by step.  ").eval_prompts()[0]
    assert steps.messages[-1]["content"] == f"{steps.text} Think step by step."
    assert steps.answer == default.answer  # same problem, same answer: only the instruction changed
    with pytest.raises(ValueError, match="task option instruction is empty"):
        WordProblemsTask(instruction=" ")
