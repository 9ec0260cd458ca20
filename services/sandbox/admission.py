"""Admission of the sandbox service: which request starts now, which waits for a create slot, which is refused.

Each request is offered as it arrives (the subscription callback never waits, so a request's arrival is
when the server delivered it, and the NATS client's own queue does not fill up behind a busy instance):

* **Deadlines.** A request carries the wall-clock time after which its sender stops waiting
  (header :data:`proto.sandbox.DEADLINE_HEADER`); one without gets ``request_deadline_s`` from its arrival. A
  request past its deadline is never started: refused at arrival, or dropped when it leaves the create queue.
* **Creates** (the create subject) run at most ``max_creating`` at once; up to ``max_queued_creates`` more wait,
  oldest first. Beyond that, or once the sandboxes held (``live()``: in use, being destroyed, and pooled less the
  ``spare()`` pooled ones a create may take or evict) plus creates in progress and queued reach ``max_sandboxes``,
  a create is refused at once.
* **The warm pool** refills only while :meth:`Admission.pressure` is None: no create queued, a create slot free,
  fewer than half of ``max_in_flight`` requests running, and room for one more sandbox besides.
* **Every other request** starts at once while fewer than ``max_in_flight`` are running, else is refused.

A refusal is an ``overloaded`` ErrorReply with ``retry_after_s``: nothing was done, so the sender may send it
again (:class:`services.lib.sandbox_client.SandboxClient` backs off and does; a create then reaches any
instance of the queue group). :meth:`Admission.abandon` empties the queue at shutdown.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from nats.aio.msg import Msg

from proto import sandbox as api


@dataclass
class Job:
    """One request the instance took in: its message, subscription role and deadline (epoch seconds)."""

    msg: Msg
    role: str
    deadline: float
    arrived: float = field(default_factory=time.time)

    @property
    def is_create(self) -> bool:
        return self.role == "create"


def deadline_of(msg: Msg, arrived: float, default_s: float) -> float:
    """The request's deadline: its header's, else ``default_s`` after its arrival (an unreadable header too)."""
    raw = (msg.headers or {}).get(api.DEADLINE_HEADER)
    if raw:
        try:
            value = float(raw)
        except ValueError:
            value = 0.0
        if value > 0.0 and value == value:  # not NaN
            return value
    return arrived + default_s


@dataclass(frozen=True)
class Refusal:
    """Why a request is not started: the ``overloaded`` reply's message, and the counter it goes to."""

    reason: str
    message: str


class Admission:
    """The bounds of one instance (see the module docstring); ``live()`` counts the sandboxes it holds."""

    def __init__(self, *, max_in_flight: int, max_creating: int, max_queued_creates: int, max_sandboxes: int,
                 retry_after_s: float, live: Callable[[], int], spare: Callable[[], int] = lambda: 0) -> None:
        self.max_in_flight = max_in_flight
        self.max_creating = max_creating
        self.max_queued_creates = max_queued_creates
        self.max_sandboxes = max_sandboxes
        self.retry_after_s = retry_after_s
        self.live = live
        self.spare = spare
        self.running = 0
        self.creating = 0
        self.queue: deque[Job] = deque()
        #: refusals by reason (``deadline``, ``creates_queued``, ``sandboxes``, ``in_flight``, ``stopping``)
        self.refused: Counter[str] = Counter()
        self.started = 0

    def offer(self, job: Job) -> Refusal | bool:
        """A new request: True to start it now, False when it was queued, else why it is refused."""
        if time.time() > job.deadline:
            return self._refuse("deadline", "the request's deadline passed before it reached the instance")
        if job.is_create:
            held = self.live() - self.spare() + self.creating + len(self.queue)
            if held >= self.max_sandboxes:
                return self._refuse("sandboxes", f"the instance holds {held} sandboxes and creates "
                                    f"(max_sandboxes = {self.max_sandboxes}); try again or add instances")
            if self.creating < self.max_creating and self.running < self.max_in_flight:
                self._take(job)
                return True
            if len(self.queue) >= self.max_queued_creates:
                return self._refuse("creates_queued", f"{self.creating} creates in progress and {len(self.queue)} "
                                    f"queued (max_creating = {self.max_creating}, max_queued_creates = "
                                    f"{self.max_queued_creates}); try again or add instances")
            self.queue.append(job)
            return False
        if self.running >= self.max_in_flight:
            return self._refuse("in_flight", f"{self.running} requests in progress (max_in_flight = "
                                f"{self.max_in_flight}); try again")
        self._take(job)
        return True

    def pressure(self) -> str | None:
        """Why a warm pool must not build a sandbox now (it competes with the requests), or None."""
        if self.queue:
            return f"{len(self.queue)} creates queued"
        if self.creating >= self.max_creating:
            return f"every create slot busy (max_creating = {self.max_creating})"
        if self.running * 2 >= self.max_in_flight:
            return f"{self.running} requests in progress (max_in_flight = {self.max_in_flight})"
        if self.live() + self.creating + 1 >= self.max_sandboxes:
            return f"near max_sandboxes ({self.max_sandboxes})"
        return None

    def _take(self, job: Job) -> None:
        self.running += 1
        self.started += 1
        if job.is_create:
            self.creating += 1

    def _refuse(self, reason: str, message: str) -> Refusal:
        self.refused[reason] += 1
        return Refusal(reason, message)

    def done(self, job: Job) -> tuple[list[Job], list[Job]]:
        """A started request finished: (queued creates to start now, queued creates that expired meanwhile)."""
        self.running -= 1
        if job.is_create:
            self.creating -= 1
        start: list[Job] = []
        expired: list[Job] = []
        now = time.time()
        while self.queue and self.creating < self.max_creating and self.running < self.max_in_flight:
            nxt = self.queue.popleft()
            if now > nxt.deadline:
                self.refused["deadline"] += 1
                expired.append(nxt)
                continue
            self._take(nxt)
            start.append(nxt)
        return start, expired

    def abandon(self) -> list[Job]:
        """Shutdown: every queued create, removed from the queue (the caller refuses them)."""
        jobs = list(self.queue)
        self.queue.clear()
        self.refused["stopping"] += len(jobs)
        return jobs

    def gauges(self) -> dict[str, float]:
        out = {"sandbox/requests_in_flight": float(self.running), "sandbox/creates_in_progress": float(self.creating),
               "sandbox/creates_queued": float(len(self.queue))}
        out.update({f"sandbox/refused_{reason}": float(n) for reason, n in self.refused.items()})
        return out
