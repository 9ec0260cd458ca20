"""Word problems with a calculator: a multi-turn environment whose tool the model calls in native format.

The learning example for agentic runs (``examples/tool_use.toml``): the arithmetic word problems of
:mod:`services.tasks.word_problems` (one- and two-step, add, subtract, multiply), and one typed-function tool,
:func:`calculator`, which the chat template renders into the system turn. An episode::

    system  (the instruction, then the template's <tools> block)     user  (the question)
    assistant  <tool_call>{"name": "calculator", "arguments": {"expression": "7 * 8"}}</tool_call>
    tool       56                        (an error becomes the observation too: "error: ...")
    assistant  56                        (a turn without a call is the answer: the episode ends)

The model may also answer at once, without a call. **Reward**: 1 when the last number written outside tool
calls (all assistant turns) equals the answer, else 0; plus ``call_reward`` (default 0) on each turn whose
calls all ran without an error, a shaping term for models that never write a call on their own. The tool is
a module-level function, so it runs in the rollout's tool worker processes, bounded like rewards.
"""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Iterator
from typing import Any

from services.runtime.config import ConfigError
from services.tasks.base import Prompt, Reward, register_task
from services.tasks.env import Action, FunctionEnvironment, Step
from services.tasks.word_problems import WordProblemsTask

#: a worked example put before the question (``demo = true``): a question, the call, its result, the answer
DEMO: list[dict[str, Any]] = [
    {"role": "user", "content": "Mia has 4 bags with 6 pens in each bag. How many pens does Mia have in total?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "4 * 6"}}}]},
    {"role": "tool", "name": "calculator", "content": "24"},
    {"role": "assistant", "content": "24"},
]
SYSTEM_PROMPT = "Solve the word problem. Use the calculator tool for the arithmetic, then answer with the number only."
#: a hermes-format call, closed or cut off (its numbers are not the answer)
_CALL = re.compile(r"<tool_call>.*?(?:</tool_call>|$)", re.DOTALL)
_OPS: dict[type, Any] = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
                         ast.Div: operator.truediv}
_MAX_EXPRESSION = 200
_MAX_MAGNITUDE = 1e15


def calculator(expression: str) -> float:
    """Evaluate an arithmetic expression.

    Args:
        expression: e.g. "(12 - 5) * 3".
    """
    if len(expression) > _MAX_EXPRESSION:
        raise ValueError(f"the expression is longer than {_MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    value = _evaluate(tree.body)
    return int(value) if float(value).is_integer() else round(value, 6)


def _evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        value = node.value
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand) * (-1 if isinstance(node.op, ast.USub) else 1)
    elif isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ValueError("division by zero")
        value = _OPS[type(node.op)](left, right)
    else:
        raise ValueError(f"only numbers, + - * / and parentheses are allowed, not {ast.unparse(node)!r}")
    if abs(value) > _MAX_MAGNITUDE:
        raise ValueError("the result is too large")
    return value


def final_answer_text(completion: str) -> str:
    """The completion without its tool calls (what the answer is read from)."""
    return _CALL.sub(" ", completion)


@register_task("word_problems_calculator")
class CalculatorWordProblems(FunctionEnvironment):
    """Word problems (:class:`~services.tasks.word_problems.WordProblemsTask`) with a :func:`calculator` tool.

    Args:
        num_eval: size of the fixed held-out eval split.
        eval_seed: seed of the eval split.
        system_prompt: the system message (the template appends the tools to it).
        call_reward: turn reward for a turn whose calls all ran without an error (0 to 1; 0: none).
        demo: put a worked example (:data:`DEMO`: a question, a calculator call, its result, the answer) before
            the question, which shows a model that has never written a call how one looks.
    """

    name = "word_problems_calculator"
    tools = (calculator,)
    max_new_tokens = 64
    stop: list[str] = []

    def __init__(self, num_eval: int = 200, eval_seed: int = 20261202, system_prompt: str = SYSTEM_PROMPT,
                 call_reward: float = 0.0, demo: bool = False) -> None:
        if not 0.0 <= call_reward <= 1.0:
            raise ConfigError(f"config key task.options.call_reward: expected 0 to 1, got {call_reward}")
        self.problems = WordProblemsTask(num_eval=num_eval, eval_seed=eval_seed)
        self.system_prompt = system_prompt
        self.call_reward = call_reward
        self.demo = demo

    def _with_tools(self, prompt: Prompt) -> Prompt:
        messages = [{"role": "system", "content": self.system_prompt}, *(DEMO if self.demo else []),
                    {"role": "user", "content": prompt.text}]
        return Prompt(id=prompt.id.replace("word_problems/", f"{self.name}/", 1), text=prompt.text,
                      messages=messages, metadata=dict(prompt.metadata))

    def train_prompts(self, seed: int, start: int = 0) -> Iterator[Prompt]:
        """Endless stream; prompt id ``word_problems_calculator/train/<seed>/<position>``."""
        return (self._with_tools(p) for p in self.problems.train_prompts(seed, start))

    def eval_prompts(self) -> list[Prompt]:
        """The held-out split of the word problems; prompt id ``word_problems_calculator/eval/<k>``."""
        return [self._with_tools(p) for p in self.problems.eval_prompts()]

    def step(self, state: Any, action: Action) -> Step:
        """A turn without a call is the answer (done); a turn whose calls all ran earns ``call_reward``."""
        ran = bool(action.results) and all(r.error is None for r in action.results)
        return Step(reward=self.call_reward if ran and self.call_reward else None, done=action.calls == 0,
                    state=state)

    def reward(self, prompt: Prompt, completion: str) -> Reward:
        """1.0 when the last number outside tool calls equals the answer, else 0.0."""
        return self.problems.reward(prompt, final_answer_text(completion))
