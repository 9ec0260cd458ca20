"""``rlbus trace``: a prompt group's trace as a tree with timings, read from the run directory.

Every service writes its spans to ``<run dir>/traces/<service>-<pid>.jsonl`` (see
:mod:`services.runtime.tracing`). A group's trace starts at the trainer's ``admit group`` span and holds
the rollout's generation (agent loops, turns, sandbox execs), the judge's graders and the trainer's
receipt; the ``train step`` that trained on it links to it, and each engine's ``apply weights`` links to
that step's ``publish weights``. ``rlbus trace GROUP_ID`` prints all of it; ``--slowest N`` the N groups
that took longest from admission to their last span.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class TraceError(Exception):
    """No traces, or no trace of the group asked for (the message says what was found)."""


@dataclass
class Span:
    trace_id: str
    span_id: str
    parent_id: str | None
    name: str
    service: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    links: list[tuple[str, str]]
    children: list[Span] = field(default_factory=list)

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


@dataclass
class Traces:
    spans: dict[str, Span]
    by_trace: dict[str, list[Span]]
    #: span id -> spans (of any trace) that link to it
    linked_from: dict[str, list[Span]]
    skipped_lines: int = 0

    def roots(self, trace_id: str) -> list[Span]:
        spans = self.by_trace.get(trace_id, [])
        ids = {s.span_id for s in spans}
        return sorted((s for s in spans if s.parent_id not in ids), key=lambda s: s.start_ns)

    def groups(self) -> dict[str, Span]:
        """``group_id`` -> its ``admit group`` root span."""
        return {str(s.attributes["group_id"]): s for s in self.spans.values()
                if s.name == "admit group" and "group_id" in s.attributes}

    def end_ns(self, trace_id: str) -> int:
        return max(s.end_ns for s in self.by_trace[trace_id])


def load(run_dir: str | Path) -> Traces:
    """Every span of the run directory's trace files (a torn last line, from a killed process, is skipped)."""
    folder = Path(run_dir) / "traces"
    files = sorted(folder.glob("*.jsonl")) if folder.is_dir() else []
    if not files:
        raise TraceError(f"no trace files in {folder}: the run wrote none (RLBUS_TRACES_FILE=0?) or this is "
                         "not its run directory")
    spans: dict[str, Span] = {}
    skipped = 0
    for path in files:
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                r = json.loads(line)
                s = Span(r["trace_id"], r["span_id"], r.get("parent_id"), r["name"], r.get("service", "?"),
                         int(r["start_ns"]), int(r["end_ns"]), dict(r.get("attributes") or {}),
                         [(link["trace_id"], link["span_id"]) for link in r.get("links") or []])
            except (ValueError, KeyError, TypeError):
                skipped += 1
                continue
            spans[s.span_id] = s
    by_trace: dict[str, list[Span]] = defaultdict(list)
    linked_from: dict[str, list[Span]] = defaultdict(list)
    for s in spans.values():
        by_trace[s.trace_id].append(s)
        for _, span_id in s.links:
            linked_from[span_id].append(s)
        parent = spans.get(s.parent_id) if s.parent_id else None
        if parent is not None:
            parent.children.append(s)
    for s in spans.values():
        s.children.sort(key=lambda c: c.start_ns)
    return Traces(spans, dict(by_trace), dict(linked_from), skipped)


def _attrs(s: Span) -> str:
    shown = {k: v for k, v in s.attributes.items() if k not in ("group_id",) and not isinstance(v, list)}
    return ("  " + " ".join(f"{k}={v}" for k, v in sorted(shown.items()))) if shown else ""


def _tree(s: Span, origin_ns: int, depth: int, out: list[str], max_children: int) -> None:
    out.append(f"{'  ' * depth}{s.name:<{max(1, 44 - 2 * depth)}} {s.service:<16} "
               f"+{(s.start_ns - origin_ns) / 1e9:8.3f}s {s.duration_s * 1e3:10.1f} ms{_attrs(s)}")
    for i, c in enumerate(s.children):
        if i == max_children:
            out.append(f"{'  ' * (depth + 1)}... {len(s.children) - max_children} more")
            break
        _tree(c, origin_ns, depth + 1, out, max_children)


def render_group(traces: Traces, group_id: str, max_children: int = 40) -> str:
    """The group's trace tree, then the train step(s) that linked to it and the engines that applied the
    versions those steps sent."""
    root = traces.groups().get(group_id)
    if root is None:
        known = sorted(traces.groups())
        hint = f"; groups traced: {', '.join(known[:5])}{' ...' if len(known) > 5 else ''}" if known else ""
        raise TraceError(f"no trace of group {group_id!r} in this run{hint}")
    out = [f"group {group_id}: trace {root.trace_id}, "
           f"{(traces.end_ns(root.trace_id) - root.start_ns) / 1e9:.3f} s from admission to its last span"]
    for r in traces.roots(root.trace_id):
        _tree(r, root.start_ns, 0, out, max_children)
    steps = {s.span_id: s for span in traces.by_trace[root.trace_id]
             for s in traces.linked_from.get(span.span_id, [])}
    for step in sorted(steps.values(), key=lambda s: s.start_ns):
        out.append(f"trained in (linked): {step.name} of trace {step.trace_id}")
        _tree(step, root.start_ns, 1, out, max_children)
        applies = {a.span_id: a for s in traces.by_trace[step.trace_id] for a in traces.linked_from.get(s.span_id, [])}
        for a in sorted(applies.values(), key=lambda s: s.start_ns):
            out.append(f"  applied by (linked): {a.service}")
            _tree(a, root.start_ns, 2, out, max_children)
    return "\n".join(out)


def slowest(traces: Traces, n: int) -> list[str]:
    """Group ids of the ``n`` traces that took longest from admission to their last span."""
    groups = traces.groups()
    ranked = sorted(groups, key=lambda g: traces.end_ns(groups[g].trace_id) - groups[g].start_ns, reverse=True)
    return ranked[:n]
