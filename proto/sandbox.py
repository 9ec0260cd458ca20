"""Sandbox API (request/reply) and sandbox lifecycle events.

Subjects (channels of :mod:`proto.catalog`; ``<run>`` is the run id):

* ``rlbus.<run>.sandbox.api.create`` (``catalog.SANDBOX_REQUESTS.subject(run, CREATE_TARGET)``) —
  published by clients (rollout agent loops, judges) as NATS requests carrying a
  :class:`CreateRequest`; consumed by every sandbox instance of the run in the
  queue group :data:`QUEUE_GROUP`, so one instance takes each create. The reply
  names the sandbox id, which embeds the owning instance id.
* ``rlbus.<run>.sandbox.api.<instance>`` (``catalog.SANDBOX_REQUESTS.subject(run, instance)``) —
  published by clients as requests for every operation on an existing sandbox or
  snapshot (:data:`InstanceRequest`); consumed only by the owning instance
  (:func:`instance_of` reads it from the sandbox or snapshot id).
* ``rlbus.<run>.sandbox.list`` (``catalog.SANDBOX_LIST``) — published by clients
  (``rlbus status``, tests) as a scatter/gather request; every instance replies
  with a :class:`ListReply` of its own sandboxes.
* ``rlbus.<run>.sandbox.events.<sandbox_id>`` (``catalog.SANDBOX_EVENTS``) —
  published by sandbox instances, one :class:`SandboxEvent` per state change;
  stored by stream ``SANDBOX_EVENTS`` (``catalog.SANDBOX_EVENTS_STREAM``) and read by
  ``rlbus tap``, judges and monitors. Filtering on one sandbox id follows one
  sandbox's life.

Every request is answered with its reply type (:data:`REPLY_TYPES`) or with an
:class:`ErrorReply`; decode a reply as ``ExecReply | ErrorReply``.

Deadlines and load shedding: a request may carry the header :data:`DEADLINE_HEADER` (wall-clock
seconds since the epoch after which its sender no longer waits; :class:`services.lib.sandbox_client.
SandboxClient` sets it to the end of its timeout); one without gets the instance's
``request_deadline_s`` from its arrival. A request whose deadline passed before it could start is
never started: it is answered ``overloaded``. An instance past its admission bounds (creates in
progress and queued, live sandboxes, its memory budget, requests in flight) answers ``overloaded``
at once, with ``retry_after_s``: nothing was done, so the request may be sent again (a create then
reaches any instance of the queue group).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from proto.envelope import Envelope

FAMILY = "sandbox"

#: Queue group of the create subject: one instance of the run takes each create.
QUEUE_GROUP = "sandbox"

#: The last token of the create subject (``rlbus.<run>.sandbox.api.create``); other requests
#: carry the owning instance's id there.
CREATE_TARGET = "create"

#: Sandbox ids look like ``<instance>-<8 hex>``, snapshot ids ``<instance>-snap-<8 hex>``;
#: instance ids are ``[a-z0-9]{1,32}`` so both are single subject tokens.
INSTANCE_ID_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789"

#: NATS header of a request: the wall-clock time (seconds since the epoch, decimal) after which its
#: sender stops waiting; an instance never starts a request past it (answered ``overloaded``)
DEADLINE_HEADER = "Rlbus-Deadline"


def instance_of(sandbox_or_snapshot_id: str) -> str:
    """The instance id embedded in a sandbox or snapshot id (routes instance requests)."""
    return sandbox_or_snapshot_id.split("-", 1)[0]


# --- shared pieces -------------------------------------------------------------------------------


class Limits(msgspec.Struct, kw_only=True, frozen=True):
    """Resource limits asked for at create; ``None`` takes the service default.

    The service clamps nothing silently: a value above its configured maximum is
    refused with an ``invalid`` error.
    """

    #: memory of the sandbox's processes (RSS + page cache + kernel memory) in MiB; exceeding it OOM-kills
    #: the process. The sandbox's cgroup is limited to ``memory_mb + disk_mb`` (its files have their own bound)
    memory_mb: Annotated[int, msgspec.Meta(ge=16)] | None = None
    #: most processes and threads alive at once (fork bombs stop here)
    pids: Annotated[int, msgspec.Meta(ge=4)] | None = None
    #: CPU bandwidth in cores (0.5 = half a core)
    cpus: Annotated[float, msgspec.Meta(gt=0.0)] | None = None
    #: bytes of files the sandbox may write (work directory, /tmp, /dev/shm, snapshots), in MiB; a write
    #: beyond fails with ENOSPC (never an OOM kill). The files live in memory, charged to the sandbox's cgroup
    disk_mb: Annotated[int, msgspec.Meta(ge=1)] | None = None
    #: files, directories and links the sandbox may create; beyond, creating one fails with ENOSPC
    inodes: Annotated[int, msgspec.Meta(ge=64)] | None = None


class FileData(msgspec.Struct, kw_only=True, frozen=True):
    """A file to write. ``path`` is relative to the work directory, absolute under it, or under ``/tmp``."""

    path: str
    data: bytes
    mode: Annotated[int, msgspec.Meta(ge=0, le=0o7777)] = 0o644


class Argv(msgspec.Struct, kw_only=True, frozen=True, tag="argv"):
    """Run a program directly (looked up on ``PATH``)."""

    args: Annotated[list[str], msgspec.Meta(min_length=1)]


class Shell(msgspec.Struct, kw_only=True, frozen=True, tag="shell"):
    """Run a script with a shell (``shell -c script``)."""

    script: str
    shell: str = "/bin/sh"


Command = Argv | Shell


class FromSandbox(msgspec.Struct, kw_only=True, frozen=True, tag="sandbox"):
    """Fork a live sandbox (it is snapshotted first and keeps running)."""

    sandbox_id: str


class FromSnapshot(msgspec.Struct, kw_only=True, frozen=True, tag="snapshot"):
    """Fork a snapshot taken earlier."""

    snapshot_id: str


ForkSource = FromSandbox | FromSnapshot

SandboxState = Literal["running", "paused"]


class SandboxInfo(msgspec.Struct, kw_only=True):
    """One sandbox as ``list`` reports it."""

    sandbox_id: str
    instance_id: str
    run_id: str
    state: SandboxState
    base: str
    created_at: float
    lease_expires_at: float
    #: read-only layers under the sandbox's writable layer (grows by one per snapshot)
    layers: int
    #: execs currently running (foreground and detached)
    running_execs: int
    parent_id: str | None = None
    labels: dict[str, str] = {}
    #: MiB of files of destroyed ancestors this sandbox keeps alive (the layers it was forked on; counted
    #: against the instance's memory budget until their last user goes)
    retained_mb: float = 0.0


# --- requests and replies ------------------------------------------------------------------------


class CreateRequest(Envelope, kw_only=True, tag="sandbox_create"):
    """Create a sandbox (clients → any instance)."""

    #: ``"host"`` (the host's system directories, read-only) or a configured image name
    base: str = "host"
    limits: Limits = Limits()
    #: extra environment for every exec (on top of the service's scrubbed base environment)
    env: dict[str, str] = {}
    #: files written into the work directory before the reply
    files: list[FileData] = []
    #: ``host:port`` entries reachable through the egress proxy (``*.example.com:443`` matches
    #: subdomains); empty = no network at all
    egress: list[str] = []
    #: seconds until the sandbox is destroyed unless the lease is renewed; None = service default
    lease_ttl_s: Annotated[float, msgspec.Meta(gt=0.0)] | None = None
    labels: dict[str, str] = {}


class CreateReply(Envelope, kw_only=True, tag="sandbox_create_reply"):
    sandbox_id: str
    instance_id: str
    lease_expires_at: float


class ExecRequest(Envelope, kw_only=True, tag="sandbox_exec"):
    """Run a command in a sandbox and wait for it (or start it in the background with ``detach``)."""

    sandbox_id: str
    command: Command
    stdin: bytes = b""
    #: added to the sandbox's environment for this exec only
    env: dict[str, str] = {}
    #: working directory inside the sandbox; None = the work directory
    cwd: str | None = None
    #: wall-time limit; None = service default (for detached execs: no limit)
    timeout_s: Annotated[float, msgspec.Meta(gt=0.0)] | None = None
    #: cap on each of stdout and stderr; the rest is discarded and the truncated flag set
    max_output_bytes: Annotated[int, msgspec.Meta(ge=0)] | None = None
    #: start in the background: reply at once, output discarded, ``exec_finished`` event at exit
    detach: bool = False


class ExecReply(Envelope, kw_only=True, tag="sandbox_exec_reply"):
    sandbox_id: str
    exec_id: str
    #: the exit status; 128 + N when killed by signal N; None for a detached exec
    exit_code: int | None
    stdout: bytes = b""
    stderr: bytes = b""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    duration_s: float = 0.0
    timed_out: bool = False
    #: the sandbox's memory limit OOM-killed a process during this exec
    oom_killed: bool = False
    detached: bool = False


class WriteFilesRequest(Envelope, kw_only=True, tag="sandbox_write_files"):
    sandbox_id: str
    files: list[FileData]


class WriteFilesReply(Envelope, kw_only=True, tag="sandbox_write_files_reply"):
    sandbox_id: str
    files: int
    bytes: int


class ReadFilesRequest(Envelope, kw_only=True, tag="sandbox_read_files"):
    sandbox_id: str
    paths: list[str]
    #: read at most this many bytes of each file; None = service default
    max_bytes: Annotated[int, msgspec.Meta(ge=0)] | None = None


class FileContent(msgspec.Struct, kw_only=True, tag="content"):
    path: str
    data: bytes
    #: size of the whole file; ``truncated`` when larger than what was read
    size: int
    truncated: bool = False


class FileError(msgspec.Struct, kw_only=True, tag="error"):
    path: str
    error: str


class ReadFilesReply(Envelope, kw_only=True, tag="sandbox_read_files_reply"):
    sandbox_id: str
    files: list[FileContent | FileError]


class PauseRequest(Envelope, kw_only=True, tag="sandbox_pause"):
    sandbox_id: str


class PauseReply(Envelope, kw_only=True, tag="sandbox_pause_reply"):
    sandbox_id: str
    state: SandboxState


class ResumeRequest(Envelope, kw_only=True, tag="sandbox_resume"):
    sandbox_id: str


class ResumeReply(Envelope, kw_only=True, tag="sandbox_resume_reply"):
    sandbox_id: str
    state: SandboxState


class SnapshotRequest(Envelope, kw_only=True, tag="sandbox_snapshot"):
    """Freeze the work directory's current state; the sandbox keeps running."""

    sandbox_id: str


class SnapshotReply(Envelope, kw_only=True, tag="sandbox_snapshot_reply"):
    sandbox_id: str
    snapshot_id: str
    #: True when processes were running and the writable layer had to be copied (O(size));
    #: False for the O(1) layer swap
    copied: bool = False


class ForkRequest(Envelope, kw_only=True, tag="sandbox_fork"):
    """A new sandbox from a snapshot or a live sandbox (which is not disturbed)."""

    source: ForkSource
    lease_ttl_s: Annotated[float, msgspec.Meta(gt=0.0)] | None = None
    labels: dict[str, str] = {}


class ForkReply(Envelope, kw_only=True, tag="sandbox_fork_reply"):
    sandbox_id: str
    instance_id: str
    snapshot_id: str
    lease_expires_at: float


class DestroyRequest(Envelope, kw_only=True, tag="sandbox_destroy"):
    sandbox_id: str


class DestroyReply(Envelope, kw_only=True, tag="sandbox_destroy_reply"):
    sandbox_id: str


class ListRequest(Envelope, kw_only=True, tag="sandbox_list"):
    """List sandboxes; only this run's unless ``all_runs``."""

    all_runs: bool = False


class ListReply(Envelope, kw_only=True, tag="sandbox_list_reply"):
    instance_id: str
    sandboxes: list[SandboxInfo]


class RenewLeaseRequest(Envelope, kw_only=True, tag="sandbox_renew_lease"):
    sandbox_id: str
    #: new lease length from now; None = the sandbox's own TTL
    ttl_s: Annotated[float, msgspec.Meta(gt=0.0)] | None = None


class RenewLeaseReply(Envelope, kw_only=True, tag="sandbox_renew_lease_reply"):
    sandbox_id: str
    lease_expires_at: float


ErrorCode = Literal["not_found", "invalid", "conflict", "limit", "unavailable", "internal", "overloaded"]


class ErrorReply(Envelope, kw_only=True, tag="sandbox_error"):
    """Any request can be answered with this instead of its reply.

    ``not_found``: no such sandbox/snapshot (destroyed, expired, or another
    instance's); ``invalid``: the request breaks a rule (message says which);
    ``conflict``: wrong state (e.g. exec on a paused sandbox); ``limit``: a
    capacity limit of the instance; ``unavailable``: the backend cannot run;
    ``internal``: a bug or host failure (message has the detail); ``overloaded``: the instance
    did not start the request (past an admission bound, or its deadline passed while it
    waited): nothing was done, send it again after ``retry_after_s`` (a create may reach another
    instance).
    """

    code: ErrorCode
    message: str
    sandbox_id: str | None = None
    #: with ``overloaded``: seconds to wait before sending the request again
    retry_after_s: float | None = None


#: Requests answered by the instance owning the sandbox (``catalog.SANDBOX_REQUESTS.subject(run, instance)``).
InstanceRequest = (
    ExecRequest
    | WriteFilesRequest
    | ReadFilesRequest
    | PauseRequest
    | ResumeRequest
    | SnapshotRequest
    | ForkRequest
    | DestroyRequest
    | RenewLeaseRequest
)

#: The reply type of each request type.
REPLY_TYPES: dict[type, type] = {
    CreateRequest: CreateReply,
    ExecRequest: ExecReply,
    WriteFilesRequest: WriteFilesReply,
    ReadFilesRequest: ReadFilesReply,
    PauseRequest: PauseReply,
    ResumeRequest: ResumeReply,
    SnapshotRequest: SnapshotReply,
    ForkRequest: ForkReply,
    DestroyRequest: DestroyReply,
    ListRequest: ListReply,
    RenewLeaseRequest: RenewLeaseReply,
}


# --- lifecycle events ----------------------------------------------------------------------------


class Created(msgspec.Struct, kw_only=True, frozen=True, tag="created"):
    base: str
    limits: Limits
    egress: list[str] = []
    lease_ttl_s: float
    labels: dict[str, str] = {}


class ExecStarted(msgspec.Struct, kw_only=True, frozen=True, tag="exec_started"):
    exec_id: str
    #: the argv (a shell script appears as ``[shell, "-c", script]``), each item cut to 200 chars
    argv: list[str]
    detach: bool = False


class ExecFinished(msgspec.Struct, kw_only=True, frozen=True, tag="exec_finished"):
    exec_id: str
    exit_code: int | None
    duration_s: float
    timed_out: bool = False
    oom_killed: bool = False
    stdout_bytes: int = 0
    stderr_bytes: int = 0


class Paused(msgspec.Struct, kw_only=True, frozen=True, tag="paused"):
    pass


class Resumed(msgspec.Struct, kw_only=True, frozen=True, tag="resumed"):
    pass


class Snapshotted(msgspec.Struct, kw_only=True, frozen=True, tag="snapshotted"):
    snapshot_id: str
    copied: bool = False


class Forked(msgspec.Struct, kw_only=True, frozen=True, tag="forked"):
    """The first event of a sandbox made by ``fork`` (instead of ``created``)."""

    snapshot_id: str
    parent_id: str | None = None
    lease_ttl_s: float
    labels: dict[str, str] = {}


DestroyReason = Literal["requested", "lease_expired", "shutdown", "orphan_reaped", "failed"]


class Destroyed(msgspec.Struct, kw_only=True, frozen=True, tag="destroyed"):
    reason: DestroyReason


class Oom(msgspec.Struct, kw_only=True, frozen=True, tag="oom"):
    exec_id: str | None
    memory_mb: int
    #: processes the kernel OOM-killed in this sandbox so far
    kills: int = 1


class Timeout(msgspec.Struct, kw_only=True, frozen=True, tag="timeout"):
    exec_id: str
    timeout_s: float


class LeaseExpired(msgspec.Struct, kw_only=True, frozen=True, tag="lease_expired"):
    lease_ttl_s: float


class LimitExceeded(msgspec.Struct, kw_only=True, frozen=True, tag="limit_exceeded"):
    """The sandbox ran out of a quota (its writes failed with ENOSPC): reported by every exec that ends with
    the quota exhausted, and by a ``write_files`` refused for it."""

    #: ``disk`` (bytes, ``limit`` in MiB) or ``inodes`` (files, ``limit`` a count)
    resource: Literal["disk", "inodes"]
    limit: int
    exec_id: str | None = None


class EgressRefused(msgspec.Struct, kw_only=True, frozen=True, tag="egress_refused"):
    host: str
    port: int
    reason: str
    exec_id: str | None = None


EventDetail = (
    Created
    | ExecStarted
    | ExecFinished
    | Paused
    | Resumed
    | Snapshotted
    | Forked
    | Destroyed
    | Oom
    | Timeout
    | LeaseExpired
    | EgressRefused
    | LimitExceeded
)

EventKind = Literal[
    "created", "exec_started", "exec_finished", "paused", "resumed", "snapshotted", "forked",
    "destroyed", "oom", "timeout", "lease_expired", "egress_refused", "limit_exceeded",
]


class SandboxEvent(Envelope, kw_only=True, tag="sandbox_event"):
    """One state change of one sandbox (instances → stream SANDBOX_EVENTS)."""

    sandbox_id: str
    instance_id: str
    #: 1, 2, ... per sandbox in the order the instance saw the changes; 0 when an
    #: instance reaped a dead predecessor's sandbox
    seq: int
    detail: EventDetail

    @property
    def kind(self) -> EventKind:
        """The detail's tag (``"created"``, ``"exec_finished"``, ...)."""
        return self.detail.__struct_config__.tag  # type: ignore[return-value]


#: Every message of the sandbox API and its events, as one union.
AnyMessage = (
    SandboxEvent
    | CreateRequest
    | CreateReply
    | ExecRequest
    | ExecReply
    | WriteFilesRequest
    | WriteFilesReply
    | ReadFilesRequest
    | ReadFilesReply
    | PauseRequest
    | PauseReply
    | ResumeRequest
    | ResumeReply
    | SnapshotRequest
    | SnapshotReply
    | ForkRequest
    | ForkReply
    | DestroyRequest
    | DestroyReply
    | ListRequest
    | ListReply
    | RenewLeaseRequest
    | RenewLeaseReply
    | ErrorReply
)
