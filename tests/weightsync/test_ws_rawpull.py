"""The in-place NATS protocol reader, fed the wire bytes in awkward pieces (no server needed)."""

from __future__ import annotations

import os

import pytest

from services.lib.weights.rawpull import RawPullError, _Protocol


def _wire(payloads: list[bytes]) -> bytes:
    parts = [b'INFO {"server_id":"x"}\r\n', b"PING\r\n", b"+OK\r\n"]
    for i, p in enumerate(payloads):
        if i % 2:
            hdr = b"NATS/1.0\r\nX: y\r\n\r\n"
            parts.append(
                b"HMSG $O.b.C.n 1 $JS.ACK.x %d %d\r\n" % (len(hdr), len(hdr) + len(p)) + hdr + p + b"\r\n"
            )
        else:
            parts.append(b"MSG $O.b.C.n 1 $JS.ACK.x %d\r\n" % len(p) + p + b"\r\n")
    # a status message (headers only) ends the pull
    status = b"NATS/1.0 404 No Messages\r\n\r\n"
    parts.append(b"HMSG _INBOX.x 1 %d %d\r\n" % (len(status), len(status)) + status)
    return b"".join(parts)


@pytest.mark.parametrize("piece", [1, 7, 4096, 1 << 20])
async def test_payloads_land_in_place_whatever_the_read_sizes(piece):
    payloads = [os.urandom(n) for n in (1000, 70_000, 3, 300_000, 5)]
    wire = _wire(payloads)
    proto = _Protocol()
    out = bytearray(sum(map(len, payloads)))
    proto.dest = memoryview(out)
    pos = 0
    while pos < len(wire):
        buf = proto.get_buffer(-1)
        n = min(len(buf), piece, len(wire) - pos)
        buf[:n] = wire[pos : pos + n]
        proto.buffer_updated(n)
        pos += n
    assert proto.error is None
    assert proto.messages == len(payloads)
    assert bytes(out) == b"".join(payloads)
    assert proto.info.result() == {"server_id": "x"}


async def test_server_error_is_reported():
    proto = _Protocol()
    data = b"-ERR 'Authorization Violation'\r\n"
    buf = proto.get_buffer(-1)
    buf[: len(data)] = data
    proto.buffer_updated(len(data))
    assert isinstance(proto.error, RawPullError) and "Authorization" in str(proto.error)
