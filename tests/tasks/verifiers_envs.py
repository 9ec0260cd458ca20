"""verifiers environments written with verifiers 0.4.0's own classes (``verifiers.v1``), for the verifiers
task's tests: local data, nothing from the Hub.

* :class:`SumTaskset` (a taskset package: ``__all__`` exports it) — single-turn: a question per task, two
  reward functions (``contains_answer`` weight 1, ``brief`` weight 0.5) and a metric;
* :func:`load_environment` — the same taskset through a ``load_environment(**args)`` entry (the form most
  environments ship), ``size`` tasks;
* :func:`load_dialogue` — multi-turn: an ``Env`` whose ``run`` answers each assistant turn as the user until
  the exchange is done (two turns), rewarded on the turns it saw;
* :func:`load_broken` — a reward function that raises, and :func:`load_garbage` one that returns NaN
  (``rubric`` of the taskset's config);
* :func:`load_not_env` returns something that is not an environment;
* :func:`load_tools` — a ToolEnv: each task serves two Python tools (tests/tasks/verifiers_tools.py).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import verifiers.v1 as vf
from datasets import Dataset

ROWS = Dataset.from_list([{"question": f"What is {a} + {b}?", "answer": str(a + b)}
                          for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (2, 2), (9, 1), (4, 4), (6, 3)]])


class SumData(vf.TaskData):
    answer: str
    #: how ``contains_answer`` behaves: scores, raises, or returns NaN
    rubric: str = "ok"


class SumConfig(vf.TasksetConfig):
    size: int = 8
    rubric: str = "ok"


class SumTask(vf.Task[SumData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def contains_answer(self, task: SumData, trace: vf.Trace) -> float:
        if task.rubric == "raises":
            raise RuntimeError("the rubric broke")
        if task.rubric == "nan":
            return float("nan")
        return 1.0 if task.answer in trace.last_reply else 0.0

    @vf.reward(weight=0.5)
    async def brief(self, trace: vf.Trace) -> float:
        return 1.0 if len(trace.last_reply) <= 40 else 0.0

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))


class SumTaskset(vf.Taskset[SumTask, SumConfig]):
    def load(self) -> Iterator[SumTask]:
        for row in ROWS.select(range(self.config.size)):
            yield SumTask(SumData(prompt=row["question"], answer=row["answer"], rubric=self.config.rubric,
                                  system_prompt="Answer with the number."), self.config.task)


__all__ = ["SumTaskset"]


def _config(**taskset_args: object) -> vf.EnvConfig:
    return vf.resolve_env_config({"taskset": {"id": _taskset_id(), **taskset_args}})


def load_environment(size: int = 8) -> vf.Env:
    return vf.load_environment(_config(size=size))


# --- multi-turn ---------------------------------------------------------------------------------------------

class DialogueConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()
    turns: int = 2
    #: the environment's own run raises after the first turn
    fail: bool = False


class DialogueEnv(vf.Env[DialogueConfig]):
    """The environment plays the user: after each assistant turn it says how many turns are left
    (``env_response``) until ``turns`` replies were given (``is_completed``); the reward counts the replies."""

    async def run(self, task: vf.Task, agents: vf.Agents) -> None:
        replies = 0
        async with agents.agent.interaction(task) as interaction:
            segment = await interaction.turn()
            if self.config.fail:
                raise RuntimeError("the environment broke")
            while not segment.terminated:
                replies += 1
                if replies >= self.config.turns:  # is_completed
                    break
                segment = await interaction.turn(f"{self.config.turns - replies} more, please.")  # env_response
        interaction.trace.record_reward("replied_every_turn", replies / self.config.turns, 1.0)


def load_dialogue(turns: int = 2, fail: bool = False) -> vf.Env:
    cfg = DialogueConfig.model_validate({"taskset": {"id": _taskset_id()}, "turns": turns, "fail": fail})
    return DialogueEnv(cfg)


def _taskset_id() -> str:
    """This module under an undotted name verifiers' loader can import."""
    import sys

    sys.modules.setdefault("rlbus_test_verifiers_envs", sys.modules[__name__])
    return "rlbus_test_verifiers_envs"


# --- broken ones -------------------------------------------------------------------------------------------


def load_broken() -> vf.Env:
    return vf.load_environment(_config(rubric="raises"))


def load_garbage() -> vf.Env:
    return vf.load_environment(_config(rubric="nan"))


def load_not_env() -> dict:
    return {"not": "an environment"}



# --- tools (the taskset lives in tests/tasks/verifiers_tools.py: a taskset module exports one Taskset) -------


def load_tools(size: int = 8) -> vf.Env:
    """A ToolEnv: the tasks of :class:`SumTaskset`, each serving two Python tools (``add``, ``multiply``) and one
    that raises (``divide`` by zero) over MCP; see tests/tasks/verifiers_tools.py."""
    from tests.tasks import verifiers_tools

    sys.modules.setdefault("rlbus_test_verifiers_tools", verifiers_tools)
    return vf.load_environment(vf.resolve_env_config({"taskset": {"id": "rlbus_test_verifiers_tools",
                                                                  "size": size}}))
