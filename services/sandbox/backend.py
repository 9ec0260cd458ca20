"""The sandbox backend interface, its errors, and the factory that picks one by config ``type``.

A backend is an async object whose methods map one to one onto the API verbs of
:mod:`proto.sandbox`: each takes the request Struct and returns the reply
Struct, or raises a :class:`SandboxError` whose ``code`` becomes an
:class:`proto.sandbox.ErrorReply`. Every state change is reported through the
``on_event`` callback given at construction; it is called synchronously from
the event loop and must not block (the bus service enqueues the event for
publishing).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from proto import sandbox as api
from services.sandbox.config import SandboxConfig

EventSink = Callable[[api.SandboxEvent], None]


class SandboxError(Exception):
    """Base of the errors a verb raises; ``code`` is the :data:`proto.sandbox.ErrorCode`."""

    code: api.ErrorCode = "internal"

    def __init__(self, message: str, sandbox_id: str | None = None) -> None:
        super().__init__(message)
        self.sandbox_id = sandbox_id

    def reply(self, run_id: str) -> api.ErrorReply:
        """The error as the bus reply."""
        return api.ErrorReply(run_id=run_id, code=self.code, message=str(self), sandbox_id=self.sandbox_id)


class NotFound(SandboxError):
    """No such sandbox or snapshot on this instance (destroyed, expired, or owned elsewhere)."""

    code = "not_found"


class InvalidRequest(SandboxError):
    """The request breaks a rule; the message says which and how to fix it."""

    code = "invalid"


class Conflict(SandboxError):
    """The sandbox is in the wrong state for the operation (e.g. exec while paused)."""

    code = "conflict"


class LimitReached(SandboxError):
    """A capacity limit of the instance (sandboxes, layers) is reached."""

    code = "limit"


class Overloaded(SandboxError):
    """The instance is past an admission bound (live sandboxes, memory budget): nothing was done; the caller
    sends the request again after ``retry_after_s`` (a create may then reach another instance)."""

    code = "overloaded"

    def __init__(self, message: str, sandbox_id: str | None = None, retry_after_s: float = 1.0) -> None:
        super().__init__(message, sandbox_id)
        self.retry_after_s = retry_after_s

    def reply(self, run_id: str) -> api.ErrorReply:
        return api.ErrorReply(run_id=run_id, code=self.code, message=str(self), sandbox_id=self.sandbox_id,
                              retry_after_s=self.retry_after_s)


class BackendUnavailable(SandboxError):
    """The backend cannot run on this host; the message lists what is missing."""

    code = "unavailable"


class SandboxFailure(SandboxError):
    """The host failed to carry out an operation (mount, cgroup, spawn); the message has the detail."""

    code = "internal"


class SandboxBackend(Protocol):
    """What the sandbox service calls. Implementations: ``bwrap.BwrapBackend``, ``unsafe.UnsafeProcessBackend``."""

    #: this instance's id (embedded in every sandbox and snapshot id it makes)
    instance_id: str
    #: why a warm pool must not refill now (the service sets its admission's), or None
    pressure: Callable[[], str | None]

    def held(self) -> tuple[int, int]:
        """(sandboxes held: in use, pooled and being destroyed; of which pooled and free to take)."""
        ...

    def wake_pool(self) -> None:
        """Something changed that may let a paused warm pool refill (a request finished)."""
        ...

    def gauges(self) -> dict[str, float]:
        """The backend's own gauges (its warm pool's), by metric path."""
        ...

    async def start(self) -> list[str]:
        """Check prerequisites (raise :class:`BackendUnavailable` naming what is missing), reap
        orphans of dead instances, take ownership of the state directory. Returns the reaped sandbox ids."""
        ...

    async def close(self, timeout_s: float | None = None) -> None:
        """Destroy every sandbox of this instance (reason ``shutdown``) and release the state directory; past
        ``timeout_s`` what is left stays for the reaper of the next instance."""
        ...

    async def create(self, req: api.CreateRequest) -> api.CreateReply: ...

    async def exec(self, req: api.ExecRequest) -> api.ExecReply: ...

    async def write_files(self, req: api.WriteFilesRequest) -> api.WriteFilesReply: ...

    async def read_files(self, req: api.ReadFilesRequest) -> api.ReadFilesReply: ...

    async def pause(self, req: api.PauseRequest) -> api.PauseReply: ...

    async def resume(self, req: api.ResumeRequest) -> api.ResumeReply: ...

    async def snapshot(self, req: api.SnapshotRequest) -> api.SnapshotReply: ...

    async def fork(self, req: api.ForkRequest) -> api.ForkReply: ...

    async def destroy(self, req: api.DestroyRequest) -> api.DestroyReply: ...

    async def list(self, req: api.ListRequest) -> api.ListReply: ...

    async def renew_lease(self, req: api.RenewLeaseRequest) -> api.RenewLeaseReply: ...

    async def reap_orphans(self) -> list[str]:
        """Destroy what dead instances left under ``root_dir`` and in the cgroup tree."""
        ...


def create_backend(config: SandboxConfig, on_event: EventSink) -> SandboxBackend:
    """The backend named by ``config.type`` (call ``await backend.start()`` next)."""
    if config.type == "bwrap":
        from services.sandbox.bwrap import BwrapBackend

        return BwrapBackend(config, on_event)
    if config.type == "unsafe-process":
        from services.sandbox.unsafe import UnsafeProcessBackend

        return UnsafeProcessBackend(config, on_event)
    raise InvalidRequest(f"unknown sandbox backend type {config.type!r}: use 'bwrap' or 'unsafe-process'")


def dispatch(backend: SandboxBackend, req: object):  # type: ignore[no-untyped-def]
    """The backend coroutine for one request Struct (what the bus service awaits)."""
    handlers = {
        api.CreateRequest: backend.create,
        api.ExecRequest: backend.exec,
        api.WriteFilesRequest: backend.write_files,
        api.ReadFilesRequest: backend.read_files,
        api.PauseRequest: backend.pause,
        api.ResumeRequest: backend.resume,
        api.SnapshotRequest: backend.snapshot,
        api.ForkRequest: backend.fork,
        api.DestroyRequest: backend.destroy,
        api.ListRequest: backend.list,
        api.RenewLeaseRequest: backend.renew_lease,
    }
    handler = handlers.get(type(req))
    if handler is None:
        raise InvalidRequest(f"{type(req).__name__} is not a sandbox request")
    return handler(req)  # type: ignore[operator]
