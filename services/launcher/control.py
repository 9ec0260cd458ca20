"""The control socket of a running ``rlbus up`` / ``rlbus run``: ``rlbus scale`` talks to it.

A Unix socket at ``<run dir>/launcher.sock`` (mode 0600: the user who started the run) takes one JSON
request per connection and answers one JSON line. Requests: ``{"scale": {"rollout": 3}}`` (set the
instance count of services of the layout; the answer is the layout after it, or the error, which names the
service and why). Local only on purpose: on a cluster, the orchestrator scales (KEDA, ``kubectl scale``,
``docker compose --scale``), since workers are queue-group members that may come and go at any time.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import socketserver
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger("rlbus.launcher")

SOCKET_NAME = "launcher.sock"


class ControlError(RuntimeError):
    """The launcher refused a request, or no launcher answers (the message says which)."""


def socket_path(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir).resolve() / SOCKET_NAME


class ControlServer:
    """Serves requests on ``<run dir>/launcher.sock`` from a thread of its own; ``scale(name, count)``
    applies one change (and raises ControlError or ConfigError with the reason)."""

    def __init__(self, run_dir: Path, scale: Callable[[str, int], dict[str, int]]) -> None:
        self.path = socket_path(run_dir)
        if len(str(self.path)) > 100:
            raise ControlError(f"control socket path {self.path} is too long for a Unix socket; use a shorter "
                               "run directory")
        self._scale = scale
        outer = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                try:
                    request = json.loads(self.rfile.readline(65536) or b"{}")
                    reply = outer.answer(request)
                except (ValueError, TypeError) as e:
                    reply = {"error": f"bad request: {e}"}
                self.wfile.write(json.dumps(reply).encode() + b"\n")

        self.path.unlink(missing_ok=True)
        self._server = socketserver.UnixStreamServer(str(self.path), Handler)
        os.chmod(self.path, 0o600)
        self._thread = threading.Thread(target=self._server.serve_forever, name="launcher-control", daemon=True)

    def start(self) -> ControlServer:
        self._thread.start()
        return self

    def answer(self, request: dict[str, Any]) -> dict[str, Any]:
        from services.runtime.config import ConfigError

        scale = request.get("scale")
        if not isinstance(scale, dict) or not scale:
            return {"error": 'expected {"scale": {"<service>": <count>, ...}}'}
        layout: dict[str, int] = {}
        try:
            for name, count in scale.items():
                if not isinstance(count, int) or isinstance(count, bool):
                    raise ControlError(f"{name}={count!r}: the count must be an integer")
                layout = self._scale(str(name), count)
        except (ControlError, ConfigError) as e:
            return {"error": str(e)}
        return {"services": layout}

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self.path.unlink(missing_ok=True)


def request(run_dir: str | os.PathLike[str], payload: dict[str, Any], timeout: float = 30.0) -> dict[str, Any]:
    """Send one request to the launcher of ``run_dir`` and return its answer."""
    path = socket_path(run_dir)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        try:
            s.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError):
            raise ControlError(f"no rlbus up / rlbus run is running for run directory {Path(run_dir).resolve()} "
                               f"({path} does not answer)") from None
        s.sendall(json.dumps(payload).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    return json.loads(data or b"{}")
