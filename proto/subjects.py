"""Subject naming. Every run-scoped subject is ``rlbus.<run_id>.<family>[.<rest>]``.

Run ids are restricted to ``[A-Za-z0-9_-]`` so they are single subject tokens;
streams capture all runs with a ``*`` in the run position and consumers filter
on their own run, so two runs share one bus without seeing each other's work.
"""

from __future__ import annotations

import re

PREFIX = "rlbus"
_RUN_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class InvalidRunId(ValueError):
    pass


def check_run_id(run_id: str) -> str:
    if not _RUN_ID.match(run_id):
        raise InvalidRunId(
            f"run id {run_id!r} is invalid: use 1-64 characters from A-Z a-z 0-9 _ - (it is a NATS subject token)"
        )
    return run_id


def subject(run_id: str, family: str, *rest: str) -> str:
    """``rlbus.<run_id>.<family>.<rest...>``."""
    return ".".join([PREFIX, check_run_id(run_id), family, *rest])


def all_runs(family: str, *rest: str) -> str:
    """The wildcard subject a stream captures for a family, across runs."""
    return ".".join([PREFIX, "*", family, *rest])


def run_of(subj: str) -> str | None:
    """The run id token of a run-scoped subject, or None."""
    parts = subj.split(".")
    return parts[1] if len(parts) > 2 and parts[0] == PREFIX else None


def family_of(subj: str) -> str | None:
    parts = subj.split(".")
    return parts[2] if len(parts) > 2 and parts[0] == PREFIX else None


def covers(wild: str, subj: str) -> bool:
    """Whether every subject that ``subj`` matches (it may hold wildcards itself) is matched by ``wild``."""
    w, s = wild.split("."), subj.split(".")
    for i, tok in enumerate(w):
        if tok == ">":
            return len(s) > i
        if i >= len(s) or s[i] == ">" or (tok != "*" and tok != s[i]):
            return False
    return len(s) == len(w)


def overlaps(a: str, b: str) -> bool:
    """Whether some subject is matched by both ``a`` and ``b`` (wildcards allowed in both)."""
    x, y = a.split("."), b.split(".")
    for i in range(min(len(x), len(y))):
        if x[i] == ">" or y[i] == ">":
            return True
        if x[i] != y[i] and "*" not in (x[i], y[i]):
            return False
    return len(x) == len(y)
