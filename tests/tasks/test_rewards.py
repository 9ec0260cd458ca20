"""The shipped reward library and how run files name reward functions."""

from __future__ import annotations

import pytest

from services.tasks.base import Reward
from services.tasks.rewards import (
    LIBRARY,
    RewardSpecError,
    code_tests,
    concise,
    exact_match,
    json_parses,
    last_number,
    length_penalty,
    number_format,
    regex_format,
    resolve_reward,
    think_answer_format,
)


def value(r: Reward | float) -> float:
    return r.value if isinstance(r, Reward) else r


def test_exact_match_and_last_number():
    assert value(exact_match("1+1=", " 2\n", answer="2")) == 1.0
    assert value(exact_match("1+1=", "2.0", answer="2")) == 0.0
    assert value(exact_match("1+1=", "2")) == 0.0  # no answer in the row
    assert value(last_number("q", "so 3 + 4 = 7", answer="7")) == 1.0
    assert value(last_number("q", "7, no wait, 8", answer="7")) == 0.0
    assert value(last_number("q", "it is 12", answer=12.0)) == 1.0
    assert value(last_number("q", "no idea", answer="7")) == 0.0


def test_format_json_and_length():
    assert value(number_format("q", " -12.5 ")) == 1.0
    assert value(number_format("q", "12 apples")) == 0.0
    assert value(think_answer_format("q", "<think>a\nb</think> <answer>3</answer>")) == 1.0
    assert value(think_answer_format("q", "<answer>3</answer>")) == 0.0
    digits = regex_format(r"\d{2}")
    assert value(digits("q", "42")) == 1.0 and value(digits("q", "421")) == 0.0
    assert value(json_parses("q", '{"a": [1, 2]}')) == 1.0
    assert value(json_parses("q", 'Here:\n```json\n{"a": 1}\n```')) == 1.0
    assert value(json_parses("q", "{'a': 1}")) == 0.0
    penalty = length_penalty(10, 20)
    assert [value(penalty("q", "x" * n)) for n in (5, 10, 15, 20, 30)] == [1.0, 1.0, 0.5, 0.0, 0.0]
    assert value(concise("q", "short")) == 1.0
    with pytest.raises(ValueError, match="target_chars < max_chars"):
        length_penalty(20, 10)


def test_names_resolve_to_functions():
    assert resolve_reward("exact_match") is exact_match
    assert resolve_reward("services.tasks.rewards:exact_match") is exact_match
    assert set(LIBRARY) >= {"exact_match", "last_number", "number_format", "json_parses", "concise", "code_tests"}
    with pytest.raises(RewardSpecError, match="not a shipped reward"):
        resolve_reward("exakt_match")
    with pytest.raises(RewardSpecError, match="cannot import module 'no_such_pkg_xyz.rewards'"):
        resolve_reward("no_such_pkg_xyz.rewards:f")
    with pytest.raises(RewardSpecError, match="has no 'nope'"):
        resolve_reward("services.tasks.rewards:nope")
    with pytest.raises(RewardSpecError, match="not a function"):
        resolve_reward("services.tasks.rewards:LIBRARY")


def test_code_tests_scores_the_share_of_passing_tests_in_a_sandbox():
    completion = "Here it is:\n```python\ndef double(x):\n    return 2 * x\n```"
    r = code_tests("q", completion, tests=["assert double(2) == 4", "assert double(-1) == -2",
                                           "assert double(3) == 7"])
    assert r.value == pytest.approx(2 / 3), r.explanation
    assert "2/3 tests passed" in r.explanation and "AssertionError" in r.explanation
    assert code_tests("q", "def double(x): return x + x", tests="assert double(5) == 10").value == 1.0
    broken = code_tests("q", "def double(x) return", tests=["assert double(1) == 2"])
    assert broken.value == 0.0 and "SyntaxError" in broken.explanation
    # the sandbox has no network and a read-only root
    net = code_tests("q", "import socket\ns = socket.create_connection(('1.1.1.1', 53), timeout=2)",
                     tests="pass")
    assert net.value == 0.0 and "solution failed to load" in net.explanation
    ro = code_tests("q", "open('/usr/rlbus-test-write', 'w').write('x')", tests="pass")
    assert ro.value == 0.0 and "Read-only file system" in ro.explanation


def test_code_tests_bounds_a_hang_and_a_forged_exit():
    hang = code_tests("q", "while True: pass", tests="pass", timeout_s=2.0)
    assert hang.value == 0.0 and "did not finish within 2 s" in hang.explanation
    quit_early = code_tests("q", "import os\nos._exit(0)", tests="assert False")
    assert quit_early.value == 0.0 and "no test report" in quit_early.explanation


def test_code_tests_needs_tests():
    with pytest.raises(ValueError, match="needs a 'tests' field"):
        code_tests("q", "def f(): pass")
