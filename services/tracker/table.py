"""The completions table: a sample of the trajectories trained in each step, joined with their outcomes.

Pure bookkeeping, no bus, no backend. A row needs two messages from two streams: the scored
trajectory (TRAJECTORIES: prompt, completion, reward, each grader's score) and its outcome
(OUTCOMES: the step that trained it, the version that step produced and the sample's version: the
staleness is how many versions the step's starting weights were ahead of the sample's). They arrive in either order, so both sides wait for each other,
within bounds:

* a trajectory waits for its outcome as a compact :class:`Pending` (texts already cut), at most
  ``max_waiting`` of them; beyond that the oldest is forgotten (counted); an outcome that makes no
  row and comes first is remembered (as many) so that its trajectory is not kept when it comes, and
  a chosen row is kept apart from the waiting ones, so the bound never drops a chosen row;
* each step keeps the ``rows_per_step`` trained trajectories with the smallest hash of their id:
  a uniform sample without replacement that is the same whatever order the outcomes come in (a
  re-run of the tracker over the same streams picks the same rows);
* a step is *ready* once an outcome of a later step has arrived and every chosen row has its
  trajectory, or once neither the step nor the trajectories have had news for ``after_s`` seconds
  (rows still missing then are counted and left out).
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from dataclasses import dataclass, field

from proto.accounting import TrajectoryOutcome
from proto.trajectories import ScoredTrajectory

#: the fixed columns (``env``: the environment, i.e. the task, of a run's mixture); each grader's score follows
#: as a column ``score/<grader>``
COLUMNS = ("step", "prompt", "completion", "reward", "staleness", "finish_reason", "group_id", "env")


def cut(text: str, limit: int) -> str:
    """``text`` shortened to ``limit`` characters, the cut marked with "…"."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _rank(trajectory_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(trajectory_id.encode(), digest_size=8).digest(), "big")


@dataclass
class Pending:
    """What a row keeps of a scored trajectory."""

    prompt: str
    completion: str
    reward: float
    scores: dict[str, float]
    finish_reason: str
    group_id: str
    env: str = ""


@dataclass
class _Step:
    chosen: dict[str, tuple[int, int]] = field(default_factory=dict)  # trajectory id -> (rank, staleness)
    last_news: float = 0.0


@dataclass
class Table:
    """One step's rows, ready to write: ``columns`` and ``rows`` (lists of cells in column order)."""

    step: int
    columns: list[str]
    rows: list[list[object]]


class CompletionSampler:
    """Joins trajectories and outcomes and hands out one :class:`Table` per trainer step."""

    def __init__(self, rows_per_step: int, max_text_chars: int, max_waiting: int, after_s: float) -> None:
        self.rows_per_step = rows_per_step
        self.max_text_chars = max_text_chars
        self.max_waiting = max_waiting
        self.after_s = after_s
        #: trajectories whose outcome has not come yet
        self._waiting: OrderedDict[str, Pending] = OrderedDict()
        #: chosen rows whose trajectory has come (bounded by rows_per_step per pending step)
        self._rows: dict[str, Pending] = {}
        #: chosen trajectory id -> its step
        self._chosen: dict[str, int] = {}
        #: ids whose outcome came first and makes no row: their trajectory is not kept when it comes
        self._settled: OrderedDict[str, None] = OrderedDict()
        self._steps: dict[int, _Step] = {}
        self._done_below = -1  # steps <= this were written (outcomes for them come too late)
        self._last_trajectory = -math.inf
        self.latest_step = -1
        #: counters, reported as tracker/... metrics
        self.forgotten = 0
        self.rows_missing = 0
        self.late_outcomes = 0

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def add_trajectory(self, t: ScoredTrajectory, now: float) -> None:
        """Keep what a row needs of a trained-to-be trajectory (eval and failed rollouts make no rows)."""
        self._last_trajectory = now
        if self.rows_per_step == 0 or t.rollout.is_eval:
            return
        if self._settled.pop(t.msg_id, 0) is None:
            return
        row = Pending(
            prompt=cut(t.rollout.prompt_text, self.max_text_chars),
            completion=cut(t.rollout.text(), self.max_text_chars),
            reward=t.reward,
            scores={s.grader: s.score for s in t.scores},
            finish_reason=t.rollout.finish_reason,
            group_id=t.rollout.group_id,
            env=t.rollout.task,
        )
        if t.msg_id in self._chosen:
            self._rows[t.msg_id] = row
            return
        self._waiting[t.msg_id] = row
        self._waiting.move_to_end(t.msg_id)
        while len(self._waiting) > self.max_waiting:
            self._waiting.popitem(last=False)
            self.forgotten += 1

    def add_outcome(self, o: TrajectoryOutcome, now: float) -> None:
        """Record what became of a trajectory: a trained one may be chosen for its step's table."""
        if self.rows_per_step == 0:
            return
        if o.outcome != "trained":
            self._no_row(o.trajectory_id)
            return
        if o.step <= self._done_below:
            self.late_outcomes += 1
            self._no_row(o.trajectory_id)
            return
        self.latest_step = max(self.latest_step, o.step)
        st = self._steps.setdefault(o.step, _Step())
        st.last_news = now
        # a trained outcome is recorded after its step, at the version the step produced: the step started
        # from version - 1, and its staleness (the trainer's own measure) is counted from there
        st.chosen[o.trajectory_id] = (_rank(o.trajectory_id), o.version - 1 - o.sample_version)
        self._chosen[o.trajectory_id] = o.step
        if (row := self._waiting.pop(o.trajectory_id, None)) is not None:
            self._rows[o.trajectory_id] = row
        if len(st.chosen) > self.rows_per_step:  # drop the largest rank: keep the k smallest
            worst = max(st.chosen, key=lambda k: st.chosen[k][0])
            del st.chosen[worst]
            del self._chosen[worst]
            if self._rows.pop(worst, None) is None:
                self._no_row(worst)

    def _no_row(self, tid: str) -> None:
        """``tid`` makes no row: forget its trajectory, or remember not to keep it when it comes."""
        if self._waiting.pop(tid, None) is None:
            self._settled[tid] = None
            while len(self._settled) > self.max_waiting:
                self._settled.popitem(last=False)

    def ready(self, now: float, force: bool = False) -> list[Table]:
        """The tables of the steps that are complete (``force``: every step, e.g. on stop), oldest first.

        A step is complete once a later step has outcomes and every chosen row has its trajectory. A
        row still missing is waited for as long as trajectories keep coming (following a finished run,
        the outcomes can be read far ahead of the trajectories); once neither the step nor the
        trajectories have had news for ``after_s``, the table is written without it."""
        out = []
        quiet = now - self._last_trajectory >= self.after_s
        for step in sorted(self._steps):
            st = self._steps[step]
            complete = step < self.latest_step and all(tid in self._rows for tid in st.chosen)
            if not (force or complete or (quiet and now - st.last_news >= self.after_s)):
                continue
            out.append(self._table(step, st))
            del self._steps[step]
            self._done_below = max(self._done_below, step)
        return out

    def _table(self, step: int, st: _Step) -> Table:
        picked = sorted(st.chosen.items(), key=lambda kv: kv[1][0])
        rows: list[tuple[Pending, int]] = []
        for tid, (_, staleness) in picked:
            del self._chosen[tid]
            p = self._rows.pop(tid, None)
            if p is None:
                self.rows_missing += 1
                continue
            rows.append((p, staleness))
        graders = sorted({g for p, _ in rows for g in p.scores})
        columns = [*COLUMNS, *(f"score/{g}" for g in graders)]
        return Table(step=step, columns=columns, rows=[
            [step, p.prompt, p.completion, p.reward, staleness, p.finish_reason, p.group_id, p.env,
             *(p.scores.get(g, math.nan) for g in graders)]
            for p, staleness in rows
        ])
