"""An async client of the sandbox service, for rollout agent loops, judges and tools.

Creates go to the run's create subject (the instances' queue group picks one); every other verb
goes to the instance that owns the sandbox or snapshot (:func:`proto.sandbox.instance_of` reads it
from the id); ``list`` is a scatter/gather over every instance. Each method returns the typed reply
or raises :class:`SandboxClientError` carrying the service's :class:`proto.sandbox.ErrorReply`
(transport failures are turned into one too: no instance → ``unavailable`` for creates and
``not_found`` for a sandbox whose instance is gone, with ``instance_gone`` set; no answer in time →
:class:`SandboxTimeout`, unless a probe of the owning instance then finds no one serving it: an instance
killed while it held the request never answers, and that too is ``instance_gone``).

Every request carries its deadline (header :data:`proto.sandbox.DEADLINE_HEADER`: when this client stops
waiting), so an instance never starts one its caller has given up on. An ``overloaded`` answer (nothing was
done) is retried after an exponential, jittered back-off of at least the answer's ``retry_after_s`` while
the call's time lasts (a create then reaches any instance of the queue group); with
``retry_overloaded=False`` it is raised at once.

Usage::

    client = SandboxClient(nc, run_id)
    sid = (await client.create(files={"main.py": b"print(1)"})).sandbox_id
    r = await client.exec(sid, ["python3", "main.py"], timeout_s=10)
    await client.destroy(sid)
"""

from __future__ import annotations

import asyncio
import random
import re
import time
import typing
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import nats.errors
from nats.aio.client import Client

from proto import catalog, codec
from proto import sandbox as api
from services.runtime import tracing

R = TypeVar("R")

Files = Mapping[str, bytes] | Sequence[api.FileData]


class SandboxClientError(Exception):
    """A request was answered with an error (or could not be delivered); ``error`` is the ErrorReply.

    ``instance_gone``: the instance that owned the sandbox no longer serves (it stopped or crashed, and every
    sandbox it held went with it). That is the service's failure, not the episode's: a caller can start
    the episode again on a new sandbox (a create reaches a live instance) instead of failing the rollout.
    """

    def __init__(self, verb: str, error: api.ErrorReply, *, instance_gone: bool = False) -> None:
        self.verb = verb
        self.error = error
        self.code: api.ErrorCode = error.code
        self.sandbox_id = error.sandbox_id
        self.instance_gone = instance_gone
        super().__init__(f"sandbox {verb} failed ({error.code}): {error.message}")


class SandboxTimeout(SandboxClientError):
    """No reply in time. The request may still have been carried out (e.g. the sandbox exists)."""


def _verb(req: Any) -> str:
    """``WriteFilesRequest`` → ``write_files``."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", type(req).__name__.removesuffix("Request")).lower()


_REPLY_UNIONS: dict[type, Any] = {
    req_type: typing.Union[reply_type, api.ErrorReply]  # noqa: UP007 - built at run time
    for req_type, reply_type in api.REPLY_TYPES.items()
}


def as_command(command: api.Command | str | Sequence[str]) -> api.Command:
    """A shell script (``str``), an argv (sequence of ``str``) or a Command Struct."""
    if isinstance(command, api.Argv | api.Shell):
        return command
    if isinstance(command, str):
        return api.Shell(script=command)
    return api.Argv(args=list(command))


def as_files(files: Files) -> list[api.FileData]:
    """``{path: data}`` or FileData items."""
    if isinstance(files, Mapping):
        return [api.FileData(path=p, data=d) for p, d in files.items()]
    return list(files)


class SandboxClient:
    """Typed request/reply with the sandbox instances of one run (see the module docstring)."""

    def __init__(self, nc: Client, run_id: str, *, timeout_s: float = 60.0, default_exec_timeout_s: float = 60.0,
                 exec_margin_s: float = 10.0, list_window_s: float = 0.5, probe_timeout_s: float = 5.0,
                 retry_overloaded: bool = True, backoff_s: float = 0.05, max_backoff_s: float = 2.0) -> None:
        """``timeout_s``: how long to wait for a reply to anything but a foreground exec; a foreground exec
        waits for its own ``timeout_s`` (or ``default_exec_timeout_s``, the service's default) plus
        ``exec_margin_s``; ``list_window_s``: how long ``list`` waits for one more instance to answer;
        ``probe_timeout_s``: how long the probe of an instance that did not answer in time waits;
        ``retry_overloaded``: send a request answered ``overloaded`` again (within its time), waiting
        ``backoff_s`` doubled per try up to ``max_backoff_s`` (jittered, at least the answer's ``retry_after_s``)."""
        self.nc = nc
        self.run_id = run_id
        self.timeout_s = timeout_s
        self.default_exec_timeout_s = default_exec_timeout_s
        self.exec_margin_s = exec_margin_s
        self.list_window_s = list_window_s
        self.probe_timeout_s = probe_timeout_s
        self.retry_overloaded = retry_overloaded
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        #: ``overloaded`` answers this client got, and how many of them it sent again
        self.overloaded = 0
        self.retried = 0

    # --- the generic call ------------------------------------------------------------------------

    def subject_for(self, req: Any) -> str:
        """Where a request goes: the create subject, the owner's instance subject, or the list subject."""
        if isinstance(req, api.ListRequest):
            return catalog.SANDBOX_LIST.subject(self.run_id)
        catalog.SANDBOX_REQUESTS.check(req)
        if isinstance(req, api.CreateRequest):
            return catalog.SANDBOX_REQUESTS.subject(self.run_id, api.CREATE_TARGET)
        return catalog.SANDBOX_REQUESTS.subject(self.run_id, api.instance_of(self.target_of(req)))

    @staticmethod
    def target_of(req: Any) -> str:
        """The sandbox or snapshot id a request acts on (what routes it)."""
        if isinstance(req, api.ForkRequest):
            src = req.source
            return src.sandbox_id if isinstance(src, api.FromSandbox) else src.snapshot_id
        return req.sandbox_id

    def timeout_for(self, req: Any) -> float:
        """Seconds to wait for the reply: a foreground exec's own time limit plus a margin, else ``timeout_s``."""
        if isinstance(req, api.ExecRequest) and not req.detach:
            return (req.timeout_s or self.default_exec_timeout_s) + self.exec_margin_s
        return self.timeout_s

    async def call(self, req: Any) -> Any:
        """Send any request Struct of :mod:`proto.sandbox` (but ``ListRequest``) and return its typed reply."""
        if isinstance(req, api.ListRequest):
            raise TypeError("ListRequest is a scatter/gather: use SandboxClient.list()")
        loop = asyncio.get_running_loop()
        end = loop.time() + self.timeout_for(req)
        tries = 0
        while True:
            try:
                return await self._call_once(req, end - loop.time())
            except SandboxClientError as e:
                if e.code != "overloaded":
                    raise
                self.overloaded += 1
                wait = max(e.error.retry_after_s or 0.0, min(self.max_backoff_s, self.backoff_s * 2 ** tries))
                wait *= 0.5 + random.random()  # jitter: refused callers do not all come back at once
                if not self.retry_overloaded or loop.time() + wait >= end:
                    raise
            tries += 1
            self.retried += 1
            await asyncio.sleep(wait)

    async def _call_once(self, req: Any, timeout: float) -> Any:
        verb = _verb(req)
        subject = self.subject_for(req)
        with tracing.span(f"sandbox.{verb}", kind="producer", subject=subject):
            headers: dict[str, str] = {api.DEADLINE_HEADER: f"{time.time() + timeout:.3f}"}
            tracing.inject(headers)
            try:
                msg = await self.nc.request(subject, codec.encode(req), timeout=timeout, headers=headers)
            except nats.errors.NoRespondersError:
                raise SandboxClientError(verb, self._no_responders(req),
                                         instance_gone=not isinstance(req, api.CreateRequest)) from None
            except nats.errors.TimeoutError:
                if not isinstance(req, api.CreateRequest) and await self._owner_gone(subject, req):
                    raise SandboxClientError(verb, self._no_responders(req), instance_gone=True) from None
                raise SandboxTimeout(verb, api.ErrorReply(
                    run_id=self.run_id, code="unavailable", sandbox_id=getattr(req, "sandbox_id", None),
                    message=f"no reply on {subject} within {timeout:.1f}s (the instance is overloaded or gone); "
                    "the request may still have been carried out",
                )) from None
        reply = self._decode(verb, msg.data, _REPLY_UNIONS[type(req)])
        if isinstance(reply, api.ErrorReply):
            raise SandboxClientError(verb, reply)
        return reply

    async def _owner_gone(self, subject: str, req: Any) -> bool:
        """After ``req`` went unanswered: whether its owning instance has stopped serving. The probe reads no
        file of the target (a request with no side effects); only the server's "no responders" says gone,
        an answer or a further silence (an overloaded instance) does not."""
        probe = api.ReadFilesRequest(run_id=self.run_id, sandbox_id=self.target_of(req), paths=[])
        try:
            await self.nc.request(subject, codec.encode(probe), timeout=self.probe_timeout_s)
        except nats.errors.NoRespondersError:
            return True
        except nats.errors.TimeoutError:
            return False
        return False

    def _no_responders(self, req: Any) -> api.ErrorReply:
        if isinstance(req, api.CreateRequest):
            return api.ErrorReply(run_id=self.run_id, code="unavailable",
                                  message=f"no sandbox instance serves run {self.run_id!r} (is the service up?)")
        target = self.target_of(req)
        return api.ErrorReply(run_id=self.run_id, code="not_found", sandbox_id=getattr(req, "sandbox_id", None),
                              message=f"instance {api.instance_of(target)!r} that owned {target} is not serving "
                              "(stopped or crashed): its sandboxes are gone")

    def _decode(self, verb: str, data: bytes, typ: Any) -> Any:
        try:
            return codec.decode(data, typ, max_bytes=None)
        except codec.DecodeError as e:
            raise SandboxClientError(verb, api.ErrorReply(
                run_id=self.run_id, code="internal", message=f"undecodable reply from the sandbox service: {e}",
            )) from None

    # --- the verbs -------------------------------------------------------------------------------

    async def create(self, *, base: str = "host", limits: api.Limits | None = None, env: Mapping[str, str] | None = None,
                     files: Files | None = None, egress: Sequence[str] = (), lease_ttl_s: float | None = None,
                     labels: Mapping[str, str] | None = None) -> api.CreateReply:
        """A new sandbox on whichever instance takes it; see :class:`proto.sandbox.CreateRequest`."""
        return await self.call(api.CreateRequest(
            run_id=self.run_id, base=base, limits=limits or api.Limits(), env=dict(env or {}),
            files=as_files(files or {}), egress=list(egress), lease_ttl_s=lease_ttl_s, labels=dict(labels or {}),
        ))

    async def exec(self, sandbox_id: str, command: api.Command | str | Sequence[str], *, stdin: bytes = b"",
                   env: Mapping[str, str] | None = None, cwd: str | None = None, timeout_s: float | None = None,
                   max_output_bytes: int | None = None, detach: bool = False) -> api.ExecReply:
        """Run ``command`` (a shell script ``str``, an argv list, or a Command); waits for a foreground exec."""
        return await self.call(api.ExecRequest(
            run_id=self.run_id, sandbox_id=sandbox_id, command=as_command(command), stdin=stdin, env=dict(env or {}),
            cwd=cwd, timeout_s=timeout_s, max_output_bytes=max_output_bytes, detach=detach,
        ))

    async def write_files(self, sandbox_id: str, files: Files) -> api.WriteFilesReply:
        return await self.call(api.WriteFilesRequest(run_id=self.run_id, sandbox_id=sandbox_id, files=as_files(files)))

    async def read_files(self, sandbox_id: str, paths: Sequence[str], *, max_bytes: int | None = None
                         ) -> api.ReadFilesReply:
        return await self.call(api.ReadFilesRequest(run_id=self.run_id, sandbox_id=sandbox_id, paths=list(paths),
                                                    max_bytes=max_bytes))

    async def read_file(self, sandbox_id: str, path: str) -> bytes:
        """One file's content; raises :class:`FileNotFoundError` with the service's reason if it cannot be read."""
        f = (await self.read_files(sandbox_id, [path])).files[0]
        if isinstance(f, api.FileError):
            raise FileNotFoundError(f"{path} in sandbox {sandbox_id}: {f.error}")
        return f.data

    async def pause(self, sandbox_id: str) -> api.PauseReply:
        return await self.call(api.PauseRequest(run_id=self.run_id, sandbox_id=sandbox_id))

    async def resume(self, sandbox_id: str) -> api.ResumeReply:
        return await self.call(api.ResumeRequest(run_id=self.run_id, sandbox_id=sandbox_id))

    async def snapshot(self, sandbox_id: str) -> api.SnapshotReply:
        return await self.call(api.SnapshotRequest(run_id=self.run_id, sandbox_id=sandbox_id))

    async def fork(self, *, sandbox_id: str | None = None, snapshot_id: str | None = None,
                   lease_ttl_s: float | None = None, labels: Mapping[str, str] | None = None) -> api.ForkReply:
        """A new sandbox (on the source's instance) from a live sandbox or from a snapshot: name exactly one."""
        if (sandbox_id is None) == (snapshot_id is None):
            raise ValueError("fork needs exactly one of sandbox_id= (a live sandbox) or snapshot_id=")
        source: api.ForkSource = (api.FromSandbox(sandbox_id=sandbox_id) if sandbox_id is not None
                                  else api.FromSnapshot(snapshot_id=snapshot_id))  # type: ignore[arg-type]
        return await self.call(api.ForkRequest(run_id=self.run_id, source=source, lease_ttl_s=lease_ttl_s,
                                               labels=dict(labels or {})))

    async def destroy(self, sandbox_id: str) -> api.DestroyReply:
        return await self.call(api.DestroyRequest(run_id=self.run_id, sandbox_id=sandbox_id))

    async def renew_lease(self, sandbox_id: str, ttl_s: float | None = None) -> api.RenewLeaseReply:
        """Push the lease ``ttl_s`` (default: the sandbox's own TTL) into the future."""
        return await self.call(api.RenewLeaseRequest(run_id=self.run_id, sandbox_id=sandbox_id, ttl_s=ttl_s))

    async def list(self, *, all_runs: bool = False, expected: int | None = None,
                   window_s: float | None = None) -> list[api.ListReply]:
        """Every instance's sandboxes, one ListReply per instance that answered (sorted by instance id).

        Replies are collected until ``window_s`` (default ``list_window_s``) passes without a new one,
        ``expected`` instances have answered, or ``timeout_s`` is over.
        """
        window = self.list_window_s if window_s is None else window_s
        req = api.ListRequest(run_id=self.run_id, all_runs=all_runs)
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox)
        replies: dict[str, api.ListReply] = {}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        try:
            with tracing.span("sandbox.list", kind="producer"):
                headers: dict[str, str] = {}
                tracing.inject(headers)
                await self.nc.publish(catalog.SANDBOX_LIST.subject(self.run_id), codec.encode(req), reply=inbox,
                                      headers=headers or None)
            while expected is None or len(replies) < expected:
                wait = min(window, deadline - loop.time())
                if wait <= 0:
                    break
                try:
                    msg = await sub.next_msg(timeout=wait)
                except nats.errors.TimeoutError:
                    break
                if not msg.data and (msg.headers or {}).get("Status") == "503":
                    break  # the server's "no responders" status: no instance is serving
                reply = self._decode("list", msg.data, _REPLY_UNIONS[api.ListRequest])
                if isinstance(reply, api.ErrorReply):
                    raise SandboxClientError("list", reply)
                replies[reply.instance_id] = reply
        finally:
            await sub.unsubscribe()
        return [replies[k] for k in sorted(replies)]

    async def sandboxes(self, *, all_runs: bool = False, expected: int | None = None) -> list[api.SandboxInfo]:
        """``list`` flattened: every sandbox of every instance that answered."""
        return [s for r in await self.list(all_runs=all_runs, expected=expected) for s in r.sandboxes]

    async def wait_ready(self, instances: int = 1, timeout_s: float = 30.0) -> list[api.ListReply]:
        """Wait until ``instances`` sandbox instances of the run answer ``list`` (a service just started)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            found = await self.list(expected=instances, window_s=min(1.0, max(0.05, deadline - loop.time())))
            if len(found) >= instances:
                return found
            if loop.time() >= deadline:
                raise SandboxTimeout("list", api.ErrorReply(
                    run_id=self.run_id, code="unavailable",
                    message=f"{len(found)} of {instances} sandbox instances of run {self.run_id!r} answered within "
                    f"{timeout_s:.0f}s",
                ))
