"""A coding task for agents: write a small Python function in a sandbox, graded by hidden tests in a fork.

Each prompt asks for one function (``add_7(x)``, ``count_a(s)``, ...) with one worked example. The agent
works in its sandbox with the tools of :mod:`services.rollout.agent` (fenced code blocks: write a file, run
Python, run a shell command; the system prompt documents them) and may test its code. Its submission is
``solution.py``: the file it wrote, or else the last ```` ```python ```` block of its messages that defines
the function (saved when the episode ends).

Grading: :meth:`CodingTask.hidden_tests` gives the sandbox-tests grader a runner script; the expected
answers travel on the runner's stdin, never on disk, and the submission runs in a child process that only
reports return values, so printing a fake report cannot pass a test. :meth:`CodingTask.reward` is only a
format check (does the answer define the function?) for a small shaping weight or single-turn use.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from services.tasks.base import Prompt, Reward, encode_chat, encode_text, register_task
from services.tasks.graders import TEST_REPORT_PREFIX, HiddenTests
from services.tasks.tools import TOOL_FORMAT_DOC

SOLUTION = "solution.py"
RUNNER = ".rlbus_hidden/run_tests.py"

SYSTEM_PROMPT = (
    "You are a Python programmer working in a sandbox (a Linux machine with python3) in your working "
    f"directory.\n{TOOL_FORMAT_DOC}\nYour solution is the file {SOLUTION}. If you do not write it, the last "
    "```python block that defines the function is saved as solution.py when you are done."
)

_WORDS = ["apple", "banana", "level", "racecar", "python", "sandbox", "agent", "hello", "noon", "kayak",
          "rollout", "judge", "queue", "stream", "trainer", "mama", "zebra", "aa", "", "abcba"]


@dataclass(frozen=True)
class Family:
    """A kind of function: its name and description for a parameter, and inputs with a reference."""

    name: Callable[[Any], str]
    signature: str
    describe: Callable[[Any], str]
    params: list[Any]
    inputs: Callable[[random.Random], list[Any]]
    reference: Callable[[Any, list[Any]], Any]


def _ints(lo: int, hi: int) -> Callable[[random.Random], list[Any]]:
    return lambda rng: [rng.randint(lo, hi)]


def _word(rng: random.Random) -> list[Any]:
    return [rng.choice(_WORDS)]


def _numbers(rng: random.Random) -> list[Any]:
    return [[rng.randint(-9, 20) for _ in range(rng.randint(0, 6))]]


FAMILIES: list[Family] = [
    Family(lambda n: f"add_{n}", "x", lambda n: f"returns x plus {n}", list(range(1, 21)), _ints(-50, 50),
           lambda n, a: a[0] + n),
    Family(lambda n: f"times_{n}", "x", lambda n: f"returns x multiplied by {n}", list(range(2, 13)),
           _ints(-20, 20), lambda n, a: a[0] * n),
    Family(lambda n: f"minus_{n}", "x", lambda n: f"returns x minus {n}", list(range(1, 21)), _ints(-50, 50),
           lambda n, a: a[0] - n),
    Family(lambda n: f"power_{n}", "x", lambda n: f"returns x raised to the power {n}", [2, 3, 4], _ints(-6, 6),
           lambda n, a: a[0] ** n),
    Family(lambda n: f"is_multiple_of_{n}", "x", lambda n: f"returns True if x is divisible by {n}, else False",
           list(range(2, 10)), _ints(-40, 40), lambda n, a: a[0] % n == 0),
    Family(lambda n: f"cap_at_{n}", "x", lambda n: f"returns the smaller of x and {n}", list(range(0, 30, 3)),
           _ints(-40, 40), lambda n, a: min(a[0], n)),
    Family(lambda n: f"repeat_{n}", "s", lambda n: f"returns the string s repeated {n} times", [2, 3, 4], _word,
           lambda n, a: a[0] * n),
    Family(lambda c: f"count_{c}", "s", lambda c: f"returns how many times the letter '{c}' occurs in the string s",
           list("aeiounr"), _word, lambda c, a: a[0].count(c)),
    Family(lambda c: f"starts_with_{c}", "s", lambda c: f"returns True if the string s starts with '{c}', else False",
           list("abkprs"), _word, lambda c, a: a[0].startswith(c)),
    Family(lambda n: f"sum_above_{n}", "numbers",
           lambda n: f"returns the sum of the numbers in the list that are greater than {n}", list(range(0, 10)),
           _numbers, lambda n, a: sum(v for v in a[0] if v > n)),
]

#: the runner in the fork: cases on stdin, the submission in a child process that reports values only
_RUNNER = r'''
import json, subprocess, sys
spec = json.loads(sys.stdin.read())
mark = "RLBUS-CHILD-RESULT "
child = """
import json, sys
spec = json.loads(sys.stdin.read())
def encode(v):
    try:
        return {"value": json.loads(json.dumps(v))}
    except (TypeError, ValueError):
        return {"error": "returned a value of type " + type(v).__name__}
try:
    import solution
    fn = getattr(solution, spec["function"])
except BaseException as e:
    print(MARK + json.dumps({"import_error": type(e).__name__ + ": " + str(e)[:200]}))
    sys.exit(0)
out = []
for args in spec["args"]:
    try:
        out.append(encode(fn(*args)))
    except BaseException as e:
        out.append({"error": type(e).__name__ + ": " + str(e)[:200]})
print(MARK + json.dumps(out))
""".replace("MARK", repr(mark))
cases = spec["cases"]
failures = []
try:
    proc = subprocess.run([sys.executable, "-c", child], input=json.dumps(
        {"function": spec["function"], "args": [c[0] for c in cases]}), capture_output=True, text=True,
        timeout=spec["timeout_s"])
    lines = [l for l in proc.stdout.splitlines() if l.startswith(mark)]
    result = json.loads(lines[-1][len(mark):]) if lines else {"import_error": "no result: " + proc.stderr[-200:]}
except subprocess.TimeoutExpired:
    result = {"import_error": "timed out after %ss" % spec["timeout_s"]}
def same(a, b):
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and abs(a - b) <= 1e-6 * max(1, abs(b))
    return a == b
passed = 0
if isinstance(result, dict):
    failures.append(result.get("import_error", "bad result"))
else:
    for (args, expected), got in zip(cases, result):
        call = "%s(%s)" % (spec["function"], ", ".join(repr(a) for a in args))
        if "value" in got and same(got["value"], expected):
            passed += 1
        elif "value" in got:
            failures.append("%s returned %r, expected %r" % (call, got["value"], expected))
        else:
            failures.append("%s raised %s" % (call, got.get("error")))
print(PREFIX + json.dumps({"passed": passed, "total": len(cases), "failures": failures[:3]}))
sys.exit(0 if passed == len(cases) else 1)
'''.replace("PREFIX", repr(TEST_REPORT_PREFIX))

_PYTHON_BLOCK = re.compile(r"```(?:python|py|python3)[^\n]*\n(.*?)(?:\n```|$)", re.DOTALL)


@register_task("coding")
class CodingTask:
    """Write one small Python function per prompt; graded by hidden tests (see the module docstring).

    Args:
        num_eval: size of the fixed held-out eval split.
        num_tests: hidden test cases per prompt.
        eval_seed: seed of the eval split.
        test_timeout_s: wall time of the hidden-test child process.
    """

    name = "coding"
    max_new_tokens = 160
    stop: list[str] = []
    tools: tuple[str, ...] = ("write", "python", "bash")

    def __init__(self, num_eval: int = 32, num_tests: int = 6, eval_seed: int = 20261202,
                 test_timeout_s: float = 10.0) -> None:
        self.num_tests = num_tests
        self.test_timeout_s = test_timeout_s
        pairs = [(f, p) for f in range(len(FAMILIES)) for p in range(len(FAMILIES[f].params))]
        rng = random.Random(f"coding-eval:{eval_seed}")
        rng.shuffle(pairs)
        self._eval_pairs = pairs[: min(num_eval, len(pairs) // 4)]
        self._train_pairs = [p for p in pairs if p not in set(self._eval_pairs)]

    def _prompt(self, prompt_id: str, family: int, param: int, rng: random.Random) -> Prompt:
        fam = FAMILIES[family]
        value = fam.params[param]
        name = fam.name(value)
        cases: list[list[Any]] = []
        seen: set[str] = set()
        while len(cases) < self.num_tests + 1 and len(seen) < 200:
            args = fam.inputs(rng)
            key = json.dumps(args)
            if key not in seen:
                seen.add(key)
                cases.append([args, fam.reference(value, args)])
        example, hidden = cases[0], cases[1:]
        call = f"{name}({', '.join(repr(a) for a in example[0])})"
        question = (f"Write a Python function `{name}({fam.signature})` that {fam.describe(value)}. "
                    f"For example, {call} should return {example[1]!r}.")
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]
        return Prompt(id=prompt_id, text=question, messages=messages,
                      metadata={"function": name, "tests": json.dumps(hidden)})

    def train_prompts(self, seed: int, start: int = 0) -> Iterator[Prompt]:
        """Endless stream; prompt id ``coding/train/<seed>/<position>``; no function of the eval split."""
        position = start
        while True:
            rng = random.Random(f"coding-train:{seed}:{position}")
            family, param = rng.choice(self._train_pairs)
            yield self._prompt(f"coding/train/{seed}/{position}", family, param, rng)
            position += 1

    def eval_prompts(self) -> list[Prompt]:
        """The held-out split; prompt id ``coding/eval/<k>``."""
        return [self._prompt(f"coding/eval/{k}", f, p, random.Random(f"coding-eval-cases:{k}"))
                for k, (f, p) in enumerate(self._eval_pairs)]

    def format_prompt(self, tokenizer: Any, prompt: Prompt) -> list[int]:
        """The chat template over the system prompt and question (plain text for tokenizers without one)."""
        if not prompt.messages:
            raise ValueError(f"prompt {prompt.id} has no messages; coding prompts are chat prompts")
        if getattr(tokenizer, "chat_template", None):
            return encode_chat(tokenizer, prompt.messages)
        return encode_text(tokenizer, "\n\n".join(m["content"] for m in prompt.messages) + "\n\n")

    # --- the agent's environment -------------------------------------------------------------------------

    def sandbox_files(self, prompt: Prompt) -> dict[str, bytes]:
        """The sandbox starts empty (the work directory only)."""
        return {}

    def submission_files(self, prompt: Prompt, assistant_texts: list[str], written: set[str]) -> dict[str, bytes]:
        """``solution.py`` from the last python block defining the function, unless the agent wrote it itself."""
        if SOLUTION in written:
            return {}
        code = self.last_definition(prompt, "\n".join(assistant_texts))
        return {} if code is None else {SOLUTION: code.encode()}

    @staticmethod
    def last_definition(prompt: Prompt, text: str) -> str | None:
        """The last ```python block in ``text`` that defines the prompt's function."""
        name = prompt.metadata.get("function", "")
        blocks = [b for b in _PYTHON_BLOCK.findall(text) if re.search(rf"^\s*def {re.escape(name)}\s*\(", b, re.M)]
        return blocks[-1].rstrip() + "\n" if blocks else None

    # --- grading -----------------------------------------------------------------------------------------

    def hidden_tests(self, prompt: Prompt) -> HiddenTests:
        """The runner (a file in the fork) and the cases with their answers (on its stdin)."""
        spec = {"function": prompt.metadata["function"], "cases": json.loads(prompt.metadata["tests"]),
                "timeout_s": self.test_timeout_s}
        return HiddenTests(command=["python3", RUNNER], files={RUNNER: _RUNNER.encode()},
                           stdin=json.dumps(spec).encode(), timeout_s=self.test_timeout_s + 10.0)

    def reward(self, prompt: Prompt, completion: str) -> Reward:
        """Format only: 1.0 when a python block defines the function (the hidden tests judge correctness)."""
        name = prompt.metadata.get("function", "?")
        if self.last_definition(prompt, completion) is not None:
            return Reward(1.0, f"defines {name}() in a python block")
        return Reward(0.0, f"no python block defines {name}()")
