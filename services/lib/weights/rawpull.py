"""A bulk reader that streams a pull consumer's messages straight into a caller's buffer.

nats-py parses every message by slicing and copying a growing ``bytearray``
(~200 MB/s here), which caps weight downloads far below what a loopback socket
carries. This module opens one extra plain TCP connection speaking the NATS
client protocol (same server, same credentials as the caller's connection),
subscribes an inbox, issues pull requests for a consumer and receives each
message payload *in place*: an :class:`asyncio.BufferedProtocol` hands the
socket the destination slice of the output buffer, so payload bytes are
written once, by the kernel. Control lines, headers and status messages go
through a small scratch buffer.

Only plain-text connections with no auth, user/password or token auth are
supported; :func:`open_raw_reader` returns None otherwise (TLS, nkeys, JWT)
and the caller falls back to nats-py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets

from nats.aio.client import Client as NATS

log = logging.getLogger("rlbus.weightsync.rawpull")

_CRLF = b"\r\n"
_SCRATCH = 256 * 1024
_CONNECT_TIMEOUT_S = 10.0


class RawPullError(RuntimeError):
    """The raw reader's connection failed or the server sent an error."""


class _Protocol(asyncio.BufferedProtocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.scratch = bytearray(_SCRATCH)
        self.r = 0  # scratch[r:n] holds received, unparsed bytes
        self.n = 0
        self.info: asyncio.Future[dict] = asyncio.get_running_loop().create_future()
        self.pong: asyncio.Future[None] | None = None
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.error: Exception | None = None
        # message state
        self.dest: memoryview | None = None
        self.pos = 0
        self.pending_header = 0  # header bytes still to discard (in scratch)
        self.pending_payload = 0  # payload bytes still to write at dest[pos:]
        self.pending_crlf = 0
        self.payload_is_status = False
        self.messages = 0
        self.on_message: asyncio.Event = asyncio.Event()

    # -- asyncio callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.error = self.error or exc or RawPullError("connection closed by the server")
        for fut in (self.info, self.pong):
            if fut is not None and not fut.done():
                fut.set_exception(self.error)
        if not self.closed.done():
            self.closed.set_result(None)
        self.on_message.set()

    def _direct(self) -> bool:
        """Whether the next bytes are payload that can go straight to the destination."""
        return (
            self.pending_header == 0
            and self.pending_payload > 0
            and self.dest is not None
            and self.r == self.n
        )

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._direct():
            return self.dest[self.pos : self.pos + self.pending_payload]  # type: ignore[index]
        if self.r == self.n:
            self.r = self.n = 0
        elif self.n == len(self.scratch):
            if self.r:  # compact
                self.scratch[: self.n - self.r] = self.scratch[self.r : self.n]
                self.n -= self.r
                self.r = 0
            else:  # a very long control line: grow
                self.scratch.extend(bytes(len(self.scratch)))
        return memoryview(self.scratch)[self.n :]

    def buffer_updated(self, nbytes: int) -> None:
        if self._direct():
            self.pos += nbytes
            self.pending_payload -= nbytes
            if self.pending_payload == 0:
                self._message_done()
            return
        self.n += nbytes
        try:
            self._parse()
        except (RawPullError, ValueError) as err:  # ValueError: an INFO line that is not JSON
            self.error = err if isinstance(err, RawPullError) else RawPullError(f"bad server line: {err}")
            self.on_message.set()
            if self.transport is not None:
                self.transport.close()

    # -- parsing
    def _consume(self, k: int) -> None:
        self.r += k

    def _message_done(self) -> None:
        self.pending_crlf = 2
        self.messages += 0 if self.payload_is_status else 1
        self.on_message.set()

    def _parse(self) -> None:
        while self.n > self.r:
            avail = self.n - self.r
            if self.pending_header:
                k = min(self.pending_header, avail)
                self._consume(k)
                self.pending_header -= k
                if self.pending_header == 0 and self.pending_payload == 0:
                    self._message_done()
                continue
            if self.pending_payload:
                if self.dest is None:
                    raise RawPullError("message payload arrived with no destination buffer")
                k = min(self.pending_payload, avail)
                self.dest[self.pos : self.pos + k] = self.scratch[self.r : self.r + k]
                self.pos += k
                self.pending_payload -= k
                self._consume(k)
                if self.pending_payload == 0:
                    self._message_done()
                continue
            if self.pending_crlf:
                k = min(self.pending_crlf, avail)
                self._consume(k)
                self.pending_crlf -= k
                continue
            end = self.scratch.find(_CRLF, self.r, self.n)
            if end < 0:
                return
            line = bytes(self.scratch[self.r : end])
            self._consume(end + 2 - self.r)
            self._control(line)

    def _control(self, line: bytes) -> None:
        if line.startswith((b"MSG ", b"HMSG ")):
            # MSG <subject> <sid> [reply] <size> | HMSG <subject> <sid> [reply] <header size> <total size>
            tokens = line.split()
            try:
                if tokens[0] == b"HMSG" and len(tokens) in (5, 6):
                    header, total = int(tokens[-2]), int(tokens[-1])
                elif tokens[0] == b"MSG" and len(tokens) in (4, 5):
                    header, total = 0, int(tokens[-1])
                else:
                    raise ValueError("wrong number of fields")
            except ValueError as err:
                raise RawPullError(f"malformed message line {line[:200]!r}: {err}") from None
            payload = total - header
            self.payload_is_status = payload == 0  # JetStream status (404/408/409/100) carry headers only
            if payload and self.dest is not None and self.pos + payload > len(self.dest):
                raise RawPullError("the consumer delivered more bytes than the object holds")
            self.pending_header, self.pending_payload = header, payload
            if header == 0 and payload == 0:
                self._message_done()
        elif line == b"PING":
            if self.transport is not None:
                self.transport.write(b"PONG\r\n")
        elif line == b"PONG":
            if self.pong is not None and not self.pong.done():
                self.pong.set_result(None)
        elif line.startswith(b"INFO"):
            if not self.info.done():
                self.info.set_result(json.loads(line[4:].strip() or b"{}"))
        elif line.startswith(b"-ERR"):
            raise RawPullError(f"server error: {line[5:].decode(errors='replace')}")
        # +OK and anything else: ignore


class RawPullReader:
    """One extra connection to the caller's NATS server for bulk consumer reads (one read at a time)."""

    def __init__(self, transport: asyncio.Transport, proto: _Protocol, prefix: str) -> None:
        self.transport = transport
        self.proto = proto
        self.prefix = prefix  # JetStream API prefix
        self.inbox = f"_INBOX.rlbus.{secrets.token_hex(8)}"
        self.lock = asyncio.Lock()
        self.clean = True  # False while a read is unfinished or after one was abandoned
        transport.write(f"SUB {self.inbox} 1\r\n".encode())

    async def ping(self) -> None:
        self.proto.pong = asyncio.get_running_loop().create_future()
        self.transport.write(b"PING\r\n")
        await asyncio.wait_for(self.proto.pong, _CONNECT_TIMEOUT_S)

    async def read(
        self, stream: str, consumer: str, nmsgs: int, out: memoryview, batch: int, timeout: float
    ) -> int:
        """Pull ``nmsgs`` messages of ``consumer`` into ``out`` in order; returns bytes written."""
        async with self.lock:
            p = self.proto
            if not self.clean:
                raise RawPullError("this reader abandoned a read earlier; open a new one")
            self.clean = False
            p.dest, p.pos, p.messages = out, 0, 0
            subj = f"{self.prefix}.CONSUMER.MSG.NEXT.{stream}.{consumer}"
            requested = 0
            expires = int(timeout * 1e9)

            def request(k: int) -> None:
                body = json.dumps({"batch": k, "expires": expires}).encode()
                self.transport.write(f"PUB {subj} {self.inbox} {len(body)}\r\n".encode() + body + _CRLF)

            # keep about two batches requested ahead of what arrived
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            try:
                while p.messages < nmsgs:
                    while requested < nmsgs and requested - p.messages < 2 * batch:
                        k = min(batch, nmsgs - requested)
                        request(k)
                        requested += k
                    p.on_message.clear()
                    if p.error is not None:
                        raise RawPullError(f"raw pull of {stream}/{consumer} failed: {p.error}")
                    if p.messages >= nmsgs:
                        break
                    left = deadline - loop.time()
                    if left <= 0:
                        raise RawPullError(
                            f"raw pull of {stream}/{consumer} timed out: {p.messages}/{nmsgs} messages"
                        )
                    await asyncio.wait_for(p.on_message.wait(), left)
            except TimeoutError:
                raise RawPullError(
                    f"raw pull of {stream}/{consumer} timed out: {p.messages}/{nmsgs} messages"
                ) from None
            finally:
                written = p.pos
                p.dest = None
            if p.error is not None:
                raise RawPullError(f"raw pull of {stream}/{consumer} failed: {p.error}")
            self.clean = True
            return written

    def usable(self) -> bool:
        """Whether the connection is still open and healthy."""
        return self.clean and not self.transport.is_closing() and self.proto.error is None

    def close(self) -> None:
        self.transport.close()


def _connect_options(nc: NATS, info: dict) -> dict | None:
    """CONNECT options with the caller's credentials, or None when they cannot be replayed here."""
    opts = nc.options
    out: dict = {
        "verbose": False,
        "pedantic": False,
        "lang": "python3",
        "version": "rlbus-rawpull",
        "protocol": 1,
        "headers": True,
        "no_responders": True,
        "name": "rlbus-weightsync-rawpull",
    }
    if (
        opts.get("user_credentials")
        or opts.get("nkeys_seed")
        or opts.get("nkeys_seed_str")
        or "nonce" in info
    ):
        return None
    if opts.get("user") is not None and opts.get("password") is not None:
        if callable(opts["user"]) or callable(opts["password"]):
            return None
        out["user"], out["pass"] = opts["user"], opts["password"]
    elif opts.get("token") is not None:
        if callable(opts["token"]):
            return None
        out["auth_token"] = opts["token"]
    else:
        uri = nc._current_server.uri if nc._current_server else None
        if uri is not None and uri.username is not None:
            if uri.password is None:
                out["auth_token"] = uri.username
            else:
                out["user"], out["pass"] = uri.username, uri.password
    return out


async def open_raw_reader(nc: NATS) -> RawPullReader | None:
    """A raw reader on the server ``nc`` is connected to, or None when this connection cannot be replayed."""
    server = nc._current_server
    if server is None or nc.options.get("tls") or server.uri.scheme in ("tls", "wss", "ws"):
        return None
    loop = asyncio.get_running_loop()
    host, port = server.uri.hostname, server.uri.port or 4222
    transport, proto = await asyncio.wait_for(
        loop.create_connection(_Protocol, host, port), _CONNECT_TIMEOUT_S
    )
    try:
        info = await asyncio.wait_for(proto.info, _CONNECT_TIMEOUT_S)
        connect = _connect_options(nc, info)
        if connect is None or info.get("tls_required"):
            transport.close()
            return None
        transport.write(b"CONNECT " + json.dumps(connect).encode() + _CRLF)
        prefix = nc.jetstream()._prefix if hasattr(nc.jetstream(), "_prefix") else "$JS.API"
        reader = RawPullReader(transport, proto, prefix)
        await reader.ping()
        if proto.error is not None:
            raise RawPullError(str(proto.error))
        return reader
    except (Exception, asyncio.CancelledError):
        transport.close()
        raise
