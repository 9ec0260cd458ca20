"""A repository-fixing task for command agents: mini-swe-agent fixes a planted bug in a small Python package.

Each prompt is an issue report against ``inventory`` (``examples/swe_fix/package``: prices, stock levels,
labels), a few-file package in which one bug was planted from a handful of templates (:data:`BUGS`: a total
that skips the last line, a discount read in tenths, an inverted comparison, a floor instead of a ceiling,
a lost ``lower()``, ...); the example values of the report and the hidden cases are drawn per prompt, so
one template gives many prompts. The episode's sandbox starts with the package (bug planted) in its work
directory; the agent is ``examples/swe_fix/run_mini_swe_agent.py`` (stock mini-swe-agent through the
rollout's endpoint), run as the sandbox's command (:class:`services.tasks.black_box.CommandAgentTask`).

Grading: the judge's ``sandbox_tests`` grader runs ``examples/swe_fix/hidden_tests.py`` in a fork of the
sandbox the agent left: the bugged function's hidden cases passed (of 4), or 0 when the change broke one of
the other functions. The cases travel on the runner's stdin, never on disk.

The sandbox must let ``python3`` import mini-swe-agent: ``[services.sandbox] python_packages = true``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.tasks.base import Prompt, Reward, register_task
from services.tasks.black_box import CommandAgentTask
from services.tasks.graders import HiddenTests

#: the example's directory in this repository (the package, the agent's driver, the hidden tests)
EXAMPLE_DIR = Path(__file__).resolve().parents[2] / "examples" / "swe_fix"
DRIVER = ".rlbus/run_mini_swe_agent.py"
RUNNER = ".rlbus_hidden/run_tests.py"
CASES = 4


@dataclass(frozen=True)
class Bug:
    """A bug template: the line as shipped and as planted, and the function's right and wrong behaviour."""

    name: str
    file: str
    function: str
    correct: str
    planted: str
    inputs: Callable[[random.Random], list[Any]]
    right: Callable[..., Any]
    wrong: Callable[..., Any]


def _lines(rng: random.Random) -> list[Any]:
    return [[[rng.choice([0.5, 1.0, 2.5, 4.0, 10.0]), rng.randint(1, 5)] for _ in range(rng.randint(2, 4))]]


def _levels(rng: random.Random) -> list[Any]:
    names = rng.sample(["nails", "screws", "bolts", "hinges", "washers", "rivets"], rng.randint(3, 4))
    return [{n: rng.randint(0, 30) for n in names}, rng.randint(5, 15)]


def _name(rng: random.Random) -> list[Any]:
    words = rng.sample(["Steel", "Wool", "Brass", "Hinge", "Pads", "Copper", "Pipe", "Glue"], rng.randint(2, 3))
    return [(" " * rng.randint(0, 2)) + (" " * rng.randint(1, 2)).join(words) + (" " * rng.randint(0, 2))]


BUGS: list[Bug] = [
    Bug("total_skips_last_line", "inventory/pricing.py", "total",
        "sum(price * quantity for price, quantity in lines)",
        "sum(price * quantity for price, quantity in lines[:-1])", _lines,
        lambda lines: sum(p * q for p, q in lines), lambda lines: sum(p * q for p, q in lines[:-1])),
    Bug("discount_in_tenths", "inventory/pricing.py", "apply_discount", "percent / 100", "percent / 10",
        lambda rng: [rng.choice([20.0, 50.0, 80.0, 120.0, 200.0]), rng.choice([1, 2, 4, 5, 8])],
        lambda price, pct: round(price * (1 - pct / 100), 2), lambda price, pct: round(price * (1 - pct / 10), 2)),
    Bug("low_stock_inverted", "inventory/stock.py", "low_stock", "quantity < threshold", "quantity > threshold",
        _levels, lambda levels, t: sorted(n for n, q in levels.items() if q < t),
        lambda levels, t: sorted(n for n, q in levels.items() if q > t)),
    Bug("restock_rounds_down", "inventory/stock.py", "restock", "return -(-missing // batch) * batch",
        "return (missing // batch) * batch", lambda rng: [rng.randint(1, 40), rng.randint(3, 12)],
        lambda m, b: 0 if m <= 0 else -(-m // b) * b, lambda m, b: 0 if m <= 0 else (m // b) * b),
    Bug("slugify_keeps_case", "inventory/text.py", "slugify", '"-".join(name.lower().split())',
        '"-".join(name.split())', _name, lambda name: "-".join(name.lower().split()),
        lambda name: "-".join(name.split())),
]


@register_task("swe_fix")
class SweFixTask(CommandAgentTask):
    """Fix the planted bug of an issue report with mini-swe-agent (see the module docstring).

    Args:
        num_eval: size of the fixed held-out eval split.
        eval_seed: seed of the eval split.
        step_limit: the agent's own step limit (0: none; the session's budget still holds).
        max_tokens: completion tokens the agent asks for per model call.
        temperature: the agent's sampling temperature.
        test_timeout_s: wall time of the hidden tests.
    """

    name = "swe_fix"
    agent_command = f"python3 {DRIVER}"

    def __init__(self, num_eval: int = 8, eval_seed: int = 20261206, step_limit: int = 0, max_tokens: int = 256,
                 temperature: float = 1.0, test_timeout_s: float = 20.0) -> None:
        if not (EXAMPLE_DIR / "package").is_dir():
            raise FileNotFoundError(f"task swe_fix: its repository is missing: {EXAMPLE_DIR / 'package'}")
        self.num_eval = num_eval
        self.eval_seed = eval_seed
        self.step_limit = step_limit
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.test_timeout_s = test_timeout_s
        package = EXAMPLE_DIR / "package"
        self.files = {str(p.relative_to(package)): p.read_bytes() for p in sorted(package.rglob("*"))
                      if p.is_file() and "__pycache__" not in p.parts}
        for bug in BUGS:  # a template that no longer matches the package is said at once, naming it
            if self.files[bug.file].decode().count(bug.correct) != 1:
                raise ValueError(f"task swe_fix: bug {bug.name!r}: {bug.correct!r} is not once in {bug.file}")
        self.driver = (EXAMPLE_DIR / "run_mini_swe_agent.py").read_bytes()
        self.runner = (EXAMPLE_DIR / "hidden_tests.py").read_bytes()
        others = random.Random("swe_fix-others")
        self.others = {b.function: [[args, b.right(*args)] for args in (b.inputs(others) for _ in range(2))]
                       for b in BUGS}

    def _prompt(self, prompt_id: str, rng: random.Random) -> Prompt:
        bug = rng.choice(BUGS)
        cases: list[list[Any]] = []
        for _ in range(500):  # cases the bug gets wrong, so an unfixed repository scores 0
            args = bug.inputs(rng)
            if bug.right(*args) != bug.wrong(*args) and all(args != c[0] for c in cases):
                cases.append([args, bug.right(*args)])
            if len(cases) == CASES + 1:
                break
        (example, right), hidden = cases[0], cases[1:]
        call = f"inventory.{bug.function}({', '.join(repr(a) for a in example)})"
        text = (f"Bug in `{bug.function}` ({bug.file}): `{call}` returns {bug.wrong(*example)!r}, but it should "
                f"return {right!r}. Fix the bug in the repository in the current directory; keep the function's "
                "name and arguments.")
        return Prompt(id=prompt_id, text=text, metadata={"bug": bug.name, "function": bug.function,
                                                         "tests": json.dumps(hidden)})

    def train_prompts(self, seed: int, start: int = 0) -> Iterator[Prompt]:
        """Endless stream; prompt id ``swe_fix/train/<seed>/<position>``."""
        position = start
        while True:
            yield self._prompt(f"swe_fix/train/{seed}/{position}", random.Random(f"swe_fix:{seed}:{position}"))
            position += 1

    def eval_prompts(self) -> list[Prompt]:
        """The held-out split (the same templates, other values); prompt id ``swe_fix/eval/<k>``."""
        return [self._prompt(f"swe_fix/eval/{k}", random.Random(f"swe_fix-eval:{self.eval_seed}:{k}"))
                for k in range(self.num_eval)]

    # --- the agent's sandbox -----------------------------------------------------------------------------

    def sandbox_files(self, prompt: Prompt) -> dict[str, bytes]:
        """The package with the prompt's bug planted, and the agent's driver."""
        bug = next(b for b in BUGS if b.name == prompt.metadata["bug"])
        files = dict(self.files)
        files[bug.file] = files[bug.file].decode().replace(bug.correct, bug.planted).encode()
        return {**files, DRIVER: self.driver}

    def agent_env(self, prompt: Prompt) -> dict[str, str]:
        """The driver's settings; mini-swe-agent quiet, offline, with cost tracking off and no retries (a call
        the session refuses ends the agent)."""
        return {"RLBUS_MAX_TOKENS": str(self.max_tokens), "RLBUS_TEMPERATURE": str(self.temperature),
                "RLBUS_STEP_LIMIT": str(self.step_limit), "MSWEA_COST_TRACKING": "ignore_errors",
                "MSWEA_SILENT_STARTUP": "1", "MSWEA_GLOBAL_CONFIG_DIR": "/tmp/mini-swe-agent",
                "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": "1", "LITELLM_LOCAL_MODEL_COST_MAP": "True"}

    # --- grading -----------------------------------------------------------------------------------------

    def hidden_tests(self, prompt: Prompt) -> HiddenTests:
        """The runner (a file in the fork) and the cases with their answers (on its stdin)."""
        function = prompt.metadata["function"]
        spec = {"target": function, "cases": json.loads(prompt.metadata["tests"]),
                "others": {f: c for f, c in self.others.items() if f != function}, "timeout_s": self.test_timeout_s}
        return HiddenTests(command=["python3", RUNNER], files={RUNNER: self.runner}, stdin=json.dumps(spec).encode(),
                           timeout_s=self.test_timeout_s + 10.0)

    def reward(self, prompt: Prompt, completion: str) -> Reward:
        """Not a score of the fix (the hidden tests are): 0, saying so, for a run that grades with it."""
        return Reward(0.0, "swe_fix is graded by its hidden tests: configure a sandbox_tests grader")
