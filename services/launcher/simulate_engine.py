"""The rollout side of the simulated loop (:mod:`services.launcher.simulate`): prompt groups and their
sequences, each engine's continuous-batching decode loop and its pool of sandboxes."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.launcher.simulate import Simulation


class Seq:
    """One sequence of a group: ``length`` tokens to make, ``made`` so far, the version it started on."""

    __slots__ = ("group", "length", "made", "version", "turn_end")

    def __init__(self, group: Group, length: int, turns: int) -> None:
        self.group, self.length, self.made, self.version = group, length, 0, -1
        self.turn_end = max(1, math.ceil(length / turns))


class Group:
    """One prompt group: admitted at ``version``, ``left`` sequences unfinished, its oldest token's version."""

    __slots__ = ("gid", "version", "left", "oldest", "started")

    def __init__(self, gid: int, version: int, size: int) -> None:
        self.gid, self.version, self.left, self.oldest, self.started = gid, version, size, 1 << 60, -1.0


class Engine:
    """One rollout process: its engine's decode loop and its sandboxes."""

    def __init__(self, sim: Simulation, index: int) -> None:
        self.sim, self.index, self.name = sim, index, f"engine{index}"
        self.version = 0
        self.held: list[Group] = []  # tickets pulled, waiting for this engine's version
        self.tickets = 0
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.busy = False
        self.pending: int | None = None
        self.sandbox = SandboxPool(sim, sim.s.sandboxes_per_engine)

    def take(self, g: Group) -> None:
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
                self.waiting.append(Seq(g, self.sim.seq_length(), self.sim.s.turns))

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

    def _back(self, seq: Seq) -> None:
        self.waiting.append(seq)
        self._iterate()

    def _finish(self, seq: Seq) -> None:
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


class SandboxPool:
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
