"""The exec server: pid 1 of a sandbox, started once by bubblewrap, runs each exec as a child of itself.

This file runs *inside* the sandbox (``python3 -I -S -c <this source> <fd>``), under the sandbox's
uid, namespaces, cgroup and scrubbed environment; it imports only built-in modules (no site, no
repository code) so it starts in the sandbox's own interpreter. The host side is
:mod:`services.sandbox.exec_server`. The server enforces nothing the host relies on: timeouts,
output caps and the last-resort kill (of this whole pid namespace) stay on the host.

Protocol on the unix stream socket ``fd`` (the host holds the other end):

* host → server: a frame ``<u32 length><marshal payload>``; the first byte of a frame carries, as
  ``SCM_RIGHTS``, the exec's stdin, stdout and stderr pipes (none for a detached exec, which gets
  /dev/null). Payloads: ``("run", id, argv, env, cwd)`` and ``("kill", id)``.
* server → host: ASCII lines, ``ready`` once, then ``exit <id> <code>`` when an exec's shepherd
  is gone (code: the command's exit status, or 128 + the signal that killed it).

Each exec gets a *shepherd*: a forked child that is a child subreaper (``PR_SET_CHILD_SUBREAPER``),
leads a new session and starts the command. Whatever the command leaves behind (background jobs,
double-forked daemons) is re-parented to the shepherd, which kills all of it (SIGKILL, until it has
no child left) when the command exits or when the host asks for the kill (SIGUSR1); only then does
it exit, so ``exit`` means the exec's whole process tree is gone and its pipes are closed. A
shepherd killed from inside the sandbox re-parents its exec's processes to pid 1 (this server): any
child of the server that is not a shepherd is such a stray and is killed, with its tree, as soon as
the shepherd's death is noticed.
"""

import _signal
import _socket
import marshal
import os
import sys

PR_SET_CHILD_SUBREAPER = 36
MSG_CMSG_CLOEXEC = 0x40000000


def children(pid):
    """Pids of the children of ``pid`` (from /proc/<pid>/task/<tid>/children)."""
    found = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                found += [int(k) for k in f.read().split()]
        except (OSError, ValueError):
            continue
    return found


def descendants(root):
    """Pids of every descendant of ``root``."""
    found, todo = [], [root]
    while todo:
        kids = children(todo.pop())
        found += kids
        todo += kids
    return found


def kill_all(pids):
    for pid in pids:
        try:
            os.kill(pid, 9)
        except OSError:
            pass


def kill_descendants():
    kill_all(descendants(os.getpid()))


def shepherd(libc, argv, env, cwd, fds):
    """In the shepherd's process: run the command, then kill whatever it left; exit with its status.

    The command is started with ``posix_spawnp`` (a vfork: ~1 ms here, a fork of this interpreter then
    ``execve`` ~4 ms); it inherits the shepherd's directory, session and its PATH for the lookup, gets
    default signal dispositions (Python ignores SIGPIPE) and an empty signal mask, and only fds 0-2
    (every other descriptor here is close-on-exec)."""
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    os.setsid()
    _signal.signal(_signal.SIGCHLD, _signal.SIG_DFL)
    _signal.signal(_signal.SIGUSR1, lambda *_: kill_descendants())
    try:
        os.chdir(cwd)
        os.environ.clear()
        os.environ["PATH"] = env.get("PATH", "/usr/bin:/bin")
        actions = [(os.POSIX_SPAWN_DUP2, fd, i) for i, fd in enumerate(fds)]
        pid = os.posix_spawnp(argv[0], argv, env, file_actions=actions, setsigmask=(),
                              setsigdef=(_signal.SIGPIPE, _signal.SIGXFSZ, _signal.SIGUSR1, _signal.SIGCHLD))
    except OSError as e:
        os.write(fds[2], f"rlbus-sandbox: cannot run {argv[0]!r} in {cwd!r}: {e.strerror}\n".encode())
        os._exit(127 if isinstance(e, FileNotFoundError) else 126)
    for fd in fds:
        os.close(fd)
    _, status = os.waitpid(pid, 0)
    while True:  # the command's leftovers were re-parented here: kill them until none is left
        kill_descendants()
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            break
    code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)
    os._exit(code)


def recv_exact(sock, n):
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


def main():
    if os.getpid() != 1:  # it kills every child that is not a shepherd: only ever as pid 1 of its own namespace
        sys.exit("rlbus exec server: refusing to run outside a sandbox (not pid 1 of its own pid namespace)")
    import ctypes  # the only non-trivial import

    fd = int(sys.argv[1])
    os.set_inheritable(fd, False)
    sock = _socket.socket(fileno=fd)
    libc = ctypes.CDLL(None, use_errno=True)
    shepherds = {}  # shepherd pid -> exec id

    def send(line):
        sock.sendall(line.encode() + b"\n")

    def reap(*_):
        finished = []
        while True:
            while True:
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                exec_id = shepherds.pop(pid, None)  # None: a stray (below) that died
                if exec_id is not None:
                    code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)
                    finished.append(f"exit {exec_id} {code}")
            # a shepherd killed from inside left its exec's processes to pid 1: strays, killed with their trees
            # (again and again: a stray may fork while it is being killed)
            strays = [pid for pid in children(os.getpid()) if pid not in shepherds]
            if not strays:
                break
            for stray in strays:
                kill_all([stray, *descendants(stray)])
            try:
                os.waitpid(strays[0], 0)
            except ChildProcessError:
                pass
        for line in finished:
            send(line)

    _signal.signal(_signal.SIGCHLD, reap)
    space = _socket.CMSG_SPACE(3 * 4)
    send("ready")
    while True:
        try:
            head, ancdata, _, _ = sock.recvmsg(4, space, MSG_CMSG_CLOEXEC)
            if len(head) < 4:
                head += recv_exact(sock, 4 - len(head))
            msg = marshal.loads(recv_exact(sock, int.from_bytes(head, "little")))
        except EOFError:
            return
        fds = []
        for level, kind, data in ancdata:
            if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
                fds += [int.from_bytes(data[i:i + 4], sys.byteorder) for i in range(0, len(data) - 3, 4)]
        if msg[0] == "run":
            _, exec_id, argv, env, cwd = msg
            if not fds:
                null = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)
                fds = [null, os.dup(null), os.dup(null)]
            # SIGCHLD waits until the shepherd is registered: a command that fails at once is reported too
            _signal.pthread_sigmask(_signal.SIG_BLOCK, [_signal.SIGCHLD])
            pid = os.fork()
            if pid == 0:
                try:
                    sock.close()
                    shepherd(libc, argv, env, cwd, fds)
                finally:
                    os._exit(126)
            shepherds[pid] = exec_id
            _signal.pthread_sigmask(_signal.SIG_UNBLOCK, [_signal.SIGCHLD])
            for fd in fds:
                os.close(fd)
        elif msg[0] == "kill":
            for pid, exec_id in list(shepherds.items()):
                if exec_id == msg[1]:
                    try:
                        os.kill(pid, _signal.SIGUSR1)
                    except OSError:
                        pass


if __name__ == "__main__":  # run with -c (its source) inside a sandbox; importing it runs nothing
    main()
