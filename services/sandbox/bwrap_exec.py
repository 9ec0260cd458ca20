"""Starting one exec of the bwrap backend: the command line and the process handle.

Each exec is ``sh`` (joins the sandbox's cgroup) → ``setpriv`` (drops to the
unprivileged ``sandbox_uid``, no new privileges) → ``bwrap`` (new user, pid, ipc,
uts, mount, net and cgroup namespaces; the read-only base; the work directory
and /tmp bound in; ``--die-with-parent``) → the command, with the environment
the backend built (nothing of the service's own).

Joining the cgroup: the wrapper shell writes ``0`` (itself) into the cgroup's
task files before anything else runs. A process moving *itself* skips the
kernel's global threadgroup lock, whose RCU grace period otherwise costs
~10 ms per exec on cgroup v1; if the shell cannot join, it exits 125 and
nothing runs. ``--info-fd`` reports the sandbox's pid 1; with an egress
allowlist, ``--block-fd`` holds the command until the proxy listener exists in
its network namespace.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from services.sandbox.backend import BackendUnavailable, SandboxFailure
from services.sandbox.config import SandboxConfig
from services.sandbox.host import kill_pidfd, read_to_eof, wait_exited

log = logging.getLogger("rlbus.sandbox.bwrap")

#: ``sh -c`` script: write "0" (= this process) into each file up to "--", then exec the rest
JOIN_CGROUP = (
    'while [ "$1" != -- ]; do echo 0 > "$1" || { echo "rlbus-sandbox: cannot join cgroup $1" >&2; exit 125; }; '
    'shift; done; shift; exec "$@"'
)


def command_prefix(cfg: SandboxConfig, base: list[str], merged: str, tmp: str, shm: str,
                   cgroup_files: list[str]) -> list[str]:
    """Everything before ``--chdir``/``--`` of one sandbox's exec command line (built once per sandbox).

    /dev is bwrap's own small tmpfs of device nodes, remounted read-only so nothing can be written there
    beyond the quotas; /dev/shm is a directory of the sandbox's volume (within its disk and inode quotas)."""
    return [
        "/bin/sh", "-c", JOIN_CGROUP, "rlbus-sandbox", *cgroup_files, "--",
        cfg.setpriv_path, f"--reuid={cfg.sandbox_uid}", f"--regid={cfg.sandbox_gid}", "--clear-groups",
        "--no-new-privs", cfg.bwrap_path,
        "--unshare-user", "--disable-userns", "--uid", "0", "--gid", "0",  # no nested user namespaces
        "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
        "--hostname", cfg.hostname, "--die-with-parent", "--new-session",
        *base,
        "--dev", "/dev", "--proc", "/proc",
        "--bind", merged, cfg.workdir, "--bind", tmp, "/tmp", "--bind", shm, "/dev/shm",
        "--remount-ro", "/dev",  # this mount only: /dev/shm stays writable, device nodes stay usable
        "--remount-ro", "/",  # bwrap's own root (a tmpfs holding the mount points) read-only too
    ]


@dataclass
class Exec:
    """A running exec."""

    exec_id: str
    proc: asyncio.subprocess.Process
    #: the exec's pid 1 (bwrap's init inside the new pid namespace), as a pidfd: no pid-reuse races
    pidfd: int | None
    started: float
    server: asyncio.Server | None = None

    def kill(self) -> None:
        """SIGKILL the exec's pid 1: its whole pid namespace dies, then the bwrap monitor exits."""
        if self.pidfd is not None:
            kill_pidfd(self.pidfd)
            return
        if self.proc.returncode is None:
            self.proc.kill()  # pid 1 unknown: --die-with-parent takes it down with the monitor

    async def gone(self, timeout_s: float = 5.0) -> None:
        """Wait until pid 1 has exited: bwrap's monitor exits as soon as the command does, while pid 1
        may still be tearing down the rest of the namespace."""
        if self.pidfd is not None and not await wait_exited(self.pidfd, timeout_s):
            log.warning("exec %s: pid 1 still alive %.0f s after its command ended (frozen?)", self.exec_id,
                        timeout_s)

    def close(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None
        if self.server is not None:
            self.server.close()


Listen = Callable[[int], Awaitable[asyncio.Server]]


async def spawn(
    prefix: list[str], argv: list[str], env: dict[str, str], cwd: str, detach: bool, listen: Listen | None
) -> Exec:
    """Start one exec. ``listen(pid)``, when given, opens the egress listener in pid's network
    namespace before the command is released."""
    info_r, info_w = os.pipe2(os.O_CLOEXEC)
    fds = [info_w]
    extra = ["--info-fd", str(info_w)]
    block_w = -1
    if listen is not None:
        block_r, block_w = os.pipe2(os.O_CLOEXEC)
        fds.append(block_r)
        extra += ["--block-fd", str(block_r)]
    pipe = asyncio.subprocess.DEVNULL if detach else asyncio.subprocess.PIPE
    try:
        proc = await asyncio.create_subprocess_exec(
            *prefix, "--chdir", cwd, *extra, "--", *argv,
            stdin=pipe, stdout=pipe, stderr=asyncio.subprocess.PIPE if not detach else pipe,
            env=env, pass_fds=fds, start_new_session=True,
        )
    except BaseException:
        for fd in (info_r, *fds, block_w):
            if fd >= 0:
                os.close(fd)
        raise
    for fd in fds:
        os.close(fd)
    try:
        info = await read_to_eof(info_r)
        if not info:
            err = await proc.stderr.read() if proc.stderr else b""
            await proc.wait()
            raise SandboxFailure(f"the sandbox failed to start: {err.decode(errors='replace').strip()}")
        child = int(json.loads(info)["child-pid"])
        try:
            pidfd: int | None = os.pidfd_open(child)
        except ProcessLookupError:
            pidfd = None  # already finished (and reaped by the monitor)
        ex = Exec(exec_id="", proc=proc, pidfd=pidfd, started=time.monotonic())
        if listen is not None:
            try:
                ex.server = await listen(child)
            except BaseException:
                # kill before the block fd closes: EOF on it would release the command
                ex.kill()
                proc.kill()
                await proc.wait()
                ex.close()
                raise
            os.write(block_w, b"1")
    finally:
        if block_w >= 0:
            os.close(block_w)
    return ex


async def smoke_test(prefix: list[str]) -> None:
    """One ``true`` through the full command line: catches hosts that forbid user namespaces."""
    proc = await asyncio.create_subprocess_exec(
        *prefix, "--", "true", stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE, env={}, start_new_session=True,
    )
    _, err = await proc.communicate()
    if proc.returncode != 0:
        raise BackendUnavailable(
            f"bubblewrap cannot start a sandbox here: {err.decode(errors='replace').strip()} "
            "(unprivileged user namespaces may be disabled: sysctl user.max_user_namespaces, "
            "kernel.apparmor_restrict_unprivileged_userns)"
        )
