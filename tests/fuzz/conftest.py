"""Fuzz figures: counted by the fuzz tests, printed at the end and written to
``$RLBUS_FIGURES_DIR/fuzz.json`` when that variable is set (for BENCHMARKS.md)."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import pytest


class Figures:
    """Named counters shared by the fuzz tests of one session."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def add(self, key: str, n: int = 1) -> None:
        self.counts[key] += n


@pytest.fixture(scope="session")
def fuzz_figures(request: pytest.FixtureRequest):
    figures = Figures()
    yield figures
    out = dict(sorted(figures.counts.items()))
    out.setdefault("decoder/crashes", 0)
    out.setdefault("bus/crashes", 0)
    line = "fuzz figures: " + json.dumps(out)
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(line)
    target = os.environ.get("RLBUS_FIGURES_DIR")
    if target:
        Path(target).mkdir(parents=True, exist_ok=True)
        (Path(target) / "fuzz.json").write_text(json.dumps(out, indent=2) + "\n")
