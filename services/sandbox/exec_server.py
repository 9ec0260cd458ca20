"""The host side of a sandbox's exec server: one bubblewrap per sandbox instead of one per exec.

Starting ``sh`` → ``setpriv`` → ``bwrap`` → the command for every exec costs ~9 ms here, most of an
agent's tool call. With ``exec_path`` ``server`` or ``hybrid``, a sandbox's first (second) exec starts a
small server (:mod:`.exec_server_main`) through the sandbox's own command line (same cgroup, uid,
namespaces, read-only base, scrubbed environment) as the sandbox's pid 1 (``--as-pid-1``); once it
has said ``ready``, each later exec is a request on a unix socket and runs as a child of the server,
with pipes the host made and passed over (``SCM_RIGHTS``). ``server``: the first exec waits for the
server; ``hybrid``: the second exec starts it in the background and execs run through their own
bwrap until it is ready, so a sandbox with one exec never pays for it (Python's start, ~20-50 ms of
CPU here, more than the bwrap it saves). Execs also run through their own bwrap wherever a server cannot (no interpreter in the base, a
failed start).

What the host still enforces itself, whatever the server does (it runs the sandbox's uid: code in the
sandbox can kill or ptrace it): the timeout (a ``kill`` request; if the exec is not reported gone
within :data:`KILL_GRACE_S`, SIGKILL of the server's pid 1, which ends every process of its pid
namespace), the output caps (the host reads the pipes), the cgroup limits, and the destroy (the
cgroup is killed). A server that dies or stops answering fails its running execs (exit code None);
the next exec starts a new one.

Differences from an exec with its own bwrap: execs of one sandbox share a pid and network namespace
(a server an exec left running is reachable from the next exec on localhost), the egress listener is
opened once per server, and the server (~10 MB of Python) counts against the sandbox's memory and
pids limits.
"""

from __future__ import annotations

import array
import asyncio
import json
import logging
import marshal
import os
import socket
import subprocess
import time
from pathlib import Path

from services.sandbox.backend import SandboxFailure
from services.sandbox.bwrap_exec import Listen
from services.sandbox.config import SandboxConfig
from services.sandbox.host import kill_pidfd, read_to_eof, wait_exited

log = logging.getLogger("rlbus.sandbox.exec_server")

SOURCE = (Path(__file__).parent / "exec_server_main.py").read_text()
#: how long a killed exec may take to be reported gone before the whole server is killed
KILL_GRACE_S = 2.0
#: how long a starting server may take to say ``ready``
READY_TIMEOUT_S = 30.0
MAX_LINE = 4096


def server_python_in(cfg: SandboxConfig, base: str, root: str) -> bool:
    """Whether base ``base`` (whose root filesystem is ``root``; "/" for ``host``) holds the server's interpreter."""
    python = cfg.exec_server_python
    if base == "host":
        shown = any(python == p or python.startswith(p.rstrip("/") + "/") for p in cfg.host_paths)
        return shown and os.path.exists(python)
    return os.path.lexists(os.path.join(root, python.lstrip("/")))


class Monitor:
    """The server's bwrap monitor process, started from a worker thread by :class:`subprocess.Popen` (which uses
    vfork: ~3 ms here) instead of the event loop's own spawn (which forks the whole service: ~8 ms here, every
    request of the instance waiting meanwhile). The slice of :class:`asyncio.subprocess.Process` the server uses."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self.popen = popen
        self.pid = popen.pid
        self._exited: asyncio.Future[None] | None = None

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()

    async def wait(self) -> int:
        """Until it has exited (its pidfd turns readable), then reaped."""
        if self.popen.poll() is None:
            if self._exited is None:
                self._exited = asyncio.ensure_future(self._watch())
            await asyncio.shield(self._exited)
        return self.popen.wait()

    async def _watch(self) -> None:
        try:
            pidfd = os.pidfd_open(self.pid)
        except ProcessLookupError:
            return  # gone already
        try:
            while not await wait_exited(pidfd, 3600.0):
                pass
        finally:
            os.close(pidfd)


async def _popen(argv: list[str], env: dict[str, str], fds: list[int]) -> subprocess.Popen[bytes]:
    """Start ``argv`` from a worker thread. Cancelled meanwhile, it waits for the thread (which uses ``fds``, closed
    by the caller next) and kills what it started before passing the cancellation on."""
    started = asyncio.ensure_future(asyncio.to_thread(
        subprocess.Popen, argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env=env, pass_fds=fds, start_new_session=True))
    try:
        return await asyncio.shield(started)
    except asyncio.CancelledError:
        try:
            popen = await started
        except Exception:  # it did not start: nothing to kill
            raise asyncio.CancelledError from None
        popen.kill()
        await asyncio.to_thread(popen.wait)
        raise


class ServerProc:
    """The slice of :class:`asyncio.subprocess.Process` that :mod:`.execio` and the backend use."""

    def __init__(self) -> None:
        self.stdin: asyncio.StreamWriter | None = None
        self.stdout: asyncio.StreamReader | None = None
        self.stderr: asyncio.StreamReader | None = None
        self.returncode: int | None = None
        #: the pipes' transports, closed with the exec (EOF closes the readers' on its own)
        self.transports: list[asyncio.BaseTransport] = []
        self.done: asyncio.Future[int | None] = asyncio.get_running_loop().create_future()

    async def wait(self) -> int | None:
        return await asyncio.shield(self.done)

    def finish(self, code: int | None) -> None:
        if not self.done.done():
            self.returncode = code
            self.done.set_result(code)


class ServerExec:
    """An exec run by the server; the same interface as :class:`~.bwrap_exec.Exec`."""

    def __init__(self, exec_id: str, server: ExecServer, proc: ServerProc) -> None:
        self.exec_id = exec_id
        self.server = server
        self.proc = proc
        self.started = time.monotonic()

    def kill(self) -> None:
        """Ask the server to kill the exec's process tree; kill the whole server if that does not happen."""
        self.server.kill_exec(self.exec_id)

    async def gone(self, timeout_s: float = 5.0) -> None:
        try:
            await asyncio.wait_for(self.proc.wait(), timeout_s)
        except TimeoutError:
            log.warning("exec %s not reported gone %.0f s after it ended: killing its sandbox's exec server",
                        self.exec_id, timeout_s)
            self.server.kill()
            await self.proc.wait()

    def close(self) -> None:
        for transport in self.proc.transports:
            transport.close()


async def _reader(proc: ServerProc, fd: int) -> asyncio.StreamReader:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 16)
    transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", 0))
    proc.transports.append(transport)
    return reader


async def _writer(proc: ServerProc, fd: int) -> asyncio.StreamWriter:
    loop = asyncio.get_running_loop()
    protocol = asyncio.StreamReaderProtocol(asyncio.StreamReader())
    transport, _ = await loop.connect_write_pipe(lambda: protocol, os.fdopen(fd, "wb", 0))
    proc.transports.append(transport)
    return asyncio.StreamWriter(transport, protocol, None, loop)


class ExecServer:
    """One sandbox's running exec server."""

    def __init__(self, proc: Monitor, pid1: int, sock: socket.socket) -> None:
        self.proc = proc
        #: the server's pid (on the host); SIGKILL through its pidfd ends its whole pid namespace
        self.pid1 = pid1
        self.pidfd: int | None = os.pidfd_open(pid1)
        self.sock = sock
        self.listener: asyncio.Server | None = None
        self.execs: dict[str, ServerProc] = {}
        self.alive = True
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._send_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()
        self._read_task = asyncio.create_task(self._read(), name=f"sandbox-exec-server-{proc.pid}")

    @classmethod
    async def spawn(cls, prefix: list[str], python: str, env: dict[str, str], listen: Listen | None) -> ExecServer:
        """Start the server through the sandbox's command line ``prefix``; returns once its pid 1 runs (then
        :meth:`wait_ready`). ``listen(pid)``, when given, opens the egress listener in its network namespace
        before the server is released."""
        host_end, sandbox_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        info_r, info_w = os.pipe2(os.O_CLOEXEC)
        fds = [info_w, sandbox_end.fileno()]
        extra = ["--info-fd", str(info_w)]
        block_r = block_w = -1
        if listen is not None:
            block_r, block_w = os.pipe2(os.O_CLOEXEC)
            fds.append(block_r)
            extra += ["--block-fd", str(block_r)]
        try:
            proc = Monitor(await _popen([*prefix, "--as-pid-1", "--chdir", "/", *extra, "--",
                                         python, "-I", "-S", "-c", SOURCE, str(sandbox_end.fileno())], env, fds))
        except BaseException:
            for fd in (info_r, info_w, block_r, block_w):
                if fd >= 0:
                    os.close(fd)
            host_end.close()
            sandbox_end.close()
            raise
        for fd in (info_w, block_r):
            if fd >= 0:
                os.close(fd)
        sandbox_end.close()
        host_end.setblocking(False)
        server = None
        try:
            info = await read_to_eof(info_r)
            if not info:
                await proc.wait()
                raise SandboxFailure(f"the exec server's sandbox failed to start (exit {proc.returncode})")
            pid1 = int(json.loads(info)["child-pid"])
            server = cls(proc, pid1, host_end)
            if listen is not None:
                server.listener = await listen(pid1)
                os.write(block_w, b"1")
        except BaseException:
            if server is not None:
                await server.close()
            else:
                host_end.close()
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
            raise
        finally:
            if block_w >= 0:
                os.close(block_w)
        return server

    async def wait_ready(self) -> None:
        """Until the server said ``ready``; a server that does not within :data:`READY_TIMEOUT_S` is killed."""
        try:
            # not asyncio.wait_for: on Python 3.11 it swallows a cancellation that arrives as ``ready`` is set
            await asyncio.wait({self.ready}, timeout=READY_TIMEOUT_S)
            if not self.ready.done():
                raise TimeoutError(f"the exec server did not say ready within {READY_TIMEOUT_S:.0f} s")
            self.ready.result()
        except BaseException:
            await self.close()
            raise

    # --- requests ----------------------------------------------------------------------------

    async def run(self, exec_id: str, argv: list[str], env: dict[str, str], cwd: str, detach: bool) -> ServerExec:
        """Start one exec: its pipes are made here and handed to the server."""
        proc = ServerProc()
        ours: list[int] = []
        theirs: list[int] = []
        try:
            if not detach:  # stdin: the server gets the read end; stdout, stderr: the write ends
                for i in range(3):
                    r, w = os.pipe2(os.O_CLOEXEC)
                    ours.append(w if i == 0 else r)
                    theirs.append(r if i == 0 else w)
            self.execs[exec_id] = proc
            await self._send(("run", exec_id, argv, env, cwd), theirs)
        except BaseException:
            self.execs.pop(exec_id, None)
            for fd in ours:
                os.close(fd)
            raise
        finally:
            for fd in theirs:
                os.close(fd)
        if not detach:
            proc.stdin = await _writer(proc, ours[0])
            proc.stdout = await _reader(proc, ours[1])
            proc.stderr = await _reader(proc, ours[2])
        return ServerExec(exec_id, self, proc)

    def kill_exec(self, exec_id: str) -> None:
        """Ask for the exec's tree to be killed; past :data:`KILL_GRACE_S` without its ``exit``, kill the server."""
        proc = self.execs.get(exec_id)
        if proc is None or not self.alive:
            return
        self._spawn(self._kill_exec(exec_id, proc), f"sandbox-exec-kill-{exec_id}")

    async def _kill_exec(self, exec_id: str, proc: ServerProc) -> None:
        try:
            await self._send(("kill", exec_id), [])
            await asyncio.wait_for(proc.wait(), KILL_GRACE_S)
        except (TimeoutError, OSError, SandboxFailure):
            log.warning("exec %s outlived its kill by %.1f s: killing its sandbox's exec server", exec_id,
                        KILL_GRACE_S)
            self.kill()

    def kill(self) -> None:
        """SIGKILL the server's pid 1: every process of its pid namespace dies with it."""
        if self.pidfd is not None:
            kill_pidfd(self.pidfd)

    async def close(self) -> None:
        """Kill the server and everything it runs; fail its running execs; release its resources."""
        self.kill()
        await self.proc.wait()
        self._dead()
        self._read_task.cancel()
        for task in (self._read_task, *self._tasks):
            try:
                await task
            except (asyncio.CancelledError, Exception):  # a failed kill request: the server is dead anyway
                pass
        self.sock.close()
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None
        if self.listener is not None:
            self.listener.close()
            self.listener = None

    # --- the socket --------------------------------------------------------------------------

    async def _send(self, msg: tuple[object, ...], fds: list[int]) -> None:
        if not self.alive:
            raise SandboxFailure("the sandbox's exec server is gone")
        payload = marshal.dumps(msg)
        frame = len(payload).to_bytes(4, "little") + payload
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        loop = asyncio.get_running_loop()
        async with self._send_lock:
            try:
                while True:
                    try:
                        sent = self.sock.sendmsg([frame], anc)
                        break
                    except BlockingIOError:
                        writable = loop.create_future()
                        loop.add_writer(self.sock.fileno(), lambda w=writable: w.done() or w.set_result(None))
                        try:
                            await writable
                        finally:
                            loop.remove_writer(self.sock.fileno())
                if sent < len(frame):
                    await loop.sock_sendall(self.sock, frame[sent:])
            except OSError as e:  # it died (its end closed) before the reader noticed
                raise SandboxFailure(f"the sandbox's exec server is gone ({e})") from e

    async def _read(self) -> None:
        """Lines from the server: ``ready``, ``exit <id> <code>``; EOF (or nonsense) ends the server."""
        loop = asyncio.get_running_loop()
        buf = b""
        try:
            while True:
                chunk = await loop.sock_recv(self.sock, 1 << 16)
                if not chunk:
                    return
                buf += chunk
                *lines, buf = buf.split(b"\n")
                if len(buf) > MAX_LINE:
                    raise ValueError(f"line of {len(buf)} bytes")
                for line in lines:
                    self._on_line(line.decode("ascii").split())
        except (ValueError, UnicodeDecodeError, IndexError) as e:
            log.warning("exec server of pid %s said nonsense (%s): killing it", self.proc.pid, e)
            self.kill()
        except OSError:
            pass
        finally:
            self._dead()

    def _on_line(self, words: list[str]) -> None:
        if words == ["ready"]:
            if not self.ready.done():
                self.ready.set_result(None)
        elif len(words) == 3 and words[0] == "exit":
            proc = self.execs.pop(words[1], None)
            if proc is not None:
                proc.finish(min(255, max(0, int(words[2]))))
        else:
            raise ValueError(f"unknown message {' '.join(words)[:80]!r}")

    def _dead(self) -> None:
        """The server is gone (or must be treated so): its execs end without an exit code."""
        self.alive = False
        if not self.ready.done():
            self.ready.set_exception(SandboxFailure("the sandbox's exec server exited before it was ready"))
            self.ready.exception()  # retrieved: a start that gave up waiting must not warn
        for proc in self.execs.values():
            proc.finish(None)
        self.execs.clear()

    def _spawn(self, coro, name: str) -> None:  # type: ignore[no-untyped-def]
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
