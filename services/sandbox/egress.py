"""Egress control: an allowlisting HTTP proxy that runs in the service, outside every sandbox.

Sandboxes have their own network namespace with only a loopback interface, so
they reach nothing. For a sandbox with an allowlist, each exec gets a proxy
listener on ``127.0.0.1:<egress_port>`` *inside the sandbox's network
namespace*: the service opens the socket from a helper thread that has joined
that namespace (``setns``), then serves it from its own event loop. No helper
process or binary is needed inside the sandbox; the exec's environment carries
``HTTP_PROXY``/``HTTPS_PROXY`` pointing at it.

The proxy speaks ``CONNECT host:port`` (HTTPS and any TCP) and absolute-URI
plain HTTP (``GET http://host:port/path``). A target not on the allowlist gets
``403`` and is reported through ``on_refused`` (an ``egress_refused`` event).
Allowlist entries are ``host:port``; ``*.example.com:443`` matches subdomains.
Names are matched as the client sent them, before resolution.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import socket
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

from services.sandbox.backend import InvalidRequest, SandboxFailure

log = logging.getLogger("rlbus.sandbox.egress")

_libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNET = 0x40000000
IP_FREEBIND = 15
MAX_HEAD_BYTES = 64 << 10
HEAD_TIMEOUT_S = 30.0

RefusedSink = Callable[[str, int, str], None]


def _norm_host(host: str) -> str:
    host = host.strip().lower().rstrip(".")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host


def _split_hostport(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{text!r} is not host:port")
    return _norm_host(host), int(port)


class Allowlist:
    """Parsed ``host:port`` entries."""

    def __init__(self, entries: list[str]) -> None:
        self.exact: set[tuple[str, int]] = set()
        self.suffixes: set[tuple[str, int]] = set()
        for entry in entries:
            try:
                host, port = _split_hostport(entry)
            except ValueError:
                raise InvalidRequest(
                    f"egress entry {entry!r} is not host:port (e.g. pypi.org:443, *.github.com:443, 10.0.0.5:8080)"
                ) from None
            if host.startswith("*."):
                self.suffixes.add((host[1:], port))
            else:
                self.exact.add((host, port))

    def __bool__(self) -> bool:
        return bool(self.exact or self.suffixes)

    def allows(self, host: str, port: int) -> bool:
        host = _norm_host(host)
        if (host, port) in self.exact:
            return True
        return any(host.endswith(suffix) and p == port for suffix, p in self.suffixes)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while chunk := await reader.read(1 << 16):
            writer.write(chunk)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        pass


class EgressProxy:
    """Makes per-exec proxy listeners inside sandbox network namespaces and serves them."""

    def __init__(self, port: int, connect_timeout_s: float) -> None:
        self.port = port
        self.connect_timeout_s = connect_timeout_s
        # setns() changes the calling thread's namespace: only this dedicated thread ever does it
        self._netns_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sandbox-netns")

    def close(self) -> None:
        self._netns_thread.shutdown(wait=False)

    def env(self) -> dict[str, str]:
        url = f"http://127.0.0.1:{self.port}"
        return {"HTTP_PROXY": url, "HTTPS_PROXY": url, "http_proxy": url, "https_proxy": url}

    def _listen_in_netns(self, pid: int) -> socket.socket:
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        target = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            if _libc.setns(target, CLONE_NEWNET) != 0:
                raise SandboxFailure(f"setns into the network namespace of pid {pid}: {os.strerror(ctypes.get_errno())}")
            try:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                # the sandbox may not have brought its loopback up yet: bind regardless
                sock.setsockopt(socket.SOL_IP, IP_FREEBIND, 1)
                sock.bind(("127.0.0.1", self.port))
                sock.listen(64)
                sock.setblocking(False)
            finally:
                if _libc.setns(own, CLONE_NEWNET) != 0:  # pragma: no cover - would leave the thread stranded
                    log.critical("cannot return the netns thread to the service's namespace; exiting it")
                    raise SystemExit(1)
        finally:
            os.close(own)
            os.close(target)
        return sock

    async def listen(self, pid: int, allowlist: Allowlist, on_refused: RefusedSink) -> asyncio.Server:
        """Serve the proxy inside the network namespace of ``pid`` until the returned server is closed."""
        loop = asyncio.get_running_loop()
        sock = await loop.run_in_executor(self._netns_thread, self._listen_in_netns, pid)

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                await self._serve(reader, writer, allowlist, on_refused)
            finally:
                writer.close()
                with contextlib.suppress(ConnectionError, OSError):
                    await writer.wait_closed()

        return await asyncio.start_server(handle, sock=sock)

    async def _serve(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, allowlist: Allowlist, on_refused: RefusedSink
    ) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT_S)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
            return
        if len(head) > MAX_HEAD_BYTES:
            writer.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\n\r\n")
            return
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3:
            writer.write(b"HTTP/1.1 400 Bad Request\r\n\r\n")
            return
        method, target, version = parts
        try:
            if method.upper() == "CONNECT":
                host, port = _split_hostport(target)
                path = None
            else:
                url = urlsplit(target)
                if url.scheme != "http" or not url.hostname:
                    raise ValueError("plain requests need an absolute http:// URL (use CONNECT for https)")
                host, port = _norm_host(url.hostname), url.port or 80
                path = (url.path or "/") + (f"?{url.query}" if url.query else "")
        except ValueError as e:
            writer.write(f"HTTP/1.1 400 Bad Request\r\n\r\n{e}\n".encode())
            return
        if not allowlist.allows(host, port):
            on_refused(host, port, "not on the allowlist")
            writer.write(f"HTTP/1.1 403 Forbidden\r\n\r\negress to {host}:{port} is not allowed\n".encode())
            return
        try:
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection(host, port), self.connect_timeout_s
            )
        except (OSError, TimeoutError) as e:
            on_refused(host, port, f"connect failed: {e}")
            writer.write(f"HTTP/1.1 502 Bad Gateway\r\n\r\ncannot reach {host}:{port}\n".encode())
            return
        try:
            if path is None:
                writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            else:
                keep = [
                    h for h in lines[1:]
                    if h and h.split(":", 1)[0].strip().lower()
                    not in ("proxy-connection", "proxy-authorization", "connection", "keep-alive")
                ]
                request = "\r\n".join([f"{method} {path} {version}", *keep, "Connection: close", "", ""])
                up_writer.write(request.encode("latin-1"))
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            up_writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await up_writer.wait_closed()
