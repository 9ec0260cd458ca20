"""Reward functions for dataset tasks: the shipped library, and how a run file names any reward function.

A reward function is a plain function of one sample::

    def my_reward(prompt: str, completion: str, **fields) -> float | Reward: ...

``prompt`` is the prompt's text (for a chat row, the last user message), ``completion`` the model's text,
and ``fields`` the row's other columns under their own names (JSON types preserved), plus ``answer`` (the
row's answer field, as a string) when the task has one. Accept ``**fields`` so new columns do not break
it. Return a number in [0, 1] (or a :class:`Reward` with an explanation); the task's reward is the
weighted mean over its functions.

A run file names functions by import path, ``"package.module:function"``; a bare name (``"exact_match"``)
is one of this module's. The import path of this module is ``services.tasks.rewards`` (there is no
``rlbus`` package to alias: ``rlbus`` is the CLI's name, and a second import path for the same functions
would only be one more thing to keep in step), so ``"exact_match"`` and
``"services.tasks.rewards:exact_match"`` are the same function.

Parameterised rewards are factories: ``regex_format(pattern)`` and ``length_penalty(target, limit)``
return a reward function; give one a name in your own module (``short = length_penalty(64, 256)``) and
name that in the run file.

Reward functions are user code: the judge calls them in worker processes, each call bounded by a timeout
(``[services.judge.user_code]``); one that raises, hangs or returns something outside [0, 1] fails its
sample with the reason, it never crashes the judge.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
import traceback
from collections.abc import Callable
from typing import Any

from services.tasks.base import Reward
from services.tasks.word_problems import parse_final_number

RewardFn = Callable[..., "float | Reward"]


class RewardSpecError(ValueError):
    """A reward function named in the run file cannot be found or is not callable."""


# --- matching the answer ---------------------------------------------------------------------------------


def exact_match(prompt: str, completion: str, answer: Any = None, **fields: Any) -> Reward:
    """1.0 when the completion, whitespace stripped, is exactly the answer, else 0.0."""
    if answer is None:
        return Reward(0.0, "the row has no answer")
    got, expected = completion.strip(), str(answer).strip()
    if got == expected:
        return Reward(1.0, f"exact match: {expected!r}")
    return Reward(0.0, f"expected {expected!r}, got {got[:80]!r}")


def last_number(prompt: str, completion: str, answer: Any = None, **fields: Any) -> Reward:
    """1.0 when the last number written in the completion equals the answer (as numbers: ``12.0 == 12``)."""
    if answer is None:
        return Reward(0.0, "the row has no answer")
    expected = parse_final_number(str(answer))
    if expected is None:
        return Reward(0.0, f"the answer {answer!r} is not a number")
    got = parse_final_number(completion)
    if got is None:
        return Reward(0.0, f"no number in the completion (expected {expected:g})")
    if got == expected:
        return Reward(1.0, f"last number {got:g} is the answer")
    return Reward(0.0, f"expected {expected:g}, last number was {got:g}")


#: math-verify's own timeout, in whole seconds (it uses SIGALRM), for each parse and each comparison: a
#: sample takes at most a few of them, inside the judge's own bound ([services.judge.user_code] timeout_s)
MATH_VERIFY_TIMEOUT_S = 2


def _math_verify_module() -> Any:
    try:
        import math_verify as mv
    except ImportError as e:
        raise RuntimeError(f"the math_verify reward needs the math-verify package ({e}): "
                           'pip install "rlbus[envs]" (or pip install math-verify)') from e
    return mv


def math_verify(prompt: str, completion: str, answer: Any = None, **fields: Any) -> Reward:
    """1.0 when the completion's maths equals the answer's, as math-verify decides (``\\frac{1}{2}`` = ``0.5``,
    ``\\boxed{42}`` = ``42``), else 0.0.

    Both sides go through math-verify's ``parse`` (LaTeX and plain expressions; the completion's last boxed
    or final answer first), an answer that does not parse as it stands is tried again as ``$answer$``, and
    the two are compared with its ``verify`` (the answer is the gold side). Sympy can take very long on
    hostile input, so each parse and comparison has math-verify's own timeout (:data:`MATH_VERIFY_TIMEOUT_S`;
    a timed-out step counts as no match). That timeout is a SIGALRM, which only the main thread can take: in
    another thread it is off, and the caller bounds the call (the judge runs reward functions in worker
    processes, each call with a timeout, killing a worker that overruns).
    """
    if answer is None:
        return Reward(0.0, "the row has no answer")
    mv = _math_verify_module()
    bound = MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    expected = str(answer).strip()
    gold = mv.parse(expected, parsing_timeout=bound) or mv.parse(f"${expected}$", parsing_timeout=bound)
    if not gold:
        return Reward(0.0, f"the answer {expected[:80]!r} does not parse as maths")
    got = mv.parse(completion, parsing_timeout=bound)
    if not got:
        return Reward(0.0, f"no maths found in the completion (expected {expected[:80]!r})")
    if mv.verify(gold, got, timeout_seconds=bound):
        return Reward(1.0, f"{got[-1]!s:.80} equals {expected[:80]!r}")
    return Reward(0.0, f"expected {expected[:80]!r}, got {got[-1]!s:.80}")


# --- format ----------------------------------------------------------------------------------------------


def regex_format(pattern: str, flags: int = re.DOTALL) -> RewardFn:
    """A reward function: 1.0 when the whole completion (whitespace stripped) matches ``pattern``."""
    compiled = re.compile(pattern, flags)

    def format_reward(prompt: str, completion: str, **fields: Any) -> Reward:
        if compiled.fullmatch(completion.strip()):
            return Reward(1.0, "format matches")
        return Reward(0.0, f"format does not match /{pattern}/")

    format_reward.__name__ = format_reward.__qualname__ = f"regex_format({pattern!r})"
    return format_reward


#: the completion is one number (an integer or a decimal, optionally negative)
number_format = regex_format(r"-?\d+(?:\.\d+)?")
#: reasoning in ``<think>...</think>`` then the answer in ``<answer>...</answer>`` (the R1 format)
think_answer_format = regex_format(r"<think>.*?</think>\s*<answer>.*?</answer>")

_FENCE = re.compile(r"```(?:json)?\s*\n(.*?)\n?```", re.DOTALL)


def json_parses(prompt: str, completion: str, **fields: Any) -> Reward:
    """1.0 when the completion (or the last ```json fenced block in it) parses as JSON."""
    blocks = _FENCE.findall(completion)
    text = blocks[-1] if blocks else completion
    try:
        json.loads(text)
    except ValueError as e:
        return Reward(0.0, f"not JSON: {e}")
    return Reward(1.0, "parses as JSON")


def length_penalty(target_chars: int, max_chars: int) -> RewardFn:
    """A reward function: 1.0 up to ``target_chars`` characters, falling linearly to 0.0 at ``max_chars``."""
    if not 0 <= target_chars < max_chars:
        raise ValueError(f"need 0 <= target_chars < max_chars, got {target_chars}, {max_chars}")

    def length_reward(prompt: str, completion: str, **fields: Any) -> Reward:
        n = len(completion)
        value = 1.0 if n <= target_chars else max(0.0, (max_chars - n) / (max_chars - target_chars))
        return Reward(value, f"{n} characters (full reward up to {target_chars}, none from {max_chars})")

    length_reward.__name__ = length_reward.__qualname__ = f"length_penalty({target_chars}, {max_chars})"
    return length_reward


#: full reward up to 200 characters, none from 1,000
concise = length_penalty(200, 1000)


# --- the code's tests, in a sandbox ----------------------------------------------------------------------

_PYTHON_BLOCK = re.compile(r"```(?:python|py|python3)?[^\n]*\n(.*?)(?:\n```|$)", re.DOTALL)

#: runs in the sandbox: the solution, then each test in a copy of its namespace; reports on the last line
_RUNNER = r"""
import json, sys
spec = json.loads(sys.stdin.read())
nonce, results = spec.pop("nonce"), []
namespace = {"__name__": "solution"}
try:
    exec(compile(spec["solution"], "solution.py", "exec"), namespace)
    loaded = None
except BaseException as e:
    loaded = type(e).__name__ + ": " + str(e)[:200]
for test in spec["tests"]:
    if loaded is not None:
        results.append("solution failed to load: " + loaded)
        continue
    try:
        exec(compile(test, "test.py", "exec"), dict(namespace))
        results.append(None)
    except BaseException as e:
        results.append(type(e).__name__ + ": " + str(e)[:200])
sys.stdout.flush()
print("\n" + nonce + " " + json.dumps(results))
"""


def _solution(completion: str) -> str:
    blocks = _PYTHON_BLOCK.findall(completion)
    return blocks[-1] if blocks else completion


def code_tests(prompt: str, completion: str, tests: Any = None, timeout_s: float = 10.0, **fields: Any) -> Reward:
    """The share of the row's ``tests`` that pass against the completion's code, run in a bubblewrap sandbox.

    The code is the last fenced python block of the completion (else the whole completion); ``tests`` is a
    string of Python (``assert f(2) == 4``; one test) or a list of such strings (each its own test, run in
    a fresh copy of the solution's namespace). The run has no network, a read-only file system, a private
    /tmp and a wall-time limit. The solution runs in the same interpreter as the tests, so this suits
    honest datasets; for adversarial settings use the judge's ``sandbox_tests`` grader (answers compared
    in a separate process). Needs ``bwrap`` (bubblewrap) on the PATH: without it this raises (the sample is
    scored failed, with the reason), it never runs the code unsandboxed.
    """
    if isinstance(tests, str):
        tests = [tests]
    if not isinstance(tests, list) or not tests or not all(isinstance(t, str) for t in tests):
        raise ValueError(f"code_tests needs a 'tests' field: a string or a list of strings, got {tests!r:.80}")
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise RuntimeError("code_tests runs code under bubblewrap, and no 'bwrap' is on the PATH "
                           "(apt-get install bubblewrap)")
    nonce = os.urandom(16).hex()
    spec = json.dumps({"solution": _solution(completion), "tests": tests, "nonce": nonce})
    with tempfile.TemporaryDirectory(prefix="rlbus-code-tests-") as work:
        command = [bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp",
                   "--bind", work, work, "--chdir", work, "--unshare-all", "--die-with-parent",
                   "--new-session", "--", "python3", "-I", "-c", _RUNNER]
        try:
            run = subprocess.run(command, input=spec.encode(), capture_output=True, timeout=timeout_s,
                                 env={"PATH": "/usr/bin:/bin", "HOME": work, "PYTHONHASHSEED": "0"})
        except subprocess.TimeoutExpired:
            return Reward(0.0, f"the tests did not finish within {timeout_s:g} s")
    lines = run.stdout.decode("utf-8", errors="replace").splitlines()
    report = next((line[len(nonce) + 1:] for line in reversed(lines) if line.startswith(nonce + " ")), None)
    if report is None:
        stderr = run.stderr.decode("utf-8", errors="replace").strip().splitlines()[-2:]
        return Reward(0.0, f"no test report (exit code {run.returncode}): {' | '.join(stderr)}")
    results = json.loads(report)
    passed = sum(r is None for r in results)
    failures = "; ".join(r for r in results if r is not None)[:300]
    return Reward(passed / len(results), f"{passed}/{len(results)} tests passed" + (f"; {failures}" if failures else ""))


# --- naming reward functions in a run file ---------------------------------------------------------------

#: the functions a bare name in a run file refers to
LIBRARY: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "last_number": last_number,
    "math_verify": math_verify,
    "number_format": number_format,
    "think_answer_format": think_answer_format,
    "json_parses": json_parses,
    "concise": concise,
    "code_tests": code_tests,
}


def _where(e: BaseException, module_name: str) -> str:
    """`` (at FILE:LINE)``: where importing ``module_name`` failed: the last line of the module's own file
    in ``e``'s traceback, else its innermost frame."""
    if isinstance(e, SyntaxError) and e.filename:
        return f" (at {e.filename}:{e.lineno})"
    try:
        spec = importlib.util.find_spec(module_name)
    except Exception:  # a parent package that raises too: fall back to the innermost frame
        spec = None
    frames = traceback.extract_tb(e.__traceback__)
    own = [f for f in frames if spec is not None and f.filename == spec.origin]
    frame = (own or frames or [None])[-1]
    return f" (at {frame.filename}:{frame.lineno})" if frame is not None else ""


def resolve_reward(spec: str) -> RewardFn:
    """The function ``spec`` names: ``"package.module:function"``, or a bare name from :data:`LIBRARY`.

    Raises:
        RewardSpecError: the module cannot be found or raises while it is imported (the message names the
            error and where), has no such attribute, or it is not callable.
    """
    spec = spec.strip()
    if ":" not in spec:
        if spec in LIBRARY:
            return LIBRARY[spec]
        raise RewardSpecError(f"reward {spec!r} is not a shipped reward ({', '.join(LIBRARY)}); name your own "
                              "as 'package.module:function'")
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise RewardSpecError(f"reward {spec!r}: cannot import module {module_name!r} ({e}); is it on the "
                              "PYTHONPATH of the trainer and the judge?") from e
    except (Exception, SystemExit) as e:  # the module's own code failed: a fix in the module, not a retry
        raise RewardSpecError(f"reward {spec!r}: importing module {module_name!r} raised {type(e).__name__}: "
                              f"{e}{_where(e, module_name)}; fix the module (or name another reward)") from e
    fn: Any = module
    for part in attr.split("."):
        try:
            fn = getattr(fn, part)
        except AttributeError:
            raise RewardSpecError(f"reward {spec!r}: module {module_name!r} has no {attr!r}") from None
    if not callable(fn):
        raise RewardSpecError(f"reward {spec!r} is a {type(fn).__name__}, not a function")
    return fn
