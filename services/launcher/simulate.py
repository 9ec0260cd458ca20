"""A discrete-event model of the RL loop, for planning: ``rlbus simulate``.

What it models (one prompt group = ``group_size`` sequences; times in seconds):

* **Trainer**: admission keeps at most ``max_in_flight`` groups in flight (default ``(max_staleness + 1) *
  groups_per_step``, as :mod:`services.trainer.admission` does); a group whose version is more than
  ``max_staleness`` behind is dropped; a step takes ``groups_per_step`` complete groups, runs the learner
  (``learn_fixed_s + learn_per_token_s * batch tokens``) and publishes the next version (``publish_s``).
  With ``overlap_publish`` (the trainer's default) the publish and the commit run beside the next learner
  step, which waits for them only before its own publish; without it they run between steps.
* **Engines** (``engines`` of them) with continuous batching: a ticket is pulled when the engine holds
  fewer than ``max_tickets`` and waits until the engine has the ticket's version; its sequences join the
  running batch (at most ``max_batch`` sequences); one decode iteration of ``n`` sequences costs
  ``iter_fixed_s + iter_per_seq_s * n`` (the engine's tokens/s-vs-batch curve) and gives each one token.
  A new version reaches each engine ``transfer_s`` after its publish and is applied between iterations
  (``apply_s``, generation paused); a sequence's version is the one it started on (its oldest token).
* **Agent turns and sandboxes**: with ``turns > 1`` a sequence leaves the batch after each turn's tokens
  and runs one sandbox call (``sandbox_exec_s``) on its engine's pool of ``sandboxes_per_engine``.
* **Messages**: each finished sample costs its rollout process ``rollout_per_sample_s`` (publish), its
  judge ``judge_per_sample_s`` (reward, grader, handling), the broker ``bus_per_sample_s``, then
  ``pipeline_latency_s`` of pure delay (bus hops), then the trainer's event loop ``trainer_per_sample_s``; a step's commit (outcomes, state, acks)
  costs the trainer ``commit_s`` before new groups are admitted.

Where everything shares a machine (``cores > 0``: the ``rlbus run`` default on one host) the busy parts
share its cores fairly (processor sharing: a part that wants ``d`` cores gets ``d * min(1, cores /
demand)``); that is what makes an asynchronous run's learner slower than a synchronous one's on two
cores. Disjoint pools (``trainer_cores > 0``: the run file's ``[placement]`` pins the trainer to CPUs no
other service has) split the machine in two: the trainer process shares its ``trainer_cores`` with no
other part, every other part shares the rest (``cores - trainer_cores``); other tenants' ``background``
demand spreads over both pools in proportion to their cores; with ``background_yields`` (the tenants run
at a lower priority, e.g. ``nice -n 19``) they get only the cores the run leaves idle in each pool.
``cores = 0`` gives each part its own device (the cluster case).

**Completion lengths.** A sequence's length is drawn with the seeded rng: from ``length_quantiles`` (the
run's measured distribution, taken from its traces by the fit) where the shape has them, else from a
Gaussian around ``completion_tokens``; always within 1..``max_new_tokens``. A group is done when its
longest sequence is, and a synchronous step when its last group is: the tail sets a synchronous period,
while an asynchronous run keeps the engine's batch full with the next version's groups.

The model is deterministic for a seed. :mod:`services.launcher.simulate_fit` takes its rates from a
run directory; :func:`plan_table` sweeps a plan file's grid.
"""

from __future__ import annotations

import random
import statistics
from collections import Counter, deque
from collections.abc import Callable

from services.launcher.simulate_engine import Engine, Group
from services.launcher.simulate_model import Rates, Result, Shape

_EPS = 1e-12


class _Job:
    """Work of ``left`` uncontended seconds on a thread ``lane`` (``"<process>/<thread>"``) wanting ``demand``
    cores; a thread's work runs in order. ``lane`` None is a pure delay (a transfer, a sandbox call)."""

    __slots__ = ("lane", "proc", "demand", "left", "done")

    def __init__(self, lane: str | None, demand: float, left: float, done: Callable[[], None]) -> None:
        self.lane, self.demand, self.left, self.done = lane, demand, max(left, 0.0), done
        self.proc = None if lane is None else lane.split("/", 1)[0]


class Simulation:
    """One simulated run; :meth:`run` returns its :class:`Result`.

    Each service instance is a process whose busy threads share one interpreter (Python's lock: the
    trainer's learner thread and its event loop, which handles messages one at a time, take turns); on a
    shared machine (``cores > 0``) the busy processes share its cores."""

    def __init__(self, shape: Shape, rates: Rates, seed: int = 0) -> None:
        self.s, self.r, self.rng = shape, rates, random.Random(seed)
        self.t = 0.0
        self.lanes: dict[str, deque[_Job]] = {}
        self.delays: list[_Job] = []
        self.busy: Counter[str] = Counter()
        self.version = 0
        self.step = 0
        self.in_flight = 0
        self.next_gid = 0
        self.tickets: deque[Group] = deque()
        self.ready: list[Group] = []
        self.learning = False
        #: overlap_publish: a step's publish and commit are running (beside the next learner step)
        self.committing = False
        self.after_commit: Callable[[], None] | None = None
        self.staleness: Counter[int] = Counter()
        self.dropped = 0
        self.learner_times: list[float] = []
        self.group_times: list[float] = []
        self.tokens = 0
        self.engines = [Engine(self, i) for i in range(shape.engines)]
        self.judges = [f"judge{i}" for i in range(shape.judges)]
        self.bound = shape.max_in_flight or (shape.max_staleness + 1) * shape.groups_per_step

    # --- the clock: processor sharing ------------------------------------------------------------

    def start(self, lane: str | None, demand: float, left: float, done: Callable[[], None]) -> None:
        job = _Job(lane, demand, left, done)
        if lane is None:
            self.delays.append(job)
        else:
            self.lanes.setdefault(lane, deque()).append(job)

    def after_all(self, lane: str, demand: float, each: float, count: int, done: Callable[[], None]) -> None:
        """``count`` pieces of work of ``each`` seconds queued on ``lane`` (a thread does them in a row, so
        one job of their sum); ``done`` after the last."""
        self.start(lane, demand, each * count, done)

    def _advance(self) -> bool:
        """Run until the next piece of work ends: the head job of each thread runs, the busy threads of a
        process split it, the busy processes split the machine."""
        heads = [q[0] for q in self.lanes.values() if q]
        if not heads and not self.delays:
            return False
        threads: Counter[str] = Counter(j.proc for j in heads)
        want: dict[str, float] = {}
        for j in heads:
            want[j.proc] = max(want.get(j.proc, 0.0), j.demand)
        share, background = self._shares(want)
        rates = [share[j.proc] / threads[j.proc] for j in heads]
        dt = min([j.left / r for j, r in zip(heads, rates, strict=True)] + [j.left for j in self.delays])
        for proc in threads:
            self.busy[proc] += dt  # a process is busy while any of its threads works
        self.busy["background"] += dt * background
        self.busy["sandbox"] += dt * sum(j.demand < 0 for j in self.delays)  # sandbox-seconds in use
        self.t += dt
        eps = _EPS * max(1.0, self.t)
        finished = []
        for j, r in zip(heads, rates, strict=True):
            j.left -= r * dt
            if j.left <= eps:
                self.lanes[j.lane].popleft()
                finished.append(j)
        delays = []
        for j in self.delays:
            j.left -= dt
            (finished if j.left <= eps else delays).append(j)
        self.delays = delays
        for j in finished:
            j.done()
        return True

    def _shares(self, want: dict[str, float]) -> tuple[dict[str, float], float]:
        """What each busy process gets of the cores it wants (1 = all of them) and the cores the other tenants
        get: each pool's cores shared fairly among its processes and its part of ``background`` (the tenants
        spread over the pools in proportion to their cores)."""
        s = self.s
        if not s.cores:
            return dict.fromkeys(want, 1.0), s.background
        own = s.trainer_cores  # 0: one pool
        sizes = (own, s.cores - own)
        tenants = [s.background * size / s.cores for size in sizes]
        demand = [0.0, 0.0] if s.background_yields else list(tenants)
        for proc, d in want.items():
            demand[0 if own and proc == "trainer" else 1] += d
        got = [min(1.0, size / d) if d > 0 else 1.0 for size, d in zip(sizes, demand, strict=True)]
        share = {proc: got[0 if own and proc == "trainer" else 1] for proc in want}
        if s.background_yields:  # the tenants take what the run leaves idle
            return share, sum(min(t, max(size - d, 0.0)) for t, size, d in zip(tenants, sizes, demand, strict=True))
        return share, sum(t * g for t, g in zip(tenants, got, strict=True))

    def run(self, steps: int, max_sim_s: float = 1e7) -> Result:
        self._admit()
        while self.step < steps and self.t < max_sim_s and self._advance():
            pass
        total = max(self.t, _EPS)
        groups = sum(self.staleness.values())
        idle = {"trainer": 1 - self.busy["trainer"] / total,
                "engines": 1 - sum(self.busy[e.name] for e in self.engines) / (total * len(self.engines)),
                "judges": 1 - sum(self.busy[j] for j in self.judges) / (total * len(self.judges))}
        if self.s.turns > 1:
            idle["sandboxes"] = 1 - self.busy["sandbox"] / (total * self.s.sandboxes_per_engine * len(self.engines))
        return Result(
            steps=self.step, sim_s=self.t, steps_per_s=self.step / total, staleness=dict(sorted(self.staleness.items())),
            staleness_mean=sum(k * v for k, v in self.staleness.items()) / groups if groups else 0.0,
            dropped_groups=self.dropped, idle={k: round(max(v, 0.0), 4) for k, v in idle.items()},
            learner_s=_mean(self.learner_times), generate_group_s=_median(self.group_times),
            tokens_per_s=self.tokens / total, background_cores=self.busy["background"] / total)

    # --- the trainer ----------------------------------------------------------------------------

    def _admit(self) -> None:
        while self.in_flight < self.bound:
            g = Group(self.next_gid, self.version, self.s.group_size)
            self.next_gid += 1
            self.in_flight += 1
            self.tickets.append(g)
        self.dispatch()

    def dispatch(self) -> None:
        """Waiting tickets go to the engines holding the fewest (idle consumers fetch first)."""
        if not self.tickets:
            return
        while self.tickets:
            room = [e for e in self.engines if e.tickets < self.s.max_tickets]
            if not room:
                break
            least = min(e.tickets for e in room)
            for e in room:
                if e.tickets == least and self.tickets:
                    e.take(self.tickets.popleft())
        for e in self.engines:
            e.pull()

    def generated(self, g: Group) -> None:
        """A group's samples are published: judged, carried, then handled by the trainer."""
        judge = self.judges[g.gid % len(self.judges)]

        def judged() -> None:
            self.after_all("nats/server", 1.0, self.r.bus_per_sample_s, self.s.group_size, carried)

        def carried() -> None:
            self.start(None, 0.0, self.r.pipeline_latency_s, lambda: self.after_all(
                "trainer/loop", 1.0, self.r.trainer_per_sample_s, self.s.group_size, lambda: self._arrive(g)))

        self.after_all(f"{judge}/loop", 1.0, self.r.judge_per_sample_s, self.s.group_size, judged)

    def _arrive(self, g: Group) -> None:
        if self.version - g.oldest > self.s.max_staleness:
            self._drop([g])
            self._admit()
            return
        self.ready.append(g)
        self._maybe_learn()

    def _drop(self, groups: list[Group]) -> None:
        self.dropped += len(groups)
        self.in_flight -= len(groups)

    def _maybe_learn(self) -> None:
        if self.learning or len(self.ready) < self.s.groups_per_step:
            return
        self.ready.sort(key=lambda g: g.oldest)
        batch, self.ready = self.ready[: self.s.groups_per_step], self.ready[self.s.groups_per_step:]
        self.learning = True
        tokens = len(batch) * self.s.group_size * (self.s.prompt_tokens + self.s.completion_tokens)
        began = self.t

        def learned() -> None:
            self.learner_times.append(self.t - began)
            if not self.s.overlap_publish:  # publish, then commit, then the next step
                self.start("trainer/loop", 1.0, self.r.publish_s, published)
            elif self.committing:  # the previous step's publish and commit first (the trainer's settle)
                self.after_commit = begin_publish
            else:
                begin_publish()

        def begin_publish() -> None:
            # overlap: the version moves on and the learner is free for the next batch while this one is sent
            self._bump(batch)
            self.committing = True
            self.learning = False
            self.start("trainer/loop", 1.0, self.r.publish_s, sent)
            self._drop_stale()  # what the next collect expires at the new version
            self._maybe_learn()

        def sent() -> None:
            self._offer()
            self.start("trainer/loop", 1.0, self.r.commit_s, committed)

        def published() -> None:
            self._bump(batch)
            self._offer()
            self.start("trainer/loop", 1.0, self.r.commit_s, committed)

        def committed() -> None:
            self.in_flight -= len(batch)
            self.learning = self.learning and self.s.overlap_publish  # serial: this step is over
            self.committing = False
            self._drop_stale()
            self._admit()
            follow, self.after_commit = self.after_commit, None
            if follow is not None:
                follow()
            self._maybe_learn()

        work = self.r.learn_fixed_s + self.r.learn_per_token_s * tokens
        self.start("trainer/learner", self.s.trainer_threads, work, learned)

    def _drop_stale(self) -> None:
        stale = [g for g in self.ready if self.version - g.oldest > self.s.max_staleness]
        self.ready = [g for g in self.ready if g not in stale]
        self._drop(stale)

    def _bump(self, batch: list[Group]) -> None:
        """A step's version exists: its groups' staleness is counted, the trainer is one version on."""
        for g in batch:
            self.staleness[self.version - g.oldest] += 1
        self.version += 1
        self.step += 1

    def _offer(self) -> None:
        """The version just sent reaches every engine ``transfer_s`` later."""
        for e in self.engines:
            self.start(None, 0.0, self.r.transfer_s, lambda e=e, v=self.version: e.offer(v))

    def seq_length(self) -> int:
        """A completion length within 1..max_new_tokens: from the shape's ``length_quantiles`` where it has
        them (inverse transform: a uniform draw placed between the two neighbouring quantiles), else around
        the mean (a Gaussian, sd half the mean)."""
        q, top = self.s.length_quantiles, self.s.max_new_tokens
        if q:
            pos = self.rng.random() * (len(q) - 1)
            i = min(int(pos), len(q) - 1)
            x = q[i] + (q[min(i + 1, len(q) - 1)] - q[i]) * (pos - i)
        else:
            mean = self.s.completion_tokens
            x = self.rng.gauss(mean, mean / 2)
        return max(1, min(top, round(x)))


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0
