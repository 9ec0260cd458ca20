"""The completions sampler: joins trajectories with their outcomes, one table per step, within bounds."""

from __future__ import annotations

import random

from proto.accounting import TrajectoryOutcome
from proto.rollouts import Rollout, Turn
from proto.trajectories import GraderScore, ScoredTrajectory
from services.tracker.table import COLUMNS, CompletionSampler, cut


def traj(tid: str, *, reward: float = 1.0, is_eval: bool = False, text: str = "42") -> ScoredTrajectory:
    rollout = Rollout(run_id="r", task="addition", group_id=f"g-{tid}", prompt_id="p", sample_index=0, group_size=1,
                      prompt_ids=[1], prompt_text=f"prompt of {tid}", finish_reason="eos", policy_version=0,
                      is_eval=is_eval, turns=[Turn(role="assistant", token_ids=[1], text=text)])
    t = ScoredTrajectory(run_id="r", rollout=rollout, reward=reward,
                         scores=[GraderScore(grader="exact", score=reward), GraderScore(grader="format", score=0.5)])
    t.msg_id = tid
    return t


def outcome(tid: str, step: int, kind: str = "trained", staleness: int = 1) -> TrajectoryOutcome:
    return TrajectoryOutcome(run_id="r", trajectory_id=tid, group_id=f"g-{tid}", outcome=kind, step=step,
                             version=step, sample_version=step - 1 - staleness)


def test_rows_join_in_either_order_and_the_sample_does_not_depend_on_it():
    ids = [f"t{i}" for i in range(20)]
    tables = []
    for seed in (0, 1):
        events = [("t", i) for i in ids] + [("o", i) for i in ids]
        random.Random(seed).shuffle(events)
        s = CompletionSampler(rows_per_step=5, max_text_chars=100, max_waiting=100, after_s=60)
        for kind, i in events:
            s.add_trajectory(traj(i), now=0.0) if kind == "t" else s.add_outcome(outcome(i, step=3, staleness=2), now=0.0)
        (table,) = s.ready(now=0.0, force=True)
        tables.append(table)
        assert s.waiting == 0  # nothing is kept that makes no row, whichever came first
    a, b = tables
    assert a.step == 3 and len(a.rows) == 5
    assert a.columns == [*COLUMNS, "score/exact", "score/format"]
    assert sorted(map(tuple, a.rows)) == sorted(map(tuple, b.rows))
    row = dict(zip(a.columns, a.rows[0], strict=True))
    tid = row["group_id"].removeprefix("g-")
    assert row == {"step": 3, "prompt": f"prompt of {tid}", "completion": "42", "reward": 1.0, "staleness": 2,
                   "finish_reason": "eos", "group_id": f"g-{tid}", "env": "addition", "score/exact": 1.0, "score/format": 0.5}


def test_a_step_is_ready_once_a_later_step_arrives_and_its_rows_are_joined():
    s = CompletionSampler(rows_per_step=2, max_text_chars=100, max_waiting=100, after_s=60)
    s.add_outcome(outcome("a", 1), now=0.0)
    s.add_outcome(outcome("b", 2), now=0.0)
    assert s.ready(now=1.0) == []  # step 1 waits for trajectory "a"
    s.add_trajectory(traj("a"), now=1.0)
    (t1,) = s.ready(now=1.0)
    assert t1.step == 1 and len(t1.rows) == 1
    assert s.ready(now=1.0) == []  # step 2 is the newest: more outcomes may come
    (t2,) = s.ready(now=61.0)  # ... until nothing was heard of it, nor of any trajectory, for after_s
    assert t2.step == 2 and t2.rows == [] and s.rows_missing == 1
    s.add_outcome(outcome("c", 1), now=62.0)  # an outcome of a step already written
    assert s.late_outcomes == 1 and s.ready(now=62.0, force=True) == []


def test_outcomes_read_far_ahead_of_trajectories_wait_for_them():
    """Following a finished run, the outcomes can be read long before the trajectories: tables wait as long
    as trajectories keep coming, and the waiting bound never drops a chosen row."""
    # max_waiting = 3: fewer than the 6 chosen rows, as many as the 3 outcomes that make no row
    s = CompletionSampler(rows_per_step=2, max_text_chars=100, max_waiting=3, after_s=60)
    ids = {step: [f"s{step}-{i}" for i in range(3)] for step in (1, 2, 3)}
    for step, tids in ids.items():
        for tid in tids:
            s.add_outcome(outcome(tid, step), now=0.0)
    t, tables = 0.0, []
    for step in (1, 2, 3):
        for tid in ids[step]:
            t += 50.0  # slower than after_s, but the trajectory side never goes quiet that long
            tables += s.ready(now=t)
            s.add_trajectory(traj(tid), now=t)
    tables += s.ready(now=t)
    assert [tb.step for tb in tables] == [1, 2]  # step 3 is the newest: more outcomes could come
    tables += s.ready(now=t + 60)  # ... until everything is quiet
    assert [tb.step for tb in tables] == [1, 2, 3] and all(len(tb.rows) == 2 for tb in tables)
    assert s.rows_missing == 0 and s.forgotten == 0 and s.waiting == 0


def test_eval_dropped_and_untrained_make_no_rows_and_waiting_is_bounded():
    s = CompletionSampler(rows_per_step=8, max_text_chars=10, max_waiting=3, after_s=60)
    s.add_trajectory(traj("e", is_eval=True), now=0.0)
    assert s.waiting == 0
    s.add_trajectory(traj("d"), now=0.0)
    s.add_outcome(outcome("d", 1, kind="dropped"), now=0.0)
    assert s.waiting == 0
    for i in range(5):
        s.add_trajectory(traj(f"w{i}", text="x" * 50), now=0.0)
    assert s.waiting == 3 and s.forgotten == 2  # the two oldest are forgotten
    s.add_outcome(outcome("w4", 1), now=0.0)
    (t,) = s.ready(now=0.0, force=True)
    assert t.rows[0][2] == "x" * 9 + "…"  # texts are cut to max_text_chars


def test_no_table_when_rows_per_step_is_zero():
    s = CompletionSampler(rows_per_step=0, max_text_chars=100, max_waiting=10, after_s=1)
    s.add_trajectory(traj("a"), now=0.0)
    s.add_outcome(outcome("a", 1), now=0.0)
    assert s.waiting == 0 and s.ready(now=100.0, force=True) == []


def test_cut():
    assert cut("abc", 3) == "abc" and cut("abcd", 3) == "ab…"
