"""A real OTLP/HTTP receiver for tests: a local HTTP server that takes POSTed protobuf export requests and
keeps what ``decode`` makes of each body (spans, metric points, ...), in arrival order."""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class OtlpReceiver:
    """Serves on a free local port (``url``); ``items`` holds every record ``decode(body)`` returned."""

    def __init__(self, decode: Callable[[bytes], list[Any]]) -> None:
        self.items: list[Any] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                got = decode(self.rfile.read(int(self.headers["Content-Length"])))
                with receiver.lock:
                    receiver.items.extend(got)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
