"""Environment mixtures (``[[task.mix]]``): the run file's shape and its refusals, the weighted training stream
(seeded, resumable from any position, each prompt carrying its environment), per-environment eval prompts and
figures."""

from __future__ import annotations

import itertools
import json

import pytest

from services.launcher.runfile import RunFile
from services.runtime.config import ConfigError, TaskSection
from services.tasks.mixture import Mixture, env_figures

MIX = ['task.mix=[{name="addition", weight=3}, {name="dataset", weight=1, options={path="DATA", eval_fraction=0.2}}]']


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{a}*2=", "answer": str(2 * a)}) + "\n" for a in range(50)))
    return str(path)


def _section(data: str, *overrides: str) -> TaskSection:
    return RunFile.load(None, env={}, overrides=[o.replace("DATA", data) for o in (overrides or MIX)]).task


def test_a_run_file_without_a_mixture_is_one_task_and_its_stream_is_that_tasks(data):
    section = RunFile.load(None, env={}).task
    assert [(e.name, e.weight) for e in section.entries()] == [("addition", 1.0)]
    mixture = Mixture.build(section)
    assert not mixture.is_mixture
    from services.tasks import get_task

    alone = list(itertools.islice(get_task("addition").train_prompts(7, start=5), 20))
    mixed = list(itertools.islice(mixture.train_prompts(7, start=5), 20))
    assert [(p.id, p.text) for p in mixed] == [(p.id, p.text) for p in alone]
    assert {p.env for p in mixed} == {"addition"}


def test_the_stream_draws_by_weight_and_resumes_at_any_position(data):
    mixture = Mixture.build(_section(data))
    assert mixture.is_mixture and [e.name for e in mixture.envs] == ["addition", "dataset"]
    stream = list(itertools.islice(mixture.train_prompts(3), 4000))
    share = sum(p.env == "addition" for p in stream) / len(stream)
    assert 0.72 < share < 0.78  # weight 3 of 4
    assert {p.env for p in stream} == {"addition", "dataset"}
    # each environment's prompts are its own task's (the dataset's rows, addition's sums)
    assert all(p.text.endswith("*2=") for p in stream if p.env == "dataset")
    assert all("+" in p.text for p in stream if p.env == "addition")
    # prompt k is the same whether reached from 0 or resumed at k; another seed draws another stream
    for start in (0, 1, 17, 999):
        resumed = list(itertools.islice(mixture.train_prompts(3, start=start), 50))
        assert [(p.env, p.id) for p in resumed] == [(p.env, p.id) for p in stream[start:start + 50]]
    other = list(itertools.islice(mixture.train_prompts(4), 200))
    assert [p.env for p in other] != [p.env for p in stream[:200]]


def test_eval_prompts_cover_every_environment_and_carry_it(data):
    mixture = Mixture.build(_section(data))
    prompts = mixture.eval_prompts(limit=4)
    assert [p.env for p in prompts] == ["addition"] * 4 + ["dataset"] * 4
    assert len(mixture.eval_prompts()) == 200 + 10  # addition's 200, the dataset's 20 % of 50 rows


def test_options_go_to_their_own_task(data):
    section = _section(data)
    assert section.options_for("dataset")["path"] == data
    assert section.options_for("addition") == {} and section.options_for("coding") == {}


def test_per_environment_figures():
    figures = env_figures([("a", 1.0), ("a", 0.0), ("b", 1.0), ("a", 1.0)])
    assert figures == {"train/a/reward_mean": pytest.approx(2 / 3), "train/a/samples": 3.0, "train/a/share": 0.75,
                       "train/b/reward_mean": 1.0, "train/b/samples": 1.0, "train/b/share": 0.25}


@pytest.mark.parametrize(("overrides", "message"), [
    (["task.mix=[]"], "config key task.mix is empty"),
    (['task.mix=[{name="addition", weight=0}]'], "config key task.mix[0].weight: expected `float` > 0.0"),
    (['task.mix=[{name="addition"}, {name="dataset", weight=-1}]'], "config key task.mix[1].weight: expected"),
    (['task.mix=[{name="addition"}, {name="addition"}]'], "config key task.mix[1].name: task 'addition' is "
                                                             "already task.mix[0]"),
    (['task.mix=[{name="addition"}]', "task.name=dataset"], "task.mix is set together with task.name"),
    (['task.mix=[{name="addition", wieght=2}]'], "config key task.mix[0].wieght: unknown key"),
    (['task.mix=[{weight=2}]'], "config key task.mix[0]: Object missing required field `name`"),
])
def test_bad_mixtures_stop_the_run_file_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as e:
        RunFile.load(None, env={}, overrides=overrides)
    assert message in str(e.value)


def test_an_unknown_task_in_a_mixture_stops_start_up_naming_its_key(data):
    section = _section(data, 'task.mix=[{name="addition"}, {name="additoin", weight=2}]')
    with pytest.raises(ConfigError, match=r"config key task.mix\[1\].name: unknown task 'additoin'"):
        Mixture.build(section)
    with pytest.raises(ConfigError, match=r"config key task.name: unknown task 'nope'"):
        Mixture.build(RunFile.load(None, env={}, overrides=["task.name=nope"]).task)


def test_a_task_refusing_its_options_in_a_mixture_names_its_entry(data):
    bad_dataset = _section(data, 'task.mix=[{name="addition"}, {name="dataset", options={path="DATA", eval_fraction=2}}]')
    with pytest.raises(ConfigError, match=r"^task.mix\[1\].options.eval_fraction: must be in \[0, 1\), got 2"):
        Mixture.build(bad_dataset)
    bad_addition = _section(data, 'task.mix=[{name="addition", options={low=50, high=10}}, {name="dataset", '
                                  'options={path="DATA"}}]')
    with pytest.raises(ConfigError, match=r"^config key task.mix\[0\].options: task 'addition' refused them: need "
                                          r"0 <= low <= high, got low=50, high=10"):
        Mixture.build(bad_addition)
