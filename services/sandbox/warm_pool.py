"""The warm pool: sandboxes created ahead of their create, their exec server already running.

A create costs a volume, an overlay mount and a cgroup (~1 ms here); its first exec then pays a bubblewrap start
(~9 ms), and a server's start (Python: 20-60 ms) if the sandbox runs more execs. The pool pays both before the
create arrives: it keeps ``targets[key]`` sandboxes of each :class:`PoolKey` built and their server ready, and a
create that asks for exactly that key takes one (a dict lookup), so its first exec is a request on the server's
socket (~3 ms).

* **Exact match only.** The key is what building a sandbox depends on: the base, the resolved limits (cgroup and
  volume sizes) and the egress allowlist (the proxy listener in the server's network namespace). What a create
  carries besides (env, labels, lease, files) is applied when it takes one, as a create applies it after building:
  env is added to each exec, never to the server's own environment. A create asking for anything else is built as
  without a pool.
* **Refill** is one task building one sandbox at a time (bounded CPU: one server start at once), woken by a take,
  a finished destroy or a finished request; it waits, without polling, while ``gate()`` names a reason (the
  instance near ``max_sandboxes``, creates queued or every create slot busy) and after a build refused for
  capacity or memory, until the next wake-up. A failed build is retried with exponential backoff.
* **Accounting.** Pooled sandboxes live in the backend's registry (flag ``pooled``): they count against
  ``max_sandboxes`` and the memory budget, are invisible to every verb and to ``list`` until taken, emit no
  event before they are taken, and are destroyed (silently) at shutdown. Their ``meta.json`` names no run, so
  the reaper of a crashed instance removes them without a ``destroyed`` event.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

from proto import sandbox as api
from services.runtime.tasks import cancel_and_wait
from services.sandbox import common
from services.sandbox.backend import InvalidRequest, Overloaded
from services.sandbox.bwrap_sandbox import Sandbox, Spec
from services.sandbox.config import LimitsConfig, SandboxConfig
from services.sandbox.egress import EgressPolicy

if TYPE_CHECKING:
    from services.sandbox.bwrap import BwrapBackend

log = logging.getLogger("rlbus.sandbox.pool")

#: backoff after a build failed for another reason than capacity: first and longest wait (seconds)
RETRY_FIRST_S = 0.5
RETRY_MAX_S = 30.0


@dataclass(frozen=True)
class PoolKey:
    """What a pooled sandbox is built with; a create takes one only when its request resolves to the same."""

    base: str
    limits: LimitsConfig
    egress: tuple[str, ...]


def pool_key(req: api.CreateRequest, cfg: SandboxConfig, bases: Collection[str], policy: EgressPolicy) -> PoolKey:
    """What ``req`` builds (its base, resolved limits and egress), checked (``bases``: the instance's; ``policy``: its
    egress rules): the key of the pooled sandboxes it may take."""
    if req.base not in bases:
        raise InvalidRequest(f"unknown base {req.base!r}: use 'host' or one of {sorted(cfg.images)}")
    policy.check_entries(list(req.egress))  # validates; refuses internal targets naming them
    return PoolKey(req.base, common.resolve_limits(req.limits, cfg), tuple(req.egress))


class WarmPool:
    """Ready sandboxes per key and the task that refills them (see the module docstring).

    ``build(key)`` makes one pooled sandbox with its server ready (raises :class:`Overloaded` when the instance
    has no room); ``discard(sb)`` destroys one that can no longer be handed out; ``gate()`` is None while a
    refill may run, else why not."""

    def __init__(self, build: Callable[[PoolKey], Awaitable[Sandbox]], discard: Callable[[Sandbox], None],
                 gate: Callable[[], str | None]) -> None:
        self._build = build
        self._discard = discard
        self._gate = gate
        self.targets: dict[PoolKey, int] = {}
        self.idle: dict[PoolKey, deque[Sandbox]] = {}
        #: creates served from the pool; creates of a pooled key that found it empty; sandboxes built; failed builds
        self.hits = 0
        self.misses = 0
        self.built = 0
        self.failed = 0
        #: why the refill waits now (None: it does not, or only for a take)
        self.paused_by: str | None = None
        #: seconds each of the last builds took (volume, cgroup, mounts, and the server's start until ready)
        self.build_s: deque[float] = deque(maxlen=1024)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return sum(len(q) for q in self.idle.values())

    def set_target(self, key: PoolKey, n: int) -> None:
        """Keep ``n`` sandboxes of ``key`` ready (0: build no more of them)."""
        self.targets[key] = n
        self.wake()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._refill(), name="sandbox-warm-pool-refill")

    def wake(self) -> None:
        """Something changed that may let the refill go on (a take, a destroy done, a request finished)."""
        self._wake.set()

    def ready(self, key: PoolKey) -> int:
        """Sandboxes of ``key`` ready to take."""
        return len(self.idle.get(key, ()))

    def take(self, key: PoolKey) -> Sandbox | None:
        """A ready sandbox of ``key`` (no longer pooled: the caller adopts it), or None."""
        queue = self.idle.get(key)
        while queue:
            sb = queue.popleft()
            if sb.state == "running" and (sb.server is None or sb.server.alive):
                self.hits += 1
                self.wake()
                return sb
            self._discard(sb)  # its server died while it waited (killed, OOM): never handed out
        if self.targets.get(key, 0) > 0:
            self.misses += 1
            self.wake()
        return None

    def evict(self) -> Sandbox | None:
        """Give up one pooled sandbox (of the key with the most ready) to make room for a create that cannot
        take one: the caller destroys it. None when the pool is empty."""
        queue = max(self.idle.values(), key=len, default=None)
        return queue.pop() if queue else None

    async def fill(self, key: PoolKey, n: int) -> None:
        """Build ``n`` sandboxes of ``key`` now and pool them (beside any target)."""
        for _ in range(n):
            self._add(key, await self._timed_build(key))

    async def _timed_build(self, key: PoolKey) -> Sandbox:
        t0 = time.perf_counter()
        sb = await self._build(key)
        self.build_s.append(time.perf_counter() - t0)
        return sb

    def _add(self, key: PoolKey, sb: Sandbox) -> None:
        self.idle.setdefault(key, deque()).append(sb)
        self.built += 1

    def _wanted(self) -> PoolKey | None:
        return next((key for key, n in self.targets.items() if len(self.idle.get(key, ())) < n), None)

    async def _sleep_until_woken(self) -> None:
        self._wake.clear()
        await self._wake.wait()

    async def _refill(self) -> None:
        retry_s = RETRY_FIRST_S
        while True:
            key = self._wanted()
            self.paused_by = self._gate() if key is not None else None
            if key is None or self.paused_by is not None:
                await self._sleep_until_woken()
                continue
            try:
                sb = await self._timed_build(key)
            except Overloaded as e:  # no room (capacity, memory budget): until a destroy or a take changes that
                self.paused_by = str(e)
                await self._sleep_until_woken()
                continue
            except Exception as e:  # a host failure: logged, retried later, never a tight loop
                self.failed += 1
                log.warning("the warm pool could not build a sandbox (%s: %s); retrying in %.1f s", type(e).__name__,
                            e, retry_s)
                await asyncio.sleep(retry_s)
                retry_s = min(RETRY_MAX_S, retry_s * 2)
                continue
            retry_s = RETRY_FIRST_S
            self._add(key, sb)

    async def close(self) -> None:
        """Stop refilling; the pooled sandboxes stay in the backend's registry, which destroys them. The refill is
        cancelled until it ends (:func:`cancel_and_wait`): on Python 3.11 a cancellation that arrives as an inner
        ``wait_for`` completes is swallowed, and one ``cancel()`` left ``close`` waiting on it for good."""
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
        self.idle.clear()

    def gauges(self) -> dict[str, float]:
        return {"sandbox/pool_ready": float(len(self)), "sandbox/pool_hits": float(self.hits),
                "sandbox/pool_misses": float(self.misses), "sandbox/pool_built": float(self.built),
                "sandbox/pool_build_failures": float(self.failed)}


def backend_pool(backend: BwrapBackend) -> WarmPool:
    """The pool of a bwrap backend: it builds as the backend's create builds (its exec server then started),
    discards through the backend's destroy, and waits at the backend's bounds and its ``pressure()``."""

    async def build(key: PoolKey) -> Sandbox:
        spec = Spec(base=key.base, limits=key.limits, env={}, egress=key.egress,
                    lease_ttl_s=backend.cfg.default_lease_ttl_s, labels={})
        sb = await backend._new_sandbox("", spec, (), None, pooled=True)
        sb.cgroup.set_idle(True)  # its server's start takes only CPU the sandboxes in use leave; normal once taken
        async with sb.lock:
            await sb.exec_server(backend.server_spawn(sb), wait=True)  # None where it cannot: its execs use bwrap
        return sb

    def discard(sb: Sandbox) -> None:
        backend._spawn_task(backend._destroy(sb, "shutdown", emit=False), f"sandbox-discard-{sb.id}")

    def gate() -> str | None:
        if len(backend.sandboxes) + 1 >= backend.cfg.sandboxes_bound():  # a create that misses must find room
            return "max_sandboxes"
        return backend.pressure()

    return WarmPool(build, discard, gate)
