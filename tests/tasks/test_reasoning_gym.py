"""The reasoning_gym task over the real reasoning-gym package, and the math_verify reward over math-verify."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from services.judge.config import UserCodeConfig
from services.judge.user_code import ProcessUserCode
from services.launcher.runfile import RunFile
from services.tasks import Prompt, get_task
from services.tasks.base import TaskOptionTypeError
from services.tasks.reasoning_gym import ReasoningGymError
from services.tasks.rewards import math_verify, resolve_reward

REPO = Path(__file__).resolve().parents[2]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def task(dataset: str = "chain_sum", **options):
    return get_task("reasoning_gym", dataset=dataset, **options)


def first(stream, n):
    return list(itertools.islice(stream, n))


def answered(prompt: Prompt, answer: str) -> str:
    """A completion in the form the default system prompt asks for: reasoning, then the answer in tags."""
    return f"Let me work it out step by step.\n<answer>{answer}</answer>"


def wrong(answer: str) -> str:
    return str(int(answer) + 1)  # n + 1 never contains n's digits as a substring (no partial credit)


# --- the task by name, its streams ----------------------------------------------------------------------


@pytest.mark.parametrize("dataset", ["chain_sum", "leg_counting"])
def test_the_task_by_name_gives_chat_prompts_with_answers(dataset):
    t = task(dataset, size=500, eval_size=20)
    assert t.name == "reasoning_gym" and t.max_new_tokens == 256
    prompt = next(t.train_prompts(seed=0))
    assert prompt.id == f"reasoning_gym/{dataset}/train/0/0"
    system, user = prompt.messages
    assert system["role"] == "system" and "<answer>" in system["content"]  # reasoning-gym's default prompt
    assert user == {"role": "user", "content": prompt.text} and prompt.text
    assert prompt.answer and int(prompt.answer) == int(json.loads(prompt.metadata["entry"])["answer"])
    assert len(t.eval_prompts()) == 20


def test_train_stream_is_a_function_of_seed_and_position():
    t = task(size=50, eval_size=10)
    stream = first(t.train_prompts(seed=7), 120)  # past two epochs
    assert stream == first(task(size=50, eval_size=10).train_prompts(seed=7), 120)  # another instance
    assert first(t.train_prompts(seed=7, start=45), 75) == stream[45:]  # resume mid-epoch and across one
    assert [p.text for p in first(t.train_prompts(seed=8), 20)] != [p.text for p in stream[:20]]
    # each epoch visits the size items once, in an order of its own
    epochs = [[p.metadata["source"] for p in stream[k * 50:(k + 1) * 50]] for k in range(2)]
    assert sorted(epochs[0]) == sorted(epochs[1]) and len(set(epochs[0])) == 50 and epochs[0] != epochs[1]


@pytest.mark.parametrize("dataset", ["chain_sum", "leg_counting"])
def test_eval_split_is_fixed_and_not_trained_on(dataset):
    t = task(dataset, size=2000, eval_size=100)
    evals = t.eval_prompts()
    assert evals == task(dataset, size=10, eval_size=100).eval_prompts()  # whatever the training stream
    assert [p.id for p in evals] == [f"reasoning_gym/{dataset}/eval/{k}" for k in range(100)]
    questions = {p.text for p in evals}
    trained = [p.text for p in first(t.train_prompts(seed=0), 500)]
    assert not questions & set(trained)
    assert t.metrics() == {"task/eval_overlap": 0.0}


def test_a_small_question_space_takes_alternates_and_counts_what_it_cannot_avoid():
    # one-digit a + b: 100 questions, half of them held out for eval
    t = task(config={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}, size=300, eval_size=120)
    questions = {p.text for p in t.eval_prompts()}
    trained = [p.text for p in first(t.train_prompts(seed=0), 300)]
    overlapping = sum(q in questions for q in trained)
    assert overlapping == t.metrics()["task/eval_overlap"]
    assert overlapping < 30  # without the alternates, about half of them
    assert len({p.metadata["source"].split(":")[0] for p in first(t.train_prompts(seed=0), 300)}) > 1


# --- the reward -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dataset", ["chain_sum", "leg_counting"])
def test_reward_is_the_datasets_own_score_of_the_tagged_answer(dataset):
    t = task(dataset, size=100, eval_size=10)
    for prompt in [*first(t.train_prompts(seed=3), 5), *t.eval_prompts()[:5]]:
        right = t.reward(prompt, answered(prompt, prompt.answer))
        assert right.value == 1.0, right
        assert t.reward(prompt, answered(prompt, wrong(prompt.answer))).value == 0.0
        assert t.reward(prompt, f"The answer is {prompt.answer}.").value == 0.0  # no tags: not read
        assert t.reward(prompt, "").value == 0.0
        assert t.reward(prompt, "<answer>@@ ## !!</answer>").value == 0.0
        assert t.reward(prompt, "<answer></answer>").value == 0.0
    # the last tagged answer counts
    assert t.reward(prompt, f"<answer>{wrong(prompt.answer)}</answer> no: <answer>{prompt.answer}</answer>").value == 1.0


def test_the_judge_scores_from_what_the_ticket_carries():
    trainer_side = task(size=100, eval_size=10)
    prompt = next(trainer_side.train_prompts(seed=1))
    judge_side = task(size=100, eval_size=10)  # a judge's own instance, fed what a rollout carries
    carried = Prompt(id=prompt.id, text=prompt.text, metadata=dict(prompt.metadata))
    assert judge_side.reward(carried, answered(carried, prompt.answer)).value == 1.0
    assert "regenerated" in judge_side.reward(carried, answered(carried, prompt.answer)).explanation
    other = task(config={"max_terms": 3}, size=100, eval_size=10)
    with pytest.raises(ValueError, match="trainer's run file"):  # a judge built from other options
        other.reward(carried, answered(carried, prompt.answer))


async def test_reward_in_the_judges_worker_process():
    options = {"dataset": "leg_counting", "size": 100, "eval_size": 10}
    judge_task = get_task("reasoning_gym", **options)
    prompt = judge_task.eval_prompts()[0]
    runner = ProcessUserCode(UserCodeConfig(workers=1, timeout_s=60.0), {"reasoning_gym": options})
    try:
        right = await runner.call("reasoning_gym", judge_task, "reward", prompt, answered(prompt, prompt.answer))
        bad = await runner.call("reasoning_gym", judge_task, "reward", prompt, "<answer>many</answer>")
    finally:
        await runner.close()
    assert right.value == 1.0 and bad.value == 0.0


def _in_process(hash_seed: str, script: str, stdin: str = "") -> str:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], input=stdin, capture_output=True,
                         text=True, env=env, cwd=REPO, timeout=120)
    assert run.returncode == 0, run.stderr
    return run.stdout


def test_an_item_that_regenerates_differently_is_scored_as_sent():
    # polynomial_multiplication's questions depend on string hashing: trainer and judge processes differ
    made = _in_process("1", """
        import itertools, json
        from services.tasks import get_task
        t = get_task("reasoning_gym", dataset="polynomial_multiplication", size=50, eval_size=5)
        print(json.dumps([[p.id, p.text, p.metadata] for p in itertools.islice(t.train_prompts(0), 5)]))
    """)
    scored = _in_process("2", """
        import json, sys
        from services.tasks import Prompt, get_task
        t = get_task("reasoning_gym", dataset="polynomial_multiplication", size=50, eval_size=5)
        out = []
        for pid, text, metadata in json.load(sys.stdin):
            p = Prompt(id=pid, text=text, metadata=metadata)
            r = t.reward(p, "<answer>" + metadata["answer"] + "</answer>")
            out.append([r.value, r.explanation])
        print(json.dumps(out))
    """, stdin=made)
    results = json.loads(scored)
    assert all(value == 1.0 for value, _ in results), results
    assert any("as sent (JSON)" in why for _, why in results)  # at least one item did not regenerate alike


# --- options and errors ---------------------------------------------------------------------------------


def test_an_unknown_dataset_names_the_key_and_close_matches():
    with pytest.raises(ReasoningGymError) as e:
        task("chain_summ")
    assert "task.options.dataset" in str(e.value) and "chain_sum" in str(e.value)
    with pytest.raises(ReasoningGymError, match="task.options.dataset"):
        get_task("reasoning_gym")


def test_bad_options_name_their_key():
    with pytest.raises(ReasoningGymError, match=r"task\.options\.config\.min_term: .*did you mean min_terms"):
        task(config={"min_term": 2})
    with pytest.raises(ReasoningGymError, match=r"task\.options\.config\.size: .*task\.options\.size"):
        task(config={"size": 10})
    with pytest.raises(ReasoningGymError, match=r"task\.options\.config: .*min_terms must be positive"):
        task(config={"min_terms": 0})
    with pytest.raises(ReasoningGymError, match=r"task\.options\.config: .*cannot generate"):
        task(config={"max_digits": 2.5})  # passes validate(), fails generating
    with pytest.raises(ReasoningGymError, match=r"task\.options\.sizes: .*did you mean size"):
        task(sizes=10)
    with pytest.raises(TaskOptionTypeError, match=r"task\.options\.size: .*got the table"):
        task(size={"train": 10})
    with pytest.raises(ReasoningGymError, match=r"task\.options\.eval_seed"):
        task(eval_seed=2**31)


def test_the_registry_does_not_import_the_packages_until_asked():
    out = _in_process("0", """
        import sys
        import services.tasks, services.tasks.rewards
        print("reasoning_gym" in services.tasks.available_tasks(), "reasoning_gym" in sys.modules,
              "math_verify" in sys.modules)
    """)
    assert out.split() == ["True", "False", "False"]


def test_a_missing_package_says_what_to_install():
    out = _in_process("0", """
        import sys
        sys.modules["reasoning_gym"] = None  # as if not installed: importing it raises ImportError
        sys.modules["math_verify"] = None
        from services.tasks import get_task
        from services.tasks.rewards import math_verify
        for call in (lambda: get_task("reasoning_gym", dataset="chain_sum"),
                     lambda: math_verify("q", "1", answer="1")):
            try:
                call()
            except Exception as e:
                print(type(e).__name__, e)
    """)
    lines = out.splitlines()
    assert lines[0].startswith("ReasoningGymError") and 'pip install "rlbus[envs]"' in lines[0]
    assert lines[1].startswith("RuntimeError") and 'pip install "rlbus[envs]"' in lines[1]


# --- prompts through a tokenizer, and the shipped example -----------------------------------------------


def _chat_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    """A small byte-level BPE tokenizer trained here, with a ChatML template (every text round-trips)."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    specials = ["<|im_start|>", "<|im_end|>", "<pad>"]
    backend.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                           show_progress=False))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<pad>",
                                        padding_side="left")
    tokenizer.chat_template = CHATML
    return tokenizer


def test_prompts_go_through_the_chat_template():
    t = task("leg_counting", size=100, eval_size=5)
    prompt = t.eval_prompts()[0]
    tokenizer = _chat_tokenizer([m["content"] for m in prompt.messages])
    ids = t.format_prompt(tokenizer, prompt)
    system, user = prompt.messages
    assert tokenizer.decode(ids) == (f"<|im_start|>system\n{system['content']}<|im_end|>\n"
                                     f"<|im_start|>user\n{user['content']}<|im_end|>\n<|im_start|>assistant\n")
    bare = task("leg_counting", size=100, eval_size=5, system_prompt="").eval_prompts()[0]
    assert tokenizer.decode(t.format_prompt(tokenizer, bare)).startswith("<|im_start|>user\n")


def test_the_shipped_example_builds_its_task():
    runfile = RunFile.load(REPO / "examples" / "reasoning_gym.toml", env={})
    runfile.check()
    t = get_task(runfile.task.name, **runfile.task.options_for(runfile.task.name))
    assert t.dataset == "chain_sum" and t.config["max_terms"] == 3 and t.max_new_tokens == 128
    prompt = next(t.train_prompts(seed=0))
    assert t.reward(prompt, answered(prompt, prompt.answer)).value == 1.0


# --- math_verify ----------------------------------------------------------------------------------------


def test_math_verify_reward():
    assert resolve_reward("math_verify") is math_verify
    assert math_verify("q", r"so it is $\frac{1}{2}$", answer="0.5").value == 1.0
    assert math_verify("q", "0.5", answer=r"\frac{1}{2}").value == 1.0
    assert math_verify("q", r"The answer is \boxed{42}.", answer="42").value == 1.0
    assert math_verify("q", r"$1 + x$", answer="x+1").value == 1.0  # an answer that parses only as LaTeX
    assert math_verify("q", r"\boxed{41}", answer="42").value == 0.0
    assert math_verify("q", "no idea, sorry", answer="42").value == 0.0
    assert math_verify("q", "", answer="42").value == 0.0
    assert math_verify("q", r"\frac{{{{\sqrt[", answer="42").value == 0.0
    assert math_verify("q", "42").value == 0.0  # the row has no answer


@pytest.mark.timeout(180)  # a hang guard, not a speed figure: math-verify's own per-step timeouts end it
def test_math_verify_bounds_hostile_input():
    reward = math_verify("q", "$" + "(" * 2000 + "x" + ")" * 2000 + "^" * 500 + "$", answer="2^(2^(2^(2^10)))")
    assert reward.value == 0.0 and "expected" in reward.explanation
