"""A ToolEnv written with verifiers 0.4.0's own classes: the addition tasks of tests/tasks/verifiers_envs.py, each
serving :class:`ArithmeticToolset` — two Python tools, ``add`` and ``multiply``, and ``divide``, which raises
on a zero divisor — as an MCP server. verifiers starts that server per episode as ``python -m
tests.tasks.verifiers_tools`` (its ``subprocess`` runtime), so the repository must be on the ``PYTHONPATH`` of
the process running the episode. Rewarded as the addition tasks are (the last reply holds the answer)."""

from __future__ import annotations

from collections.abc import Iterator

import verifiers.v1 as vf

from tests.tasks.verifiers_envs import ROWS, SumData, SumTask, SumTaskset


class ArithmeticToolset(vf.Toolset[vf.ToolsetConfig]):
    """Two Python tools, and one that raises (``divide`` by zero); the model calls them ``calc_<tool>``."""

    TOOL_PREFIX = "calc"

    @vf.tool
    def add(self, a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    @vf.tool
    def multiply(self, a: int, b: int) -> int:
        """Multiply two integers."""
        return a * b

    @vf.tool
    def divide(self, a: int, b: int) -> float:
        """Divide a by b."""
        if b == 0:
            raise ZeroDivisionError("cannot divide by zero")
        return a / b


class ToolTask(SumTask):
    @classmethod
    def toolsets(cls, config: vf.TaskConfig) -> list[vf.Toolset]:
        return [ArithmeticToolset(vf.ToolsetConfig())]


class ToolTaskset(SumTaskset):
    def load(self) -> Iterator[ToolTask]:  # type: ignore[override]
        for row in ROWS.select(range(self.config.size)):
            yield ToolTask(SumData(prompt=row["question"], answer=row["answer"],
                                   system_prompt="Use the tools, then answer with the number."), self.config.task)


__all__ = ["ToolTaskset"]

if __name__ == "__main__":  # the tool server verifiers starts per episode
    ArithmeticToolset.run()
