"""bench/bus_gaps.py: a synchronous step's round trip split into stages, on a hand-built trace (times in ms)."""

from __future__ import annotations

import json

from bench.bus_gaps import STAGES, read_spans, step_gaps, summarize

MS = 1_000_000


def span(name, service, start, end, *, trace="t", sid=None, parent=None, links=(), **attrs):
    return {"trace_id": trace, "span_id": sid or f"{name}-{trace}-{start}", "parent_id": parent, "name": name,
            "service": service, "start_ns": int(start * MS), "end_ns": int(end * MS), "attributes": attrs,
            "links": [{"trace_id": t, "span_id": "x"} for t in links]}


def two_steps() -> list[dict]:
    """Step 1 trains, sends version 1; step 2's one group goes round the loop; its learner starts at 300."""
    return [
        span("train step", "trainer", 0, 150, trace="s1", sid="S1", step=1),
        span("learner step", "trainer", 0, 100, trace="s1", parent="S1"),
        span("publish weights", "trainer", 105, 145, trace="s1", parent="S1", version=1),
        span("apply weights", "rollout", 160, 165, trace="a1", version=1),
        span("admit group", "trainer", 150, 152, trace="g2"),
        span("handle rlbus.r.prompts", "rollout", 155, 240, trace="g2"),  # holds its wait for version 1
        span("generate group", "rollout", 166, 230, trace="g2"),
        span("handle rlbus.r.rollouts", "judge", 235, 270, trace="g2"),
        span("handle rlbus.r.trajectories", "trainer", 280, 281, trace="g2"),
        span("train step", "trainer", 300, 400, trace="s2", sid="S2", step=2, links=["g2"]),
        span("learner step", "trainer", 300, 390, trace="s2", parent="S2"),
    ]


def test_each_stage_is_measured_between_the_right_spans():
    (row,) = step_gaps(two_steps())
    assert row["step"] == 2
    want = {"snapshot": 5, "publish": 40, "to_apply": 15, "apply": 5, "to_tickets": 5, "tickets": 2,
            "to_rollout": 5, "to_generate": 11, "generate": 64, "to_judged": 40, "to_trainer": 11,
            "to_learner": 19, "round_trip": 200}
    for stage, ms in want.items():
        assert abs(row[stage] - ms) < 1e-6, (stage, row[stage], ms)
    # no span runs in 100-105, 145-150, 152-160 (the rollout's handler holds only a wait), 165-166, 230-235,
    # 270-280 and 281-300
    assert abs(row["uncovered"] - (5 + 5 + 8 + 1 + 5 + 10 + 19)) < 1e-6


def test_a_step_without_its_spans_is_left_out_and_medians_skip_the_warm_up(tmp_path):
    spans = [s for s in two_steps() if s["name"] != "apply weights"]
    assert step_gaps(spans) == []
    assert summarize([], skip=0) == {"steps": 0}
    rows = [{"step": i, **{k: float(i) for k in STAGES}} for i in range(2, 7)]
    assert summarize(rows, skip=2)["median_ms"]["publish"] == 5.0
    traces = tmp_path / "traces"
    traces.mkdir()
    (traces / "trainer-1.jsonl").write_text("\n".join(json.dumps(s) for s in two_steps()) + "\n{torn")
    assert len(read_spans(tmp_path)) == len(two_steps())
