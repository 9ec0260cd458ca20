"""Byte layouts of weight versions: full anchors (safetensors) and sparse deltas.

Full layout: a safetensors file built in one preallocated buffer — 8-byte
little-endian header length, JSON header (space-padded to 8 bytes), then every
tensor's bytes back to back. Tensors are ordered by element size, largest
first, so every tensor starts aligned to its element size and can be viewed in
place (``torch.frombuffer``) without a copy. ``safetensors.torch.load`` opens
the same bytes.

Delta layout (``xor-sparse-zstd-v1``): per tensor in layout order, the XOR of
the old and new raw bits — sparse (gaps between the changed flat positions as
int32, then the XOR at those positions) when few elements changed, dense (the
whole XOR) otherwise. Arrays are byte-shuffled (all first bytes, then all
second bytes, ...) so zstd finds the runs of zero bytes; the concatenation is
one zstd frame. Comparison is on raw bits, so reconstruction is bit-identical
(NaN payloads and signed zeros included).
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import blake3
import torch
import zstandard

from proto.weights import ChunkRef, TensorEntry

FULL_ENCODING = "safetensors"
DELTA_ENCODING = "xor-sparse-zstd-v1"

_ST_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_TORCH_DTYPES = {v: k for k, v in _ST_DTYPES.items()}
# integer type of the same width, to compare and scatter raw bits
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MAX_DELTA_NUMEL = 2**31 - 1


class CodecError(ValueError):
    """A blob or state dict cannot be encoded or decoded (the message says which tensor and why)."""


def st_dtype(dtype: torch.dtype) -> str:
    """The safetensors dtype string of a torch dtype."""
    try:
        return _ST_DTYPES[dtype]
    except KeyError:
        raise CodecError(f"dtype {dtype} has no safetensors equivalent; cast the tensor first") from None


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype string."""
    try:
        return _TORCH_DTYPES[name]
    except KeyError:
        raise CodecError(f"unknown safetensors dtype {name!r}") from None


#: per-chunk and state digests a manifest may name (``WeightManifest.digest``). BLAKE3 is a
#: cryptographic hash several times faster than SHA-256 on one core, so verifying a pulled
#: version no longer costs as much CPU as copying it; SHA-256 is still read (older manifests).
Digest = Literal["blake3", "sha256"]
DIGESTS: tuple[str, ...] = ("blake3", "sha256")


def digest_hex(data: bytes | bytearray | memoryview, algo: Digest = "sha256") -> str:
    """Hex digest of ``data`` with ``algo`` (32 bytes either way)."""
    if algo == "blake3":
        return blake3.blake3(data).hexdigest()
    if algo == "sha256":
        return hashlib.sha256(data).hexdigest()
    raise CodecError(f"unknown digest {algo!r}; expected one of {DIGESTS}")


def root_digest(chunks: list[ChunkRef], algo: Digest = "sha256") -> str:
    """``algo`` over the concatenated (binary) chunk digests: the version's blob checksum."""
    return digest_hex(b"".join(bytes.fromhex(c.sha256) for c in chunks), algo)


@dataclass
class FullBlob:
    """A full layout: the safetensors bytes and where each tensor sits."""

    buf: bytearray
    tensors: list[TensorEntry]
    data_offset: int

    @property
    def data(self) -> memoryview:
        return memoryview(self.buf)[self.data_offset :]

    def state_digest(self, algo: Digest = "sha256") -> str:
        return digest_hex(self.data, algo)


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().reshape(-1).view(torch.uint8)


def split_aliases(state_dict: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Drop tensors that are the same view of the same memory as an earlier one (tied weights).

    Returns the remaining tensors and ``{alias: canonical name}`` to restore them.
    """
    seen: dict[tuple, str] = {}
    unique: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for name, t in state_dict.items():
        key = (t.device, t.dtype, t.data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        if t.numel() and key in seen:
            aliases[name] = seen[key]
        else:
            seen.setdefault(key, name)
            unique[name] = t
    return unique, aliases


def layout(state_dict: Mapping[str, torch.Tensor]) -> tuple[list[TensorEntry], int]:
    """Data-section layout: entries with offsets from the start of the data, and its size.

    Tensors are ordered by element size, largest first (stable), so each starts aligned.
    """
    if not state_dict:
        raise CodecError("cannot encode an empty state dict")
    names = sorted(state_dict, key=lambda n: -state_dict[n].element_size())
    entries: list[TensorEntry] = []
    pos = 0
    for name in names:
        t = state_dict[name]
        nbytes = t.numel() * t.element_size()
        entries.append(
            TensorEntry(name=name, dtype=st_dtype(t.dtype), shape=list(t.shape), offset=pos, nbytes=nbytes)
        )
        pos += nbytes
    return entries, pos


def encode_full(state_dict: Mapping[str, torch.Tensor], metadata: dict[str, str] | None = None) -> FullBlob:
    """Write ``state_dict`` into one safetensors buffer (one copy of each tensor's bytes)."""
    entries, data_nbytes = layout(state_dict)
    header: dict[str, object] = {
        e.name: {"dtype": e.dtype, "shape": e.shape, "data_offsets": [e.offset, e.offset + e.nbytes]}
        for e in entries
    }
    if metadata:
        header["__metadata__"] = dict(metadata)
    hjson = json.dumps(header, separators=(",", ":")).encode()
    hjson += b" " * (-(8 + len(hjson)) % 8)
    data_offset = 8 + len(hjson)
    buf = bytearray(data_offset + data_nbytes)
    buf[:8] = struct.pack("<Q", len(hjson))
    buf[8:data_offset] = hjson
    for e in entries:
        e.offset += data_offset
        if e.nbytes:
            dst = torch.frombuffer(buf, dtype=torch.uint8, count=e.nbytes, offset=e.offset)
            dst.copy_(flat_bytes(state_dict[e.name]))
    return FullBlob(buf=buf, tensors=entries, data_offset=data_offset)


def tensor_view(
    buf: bytearray | memoryview, e: TensorEntry, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """A tensor viewing entry ``e`` of a full layout in place (writable if ``buf`` is)."""
    dt = torch_dtype(e.dtype) if dtype is None else dtype
    size = torch.empty((), dtype=dt).element_size()
    count = e.nbytes // size
    if count == 0:
        return torch.empty(e.shape, dtype=dt)
    t = torch.frombuffer(buf, dtype=dt, count=count, offset=e.offset)
    return t if dtype is not None else t.view(e.shape)


def decode_full(buf: bytearray, tensors: list[TensorEntry]) -> dict[str, torch.Tensor]:
    """Tensors viewing a full layout in place (no copy; they keep ``buf`` alive)."""
    return {e.name: tensor_view(buf, e) for e in tensors}


def same_layout(a: list[TensorEntry], b: list[TensorEntry]) -> bool:
    """True when two layouts have the same tensors at the same offsets (a delta can bridge them)."""
    if len(a) != len(b):
        return False
    return all(
        x.name == y.name and x.dtype == y.dtype and x.shape == y.shape and x.offset == y.offset
        for x, y in zip(a, b, strict=True)
    )


def _shuffle(t: torch.Tensor) -> bytes:
    width = t.element_size()
    raw = t.contiguous().view(torch.uint8)
    if width == 1:
        return raw.numpy().tobytes()
    return raw.view(-1, width).t().contiguous().numpy().tobytes()


def _unshuffle(payload: bytearray, offset: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    width = torch.empty((), dtype=dtype).element_size()
    raw = torch.frombuffer(payload, dtype=torch.uint8, count=count * width, offset=offset)
    if width > 1:
        raw = raw.view(width, count).t().contiguous().view(-1)
    return raw.view(dtype)


def delta_encodable(tensors: list[TensorEntry]) -> bool:
    """Whether a layout's tensors are small enough for int32 positions."""
    return all(e.nbytes // max(1, _itemsize(e.dtype)) <= _MAX_DELTA_NUMEL for e in tensors)


def _itemsize(dtype: str) -> int:
    return torch.empty((), dtype=torch_dtype(dtype)).element_size()


def encode_delta(
    old: bytearray, new: bytearray, tensors: list[TensorEntry], level: int = 3, dense_above: float = 0.5
) -> tuple[bytes, list[TensorEntry]]:
    """Delta turning full layout ``old`` into ``new`` (same layout).

    Per tensor, ``x = old_bits ^ new_bits``. A tensor where at most
    ``dense_above`` of the elements changed is stored sparse: gaps between the
    changed positions (int32) and ``x`` at those positions; a denser one stores
    all of ``x`` (zstd squeezes its zero runs). Both arrays byte-shuffled;
    everything in one zstd frame. XOR keeps the shared sign/exponent bits of
    old and new values at zero, so values compress too, and applying the same
    delta twice undoes it. Returns the blob and the entries with ``nnz`` and
    ``dense`` filled in.
    """
    if len(old) != len(new):
        raise CodecError("delta between layouts of different sizes; publish a full version instead")
    parts: list[bytes] = []
    out: list[TensorEntry] = []
    for e in tensors:
        bits = _BITS[_itemsize(e.dtype)]
        nnz, dense = 0, False
        if e.nbytes:
            x = torch.bitwise_xor(tensor_view(old, e, bits), tensor_view(new, e, bits))
            idx = x.nonzero().view(-1)
            nnz = int(idx.numel())
            dense = nnz > dense_above * x.numel()
            if dense:
                parts.append(_shuffle(x))
            elif nnz:
                parts.append(_shuffle(torch.diff(idx, prepend=idx.new_zeros(1)).to(torch.int32)))
                parts.append(_shuffle(x[idx]))
        out.append(
            TensorEntry(
                name=e.name,
                dtype=e.dtype,
                shape=list(e.shape),
                offset=e.offset,
                nbytes=e.nbytes,
                nnz=nnz,
                dense=dense,
            )
        )
    payload = b"".join(parts)
    blob = zstandard.ZstdCompressor(level=level, threads=-1, write_content_size=True).compress(payload)
    return blob, out


@dataclass
class UndoLog:
    """What :func:`apply_delta` XORed in; XORing it again restores the base version."""

    entries: list[tuple[TensorEntry, torch.Tensor | None, torch.Tensor]]

    def undo(self, buf: bytearray) -> None:
        for e, idx, x in reversed(self.entries):
            _xor_into(tensor_view(buf, e, _BITS[_itemsize(e.dtype)]), idx, x)


def _xor_into(target: torch.Tensor, idx: torch.Tensor | None, x: torch.Tensor) -> None:
    if idx is None:
        target.bitwise_xor_(x)
    else:
        target[idx] = torch.bitwise_xor(target[idx], x)


def apply_delta(buf: bytearray, blob: bytes | bytearray | memoryview, tensors: list[TensorEntry]) -> UndoLog:
    """Apply a delta blob in place to full layout ``buf``; the returned log undoes it."""
    try:
        # a writable buffer: torch.frombuffer warns on read-only ones (deltas are small, the copy is cheap)
        payload = bytearray(zstandard.ZstdDecompressor().decompress(bytes(blob)))
    except zstandard.ZstdError as err:
        raise CodecError(f"delta blob is not a valid zstd frame: {err}") from err
    undo: list[tuple[TensorEntry, torch.Tensor | None, torch.Tensor]] = []
    pos = 0
    for e in tensors:
        if not e.nnz:
            continue
        width = _itemsize(e.dtype)
        bits = _BITS[width]
        target = tensor_view(buf, e, bits)
        if e.dense:
            need = target.numel() * width
        else:
            need = e.nnz * (4 + width)
        if pos + need > len(payload):
            raise CodecError(f"delta payload too short for tensor {e.name!r} ({e.nnz} changed elements)")
        if e.dense:
            idx = None
            x = _unshuffle(payload, pos, target.numel(), bits)
            pos += need
        else:
            idx = torch.cumsum(_unshuffle(payload, pos, e.nnz, torch.int32).to(torch.int64), 0)
            pos += 4 * e.nnz
            x = _unshuffle(payload, pos, e.nnz, bits)
            pos += width * e.nnz
            if int(idx[-1]) >= target.numel() or int(idx[0]) < 0:
                raise CodecError(f"delta position {int(idx[-1])} out of range for tensor {e.name!r}")
        _xor_into(target, idx, x)
        undo.append((e, idx, x))
    if pos != len(payload):
        raise CodecError(
            f"delta payload has {len(payload) - pos} trailing bytes; it does not match the manifest"
        )
    return UndoLog(undo)


def split(nbytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """(offset, size) of each chunk of a blob of ``nbytes``."""
    if chunk_bytes <= 0:
        raise CodecError("chunk_bytes must be positive")
    return [(o, min(chunk_bytes, nbytes - o)) for o in range(0, nbytes, chunk_bytes)] or [(0, 0)]
