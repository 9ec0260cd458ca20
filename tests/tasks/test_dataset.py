"""The dataset task: every file format, deterministic resumable order, bad rows, rewards by import path."""

from __future__ import annotations

import csv
import itertools
import json
import logging
import sys
import textwrap

import pytest

from services.tasks import get_task
from services.tasks.dataset import DatasetError, DatasetTask
from services.tasks.tiny_model import build_char_tokenizer

ROWS = [{"prompt": f"{a}+{b}=", "answer": str(a + b), "level": a % 3} for a in range(10, 40) for b in (11, 22)]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def texts(prompts):
    return [(p.text, p.answer) for p in prompts]


def test_every_format_gives_the_same_prompts(tmp_path):
    import datasets  # the bench extra, in .venv: a save_to_disk directory made by the real library
    import pyarrow as pa  # the data extra
    import pyarrow.parquet as pq

    jsonl = write_jsonl(tmp_path / "d.jsonl", ROWS)
    (tmp_path / "d.json").write_text(json.dumps(ROWS))
    with (tmp_path / "d.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["prompt", "answer", "level"])
        writer.writeheader()
        writer.writerows(ROWS)
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "d.parquet")
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS),
                          "test": datasets.Dataset.from_list(ROWS[:5])}).save_to_disk(str(tmp_path / "dict"))

    reference = DatasetTask(path=str(jsonl))
    want_train = texts(itertools.islice(reference.train_prompts(seed=3), 100))
    want_eval = texts(reference.eval_prompts())
    assert len(want_eval) == 6  # 10 % of 60 rows held out
    for name in ("d.json", "d.csv", "d.parquet", "saved", "dict"):
        task = DatasetTask(path=str(tmp_path / name))
        assert texts(itertools.islice(task.train_prompts(seed=3), 100)) == want_train, name
        assert texts(task.eval_prompts()) == want_eval, name
    # typed columns travel to the reward (CSV has strings only)
    assert json.loads(reference.eval_prompts()[0].metadata["fields"])["level"] in (0, 1, 2)
    split = DatasetTask(path=str(tmp_path / "dict"), eval_split="test")
    assert texts(split.eval_prompts()) == [(r["prompt"], r["answer"]) for r in ROWS[:5]]
    with pytest.raises(DatasetError, match="task.options.split: 'validation' is not a split"):
        DatasetTask(path=str(tmp_path / "dict"), split="validation").eval_prompts()


def test_order_is_deterministic_resumable_and_covers_each_epoch(tmp_path):
    task = get_task("dataset", path=str(write_jsonl(tmp_path / "d.jsonl", ROWS)), eval_fraction=0.25)
    train_n = len(ROWS) - 15
    stream = list(itertools.islice(task.train_prompts(seed=7), 3 * train_n))
    # prompt k is the same from 0 or from k (a resumed trainer continues exactly), ids name the position
    for k in (0, 1, train_n - 1, train_n, 2 * train_n + 5):
        assert next(task.train_prompts(seed=7, start=k)) == stream[k]
        assert stream[k].id == f"dataset/train/7/{k}"
    # each epoch is every training row once, in its own order; another seed, another order
    epochs = [stream[i * train_n:(i + 1) * train_n] for i in range(3)]
    assert all(sorted(p.metadata["row"] for p in e) == sorted(p.metadata["row"] for p in epochs[0]) for e in epochs)
    assert len({p.metadata["row"] for p in epochs[0]}) == train_n
    assert epochs[0] != epochs[1]
    assert texts(itertools.islice(task.train_prompts(seed=8), train_n)) != texts(epochs[0])
    # eval rows are never trained on, and the held-out choice depends on eval_seed only
    eval_rows = {p.metadata["row"] for p in task.eval_prompts()}
    assert len(eval_rows) == 15 and not eval_rows & {p.metadata["row"] for p in stream}
    again = DatasetTask(path=str(tmp_path / "d.jsonl"), eval_fraction=0.25)
    assert again.eval_prompts() == task.eval_prompts()
    # without shuffling: file order, epoch after epoch
    plain = DatasetTask(path=str(tmp_path / "d.jsonl"), eval_fraction=0.0, shuffle=False)
    rows = [int(p.metadata["row"]) for p in itertools.islice(plain.train_prompts(seed=1), 2 * len(ROWS))]
    assert rows == list(range(1, len(ROWS) + 1)) * 2


def test_bad_rows_are_skipped_counted_and_logged_with_their_number(tmp_path, caplog):
    lines = [json.dumps({"prompt": "1+2=", "answer": "3"}),
             "{not json",
             json.dumps({"answer": "4"}),                      # no prompt
             json.dumps({"prompt": "2+2="}),                   # no answer
             json.dumps({"prompt": "2+3=", "answer": ["5"]}),  # wrong type
             json.dumps(["2+4=", "6"]),                        # not an object
             json.dumps({"prompt": 12, "answer": "7"}),        # prompt neither text nor messages
             "",
             json.dumps({"prompt": "3+4=", "answer": 7})]
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    task = DatasetTask(path=str(tmp_path / "d.jsonl"), eval_fraction=0.0)
    with caplog.at_level(logging.WARNING, logger="rlbus.tasks.dataset"):
        prompts = list(itertools.islice(task.train_prompts(seed=0), 4))
    assert task.skipped == 6
    assert {p.text for p in prompts} == {"1+2=", "3+4="}
    assert {p.metadata["row"] for p in prompts} == {"1", "8"}  # blank lines are not rows
    log = caplog.text
    for number, why in [(2, "not JSON"), (3, "missing field 'prompt'"), (4, "missing field 'answer'"),
                        (5, "field 'answer' must be a string or a number, got list"),
                        (6, "a row must be an object, got list"),
                        (7, "field 'prompt' must be a string or a list of chat messages, got int")]:
        assert f"row {number} skipped: {why}" in log
    assert "6 of 8 rows skipped" in log


def test_unusable_files_stop_start_up_naming_the_key_and_path(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    (tmp_path / "bad.jsonl").write_text('{"x": 1}\n')
    (tmp_path / "binary.parquet").write_bytes(b"\x00not parquet")
    (tmp_path / "d.txt").write_text("1+1=\n")
    good = str(write_jsonl(tmp_path / "good.jsonl", ROWS))
    cases = [
        (DatasetTask(), "task.options.path: the dataset task needs the path"),
        (DatasetTask(path=str(tmp_path / "missing.jsonl")), "task.options.path: cannot read .*missing.jsonl"),
        (DatasetTask(path=str(tmp_path / "empty.jsonl")), "has no usable rows \\(it is empty\\)"),
        (DatasetTask(path=str(tmp_path / "bad.jsonl")), "has no usable rows \\(1 skipped"),
        (DatasetTask(path=str(tmp_path / "binary.parquet")), "task.options.path: cannot read .*binary.parquet"),
        (DatasetTask(path=str(tmp_path / "d.txt")), "cannot tell the format"),
        (DatasetTask(path=str(tmp_path)), "not one written by datasets' save_to_disk"),
        (DatasetTask(path=good, eval_path=str(tmp_path / "nope.jsonl")), "task.options.eval_path: cannot read"),
        (DatasetTask(path=good, reward="nowhere_xyz:f"), "task.options.reward: .*nowhere_xyz"),
    ]
    for task, message in cases:
        with pytest.raises(DatasetError, match=message):
            task.eval_prompts()
    for options, message in [({"reward_weights": "1, 2"}, "2 weights for 1 reward"),
                             ({"reward_weights": "x"}, "are not numbers"),
                             ({"reward": ""}, "name at least one"),
                             ({"eval_fraction": 1.0}, "eval_fraction"),
                             ({"format": "xlsx"}, "task.options.format"),
                             ({"pth": "x.jsonl"}, "task.options.pth: unknown option .*known: .*path")]:
        with pytest.raises(DatasetError, match=message):
            DatasetTask(**options)


def test_chat_rows_and_prompt_formatting(tmp_path):
    rows = [{"messages": [{"role": "user", "content": f"What is {a} plus 1?"}], "solution": a + 1} for a in range(10)]
    rows.append({"messages": [{"role": "user"}], "solution": 1})
    task = DatasetTask(path=str(write_jsonl(tmp_path / "chat.jsonl", rows)), messages_field="messages",
                       answer_field="solution", system_prompt="Answer with a number.", eval_fraction=0.0,
                       stop="\n", max_new_tokens=8, reward="last_number")
    prompt = next(task.train_prompts(seed=0))
    assert task.skipped == 1 and task.stop == ["\n"] and task.max_new_tokens == 8
    assert prompt.messages[0] == {"role": "system", "content": "Answer with a number."}
    assert prompt.text == prompt.messages[-1]["content"]
    assert task.reward(prompt, f"It is {prompt.answer}.").value == 1.0
    # plain prompts: BOS + system prompt + text, through the tokenizer
    tokenizer = build_char_tokenizer()
    plain = DatasetTask(path=str(write_jsonl(tmp_path / "d.jsonl", ROWS)), system_prompt="1+1=2 ")
    ids = plain.format_prompt(tokenizer, next(plain.train_prompts(seed=0)))
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids[1:]).replace(" ", "").startswith("1+1=2")


@pytest.fixture
def user_rewards(tmp_path, monkeypatch):
    """A user's reward module on the path (what a run file names as 'my_rewards_18:...')."""
    (tmp_path / "my_rewards_18.py").write_text(textwrap.dedent("""
        from services.tasks.base import Reward

        def close(prompt, completion, answer, level, **fields):
            assert isinstance(level, int)
            try:
                return max(0.0, 1.0 - abs(int(completion) - int(answer)) / 10)
            except ValueError:
                return Reward(0.0, "not a number")

        def too_big(prompt, completion, **fields):
            return 3.0
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_rewards_18"
    sys.modules.pop("my_rewards_18", None)


def test_weighted_rewards_by_import_path(tmp_path, user_rewards):
    path = str(write_jsonl(tmp_path / "d.jsonl", ROWS))
    task = DatasetTask(path=path, reward=f"exact_match, {user_rewards}:close", reward_weights="1, 3")
    prompt = task.eval_prompts()[0]
    right, off_by_2 = prompt.answer, str(int(prompt.answer) + 2)
    assert task.reward(prompt, right).value == 1.0
    r = task.reward(prompt, off_by_2)
    assert r.value == pytest.approx((0 + 3 * 0.8) / 4)
    assert "exact_match=0" in r.explanation and f"{user_rewards}:close=0.8" in r.explanation
    assert task.reward(prompt, "abc").value == 0.0
    # lists work too (a run file's TOML array)
    listed = DatasetTask(path=path, reward=["exact_match", f"{user_rewards}:close"], reward_weights=[1.0, 3.0])
    assert listed.reward_spec == task.reward_spec
    assert DatasetTask(reward="exact_match", reward_weights=2).reward_weights == [2.0]
    # a reward outside [0, 1] is the user's error: raised, so the judge fails the sample with the reason
    bad = DatasetTask(path=path, reward=f"{user_rewards}:too_big")
    with pytest.raises(ValueError, match="too_big returned 3.0, not a number in \\[0, 1\\]"):
        bad.reward(bad.eval_prompts()[0], "1")
    # a judge configured with other rewards than the trainer's refuses to score the trainer's prompts
    judge = DatasetTask(reward="exact_match")
    with pytest.raises(ValueError, match="the trainer scores this task with \\[exact_match\\*1, "):
        judge.reward(prompt, right)


def test_the_judge_side_needs_no_data(user_rewards):
    """A judge's task scores from the prompt's metadata alone: no path, no file read."""
    prompt_meta = DatasetTask(reward=f"{user_rewards}:close")
    from services.tasks.base import Prompt

    p = Prompt(id="x", text="12+30=", metadata={"answer": "42", "fields": json.dumps({"level": 1}),
                                                "reward": prompt_meta.reward_spec})
    assert prompt_meta.reward(p, "41").value == pytest.approx(0.9)


def test_blank_prompts_and_undecodable_lines_are_bad_rows_summarised_by_reason(tmp_path, caplog):
    """Whitespace-only prompts are not trained on; a line that is not UTF-8 is one bad row, not a refused
    file; past the 20 rows logged one by one, the log sums up every reason with its count."""
    good = [json.dumps({"prompt": f"{a}+1=", "answer": str(a + 1)}).encode() for a in range(3)]
    lines = [good[0],
             json.dumps({"prompt": "   \t ", "answer": "1"}).encode(),                       # whitespace only
             json.dumps({"prompt": [{"role": "user", "content": " \n"}], "answer": "1"}).encode(),
             b'{"prompt": "caf\xe9+1=", "answer": "2"}',                                    # Latin-1, not UTF-8
             good[1],
             *[b"{not json"] * 25,
             good[2]]
    (tmp_path / "d.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    task = DatasetTask(path=str(tmp_path / "d.jsonl"), eval_fraction=0.0, shuffle=False)
    with caplog.at_level(logging.WARNING, logger="rlbus.tasks.dataset"):
        prompts = list(itertools.islice(task.train_prompts(seed=0), 3))
    assert [p.text for p in prompts] == ["0+1=", "1+1=", "2+1="]
    assert task.skipped == 28
    assert task.skipped_reasons == {"not JSON": 25, "field 'prompt' is empty or only whitespace": 2,
                                    "not UTF-8": 1}
    log = caplog.text
    assert "row 2 skipped: field 'prompt' is empty or only whitespace" in log
    assert "row 4 skipped: not UTF-8 (invalid continuation byte at byte 15)" in log
    assert "row 30 skipped" not in log  # past the first 20 ...
    assert ("28 of 31 rows skipped as unusable, by reason: 25 not JSON, 2 field 'prompt' is empty or only "
            "whitespace, 1 not UTF-8 (the first 20 logged above)") in log  # ... but summed up
    # the same in a CSV file and a JSON array: the undecodable row goes, the file is read
    (tmp_path / "d.csv").write_bytes(b"prompt,answer\n1+1=,2\ncaf\xe9,3\n  ,4\n2+2=,4\n")
    (tmp_path / "d.json").write_bytes(b'[{"prompt": "1+1=", "answer": "2"}, {"prompt": "\xff", "answer": "3"}]')
    for name, texts_kept, reasons in [
            ("d.csv", ["1+1=", "2+2="], {"not UTF-8": 1, "field 'prompt' is empty or only whitespace": 1}),
            ("d.json", ["1+1="], {"not UTF-8": 1})]:
        other = DatasetTask(path=str(tmp_path / name), eval_fraction=0.0, shuffle=False)
        kept = [p.text for p in itertools.islice(other.train_prompts(seed=0), len(texts_kept))]
        assert kept == texts_kept and other.skipped_reasons == reasons, name


def test_a_reward_module_that_raises_at_import_is_a_configuration_error_naming_the_key(tmp_path, monkeypatch):
    (tmp_path / "broken_rewards_27.py").write_text("import os\n\nLIMIT = int(os.environ['NO_SUCH_VAR_27'])\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("NO_SUCH_VAR_27", raising=False)
    path = str(write_jsonl(tmp_path / "d.jsonl", ROWS))
    task = DatasetTask(path=path, reward="broken_rewards_27:score")
    with pytest.raises(DatasetError) as caught:
        task.eval_prompts()  # what the trainer does at start-up
    message = str(caught.value)
    assert message.startswith("task.options.reward: reward 'broken_rewards_27:score': importing module "
                              "'broken_rewards_27' raised KeyError: 'NO_SUCH_VAR_27' (at "), message
    assert "broken_rewards_27.py:3)" in message
    sys.modules.pop("broken_rewards_27", None)
