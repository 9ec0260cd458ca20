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

Internal targets are refused whatever the allowlist says (:class:`EgressPolicy`):
loopback (127/8, ::1), "this host" (0/8, ::), link-local (169.254/16, fe80::/10,
cloud metadata included) and the bus's own addresses (every address its servers
resolve to; with a server on this host, this host's addresses at its port). A
create naming such an address or ``localhost`` is refused naming the entry; a
name that resolves to one is refused when the sandbox connects (the proxy
resolves once, checks every address, and connects to the checked one, so a
changing DNS answer cannot slip past). An operator opens a named internal
target with ``egress_open_internal`` in ``[services.sandbox]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ipaddress
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


IP = ipaddress.IPv4Address | ipaddress.IPv6Address
_THIS_HOST = ipaddress.ip_network("0.0.0.0/8")


def _ip(text: str) -> IP | None:
    try:
        ip = ipaddress.ip_address(text.split("%", 1)[0])  # a scoped fe80::1%eth0 is still link-local
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped  # ::ffff:127.0.0.1 is 127.0.0.1
    return ip


def internal_kind(ip: IP) -> str | None:
    """Why ``ip`` is never an egress target on its own ("loopback", "link-local", ...), None if it may be."""
    if ip.is_loopback:
        return "loopback"
    if ip.is_unspecified or (isinstance(ip, ipaddress.IPv4Address) and ip in _THIS_HOST):
        return "this-host (unspecified)"
    if ip.is_link_local:
        return "link-local"
    return None


def _is_local(ip: IP) -> bool:
    """Whether ``ip`` is an address of this host (of the service's network namespace): it can be bound."""
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((str(ip), 0))
        return True
    except OSError:
        return False


class EgressPolicy:
    """Targets refused whatever an allowlist says, and the operator's named exceptions (see the module doc)."""

    def __init__(self, open_internal: list[str]) -> None:
        self.opened = Allowlist(open_internal)
        self.bus_hosts: set[str] = set()
        self.bus_ips: set[IP] = set()
        #: ports of bus servers on this host: this host's every address at them is the bus
        self.local_bus_ports: set[int] = set()

    def protect_bus(self, endpoints: list[tuple[str, int]]) -> None:
        """Record the bus's servers (host, port) as targets no sandbox reaches (resolved now, blocking)."""
        for host, port in endpoints:
            host = _norm_host(host)
            self.bus_hosts.add(host)
            try:
                infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except OSError as e:
                log.warning("cannot resolve the bus server %s:%d (%s): only its name is refused", host, port, e)
                continue
            for info in infos:
                ip = _ip(str(info[4][0]))
                if ip is None:
                    continue
                self.bus_ips.add(ip)
                if internal_kind(ip) is not None or _is_local(ip):
                    self.local_bus_ports.add(port)

    def check_entries(self, entries: list[str]) -> None:
        """Refuse a create whose allowlist names an internal address (an IP literal, ``localhost``, the bus)."""
        allow = Allowlist(entries)
        for host, port in sorted(allow.exact):
            why = None
            if self.opened.allows(host, port):
                continue
            ip = _ip(host)
            if host == "localhost" or host.endswith(".localhost"):
                why = "names this host (localhost)"
            elif host in self.bus_hosts or (ip is not None and ip in self.bus_ips):
                why = "is an address of the bus (the run's NATS server)"
            elif ip is not None and (kind := internal_kind(ip)) is not None:
                why = f"is a {kind} address"
            elif ip is not None and port in self.local_bus_ports and _is_local(ip):
                why = "is this host's address at the bus's port"
            if why is not None:
                shown = f"[{host}]" if ":" in host else host
                raise InvalidRequest(
                    f"egress entry '{shown}:{port}' {why}: sandboxes may not reach loopback, link-local or bus "
                    "addresses whatever the allowlist says (an operator may open a named one with "
                    "egress_open_internal in [services.sandbox])")

    def refusal(self, host: str, port: int, ip: IP) -> str | None:
        """Why connecting to ``ip`` (what ``host`` resolved to) at ``port`` is refused; None when it is not."""
        if self.opened.allows(host, port):
            return None
        if (kind := internal_kind(ip)) is not None:
            return f"resolves to the {kind} address {ip}"
        if ip in self.bus_ips:
            return f"resolves to the bus's address {ip}"
        if port in self.local_bus_ports and _is_local(ip):
            return f"resolves to this host's address {ip} at the bus's port"
        return None


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

    def __init__(self, port: int, connect_timeout_s: float, policy: EgressPolicy | None = None) -> None:
        self.port = port
        self.connect_timeout_s = connect_timeout_s
        self.policy = policy or EgressPolicy([])
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

    async def _resolve(self, host: str, port: int) -> IP | str:
        """The address to connect to (resolved once), or why the target is refused: any internal address
        among the answers refuses it (the checked address is the one connected to)."""
        ip = _ip(host)
        if ip is None:
            infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
            ips = [a for a in (_ip(str(info[4][0])) for info in infos) if a is not None]
        else:
            ips = [ip]
        if not ips:
            raise OSError(f"no address for {host}")
        for a in ips:
            if (why := self.policy.refusal(host, port, a)) is not None:
                return why
        return ips[0]

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
            target = await asyncio.wait_for(self._resolve(host, port), self.connect_timeout_s)
        except (OSError, TimeoutError) as e:
            on_refused(host, port, f"cannot resolve: {e}")
            writer.write(f"HTTP/1.1 502 Bad Gateway\r\n\r\ncannot resolve {host}\n".encode())
            return
        if isinstance(target, str):
            on_refused(host, port, target)
            writer.write(f"HTTP/1.1 403 Forbidden\r\n\r\negress to {host}:{port} is not allowed: {target}\n".encode())
            return
        try:
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection(str(target), port), self.connect_timeout_s
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
