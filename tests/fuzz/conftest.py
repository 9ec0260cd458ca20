"""Fuzz figures: counted by the fuzz tests, printed in the terminal summary and written to
``$RLBUS_FIGURES_DIR/fuzz.json`` when that variable is set (for BENCHMARKS.md)."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

import pytest


class Figures:
    """Named counters shared by the fuzz tests of one session."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def add(self, key: str, n: int = 1) -> None:
        self.counts[key] += n

    def summary(self) -> dict[str, int]:
        out = dict(sorted(self.counts.items()))
        out.setdefault("decoder/crashes", 0)
        out.setdefault("bus/crashes", 0)
        return out


FIGURES = Figures()


@pytest.fixture(scope="session")
def fuzz_figures() -> Figures:
    return FIGURES


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    target = os.environ.get("RLBUS_FIGURES_DIR")
    if target and FIGURES.counts:
        Path(target).mkdir(parents=True, exist_ok=True)
        (Path(target) / "fuzz.json").write_text(json.dumps(FIGURES.summary(), indent=2) + "\n")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if FIGURES.counts:
        terminalreporter.write_line("fuzz figures: " + json.dumps(FIGURES.summary()))
