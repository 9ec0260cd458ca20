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
cores. ``cores = 0`` gives each part its own device (the cluster case).

The model is deterministic for a seed. :mod:`services.launcher.simulate_fit` takes its rates from a
run directory; :func:`plan_table` sweeps a plan file's grid.
"""

from __future__ import annotations

import math
import random
from collections import Counter, deque
from collections.abc import Callable

from services.launcher.simulate_model import Rates, Result, Shape

_EPS = 1e-12


class _Job:
    """Work of ``left`` uncontended seconds on a thread ``lane`` (``"<process>/<thread>"``) wanting ``demand``
    cores; a thread's work runs in order. ``lane`` None is a pure delay (a transfer, a sandbox call)."""

    __slots__ = ("lane", "proc", "demand", "left", "done")

    def __init__(self, lane: str | None, demand: float, left: float, done: Callable[[], None]) -> None:
        self.lane, self.demand, self.left, self.done = lane, demand, max(left, 0.0), done
        self.proc = None if lane is None else lane.split("/", 1)[0]


class _Seq:
    __slots__ = ("group", "length", "made", "version", "turn_end")

    def __init__(self, group: _Group, length: int, turns: int) -> None:
        self.group, self.length, self.made, self.version = group, length, 0, -1
        self.turn_end = max(1, math.ceil(length / turns))


class _Group:
    __slots__ = ("gid", "version", "left", "oldest", "started")

    def __init__(self, gid: int, version: int, size: int) -> None:
        self.gid, self.version, self.left, self.oldest, self.started = gid, version, size, 1 << 60, -1.0


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
        self.tickets: deque[_Group] = deque()
        self.ready: list[_Group] = []
        self.learning = False
        #: overlap_publish: a step's publish and commit are running (beside the next learner step)
        self.committing = False
        self.after_commit: Callable[[], None] | None = None
        self.staleness: Counter[int] = Counter()
        self.dropped = 0
        self.learner_times: list[float] = []
        self.group_times: list[float] = []
        self.tokens = 0
        self.engines = [_Engine(self, i) for i in range(shape.engines)]
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
        total = sum(want.values()) + self.s.background
        machine = min(1.0, self.s.cores / total) if self.s.cores and total > 0 else 1.0
        rates = [machine / threads[j.proc] for j in heads]
        dt = min([j.left / r for j, r in zip(heads, rates, strict=True)] + [j.left for j in self.delays])
        for proc in threads:
            self.busy[proc] += dt  # a process is busy while any of its threads works
        self.busy["background"] += dt * self.s.background * machine
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
            learner_s=_mean(self.learner_times), generate_group_s=_mean(self.group_times),
            tokens_per_s=self.tokens / total, background_cores=self.busy["background"] / total)

    # --- the trainer ----------------------------------------------------------------------------

    def _admit(self) -> None:
        while self.in_flight < self.bound:
            g = _Group(self.next_gid, self.version, self.s.group_size)
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

    def generated(self, g: _Group) -> None:
        """A group's samples are published: judged, carried, then handled by the trainer."""
        judge = self.judges[g.gid % len(self.judges)]

        def judged() -> None:
            self.after_all("nats/server", 1.0, self.r.bus_per_sample_s, self.s.group_size, carried)

        def carried() -> None:
            self.start(None, 0.0, self.r.pipeline_latency_s, lambda: self.after_all(
                "trainer/loop", 1.0, self.r.trainer_per_sample_s, self.s.group_size, lambda: self._arrive(g)))

        self.after_all(f"{judge}/loop", 1.0, self.r.judge_per_sample_s, self.s.group_size, judged)

    def _arrive(self, g: _Group) -> None:
        if self.version - g.oldest > self.s.max_staleness:
            self._drop([g])
            self._admit()
            return
        self.ready.append(g)
        self._maybe_learn()

    def _drop(self, groups: list[_Group]) -> None:
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

    def _bump(self, batch: list[_Group]) -> None:
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
        """A completion length around the mean, within 1..max_new_tokens."""
        mean, top = self.s.completion_tokens, self.s.max_new_tokens
        return max(1, min(top, round(self.rng.gauss(mean, mean / 2))))


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


class _Engine:
    """One rollout process: its engine's decode loop and its sandboxes."""

    def __init__(self, sim: Simulation, index: int) -> None:
        self.sim, self.index, self.name = sim, index, f"engine{index}"
        self.version = 0
        self.held: list[_Group] = []  # tickets pulled, waiting for this engine's version
        self.tickets = 0
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        self.busy = False
        self.pending: int | None = None
        self.sandbox = _Pool(sim, sim.s.sandboxes_per_engine)

    def take(self, g: _Group) -> None:
        self.tickets += 1
        self.held.append(g)

    def pull(self) -> None:
        """Start what the held tickets allow."""
        self._release()
        self._iterate()

    def _release(self) -> None:
        ready = [g for g in self.held if g.version <= self.version]
        self.held = [g for g in self.held if g.version > self.version]
        for g in ready:
            g.started = self.sim.t
            for _ in range(self.sim.s.group_size):
                self.waiting.append(_Seq(g, self.sim.seq_length(), self.sim.s.turns))

    def offer(self, version: int) -> None:
        self.pending = max(version, self.pending or 0)
        if not self.busy:
            self._apply()

    def _apply(self) -> None:
        version, self.pending = self.pending, None
        self.busy = True

        def applied() -> None:
            self.busy = False
            self.version = max(self.version, version)
            self._release()
            self._iterate()

        self.sim.start(f"{self.name}/engine", self.sim.s.engine_threads, self.sim.r.apply_s, applied)

    def _iterate(self) -> None:
        if self.busy:
            return
        if self.pending is not None:
            self._apply()
            return
        while self.waiting and len(self.running) < self.sim.s.max_batch:
            seq = self.waiting.popleft()
            if seq.version < 0:
                seq.version = self.version
                seq.group.oldest = min(seq.group.oldest, self.version)
            self.running.append(seq)
        if not self.running:
            return
        self.busy = True
        work = self.sim.s.decode_chunk * (self.sim.r.iter_fixed_s + self.sim.r.iter_per_seq_s * len(self.running))
        self.sim.start(f"{self.name}/engine", self.sim.s.engine_threads, work, self._iterated)

    def _iterated(self) -> None:
        self.busy = False
        keep = []
        for seq in self.running:
            step = min(self.sim.s.decode_chunk, seq.turn_end - seq.made)
            seq.made += step
            self.sim.tokens += step
            if seq.made >= seq.length:
                self._finish(seq)
            elif seq.made >= seq.turn_end:
                seq.turn_end = min(seq.length, seq.turn_end + max(1, math.ceil(seq.length / self.sim.s.turns)))
                self.sandbox.submit(self.sim.r.sandbox_exec_s, lambda seq=seq: self._back(seq))
            else:
                keep.append(seq)
        self.running = keep
        self._iterate()

    def _back(self, seq: _Seq) -> None:
        self.waiting.append(seq)
        self._iterate()

    def _finish(self, seq: _Seq) -> None:
        g = seq.group

        def published() -> None:
            g.left -= 1
            if g.left:
                return
            self.sim.group_times.append(self.sim.t - g.started)
            self.tickets -= 1
            self.sim.dispatch()
            self.sim.generated(g)

        self.sim.start(f"{self.name}/loop", 1.0, self.sim.r.rollout_per_sample_s, published)


class _Pool:
    """``size`` sandboxes on their own machines: calls beyond them queue."""

    def __init__(self, sim: Simulation, size: int) -> None:
        self.sim, self.size, self.used = sim, size, 0
        self.queue: deque[tuple[float, Callable[[], None]]] = deque()

    def submit(self, work: float, done: Callable[[], None]) -> None:
        self.queue.append((work, done))
        self._next()

    def _next(self) -> None:
        while self.used < self.size and self.queue:
            work, done = self.queue.popleft()
            self.used += 1

            def finished(done: Callable[[], None] = done) -> None:
                self.used -= 1
                done()
                self._next()

            self.sim.start(None, -1.0, work, finished)  # demand -1 marks a sandbox call (counted as use)
