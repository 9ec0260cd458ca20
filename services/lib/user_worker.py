"""A user-code worker: one process that runs module-level functions for a service (the judge's reward
functions, the rollout's sync function tools), so that code which hangs, crashes the interpreter or eats
memory never touches the service's event loop.

Started by :class:`services.lib.user_code.WorkerPool` as ``python -m services.lib.user_worker``; it speaks
length-prefixed pickle frames on private copies of its stdin/stdout (the real fd 1 is pointed at stderr
first, so a ``print`` in user code lands in the service's log instead of corrupting the protocol).

Frames (service → worker): ``("init", sys_path, memory_mb)`` once, then ``("import", module)`` before the
first call into a module (so a slow import is not charged to a call's timeout) and ``("call", module,
qualname, args, kwargs)``; worker → service: ``("ready",)`` after init, then ``("ok", value)`` or
``("error", "ExcType: message", traceback_tail)`` per frame, or ``("internal", why)`` when a frame does not
decode (the runner's fault: the service does not blame the user's code for it). Frames of any size are read
whole (a pipe hands over at most 64 KiB per read). The function called is ``module`` imported, then
``qualname`` looked up attribute by attribute (``Class.method`` too); what it returns goes back pickled (a
value that does not pickle is the user code's error). A call that never returns is ended by the service
killing this process.
"""

from __future__ import annotations

import importlib
import os
import pickle
import resource
import struct
import sys
import traceback
from typing import Any, BinaryIO

HEADER = struct.Struct("!I")


class FrameError(Exception):
    """A frame arrived whole but does not decode (the runner's fault, not the user code's)."""


def read_exactly(stream: BinaryIO, size: int) -> bytes:
    """``size`` bytes from ``stream``: an unbuffered pipe returns what it holds (64 KiB at a time on Linux),
    so one ``read(size)`` of a large frame is short; read until the frame is whole or the pipe closes."""
    parts, got = [], 0
    while got < size:
        chunk = stream.read(size - got)
        if not chunk:
            raise EOFError(f"the service closed the pipe ({got} of {size} bytes of a frame read)")
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def read_frame(stream: BinaryIO) -> Any:
    (size,) = HEADER.unpack(read_exactly(stream, HEADER.size))
    data = read_exactly(stream, size)
    try:
        return pickle.loads(data)
    except Exception as e:  # the frame was read whole, so the pipe is still in step: say so and go on
        raise FrameError(f"a {size}-byte frame from the service does not unpickle: {type(e).__name__}: {e}") from e


def write_all(stream: BinaryIO, data: bytes) -> None:
    """All of ``data`` (a raw stream's ``write`` may take only part of it), then flush."""
    view = memoryview(data)
    while view:
        n = stream.write(view)
        view = view[n if n is not None else len(view):]
    stream.flush()


def write_frame(stream: BinaryIO, value: Any) -> None:
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    write_all(stream, HEADER.pack(len(data)) + data)


def resolve(module: str, qualname: str) -> Any:
    """The object ``qualname`` names in ``module`` (imported first)."""
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _private_pipes() -> tuple[BinaryIO, BinaryIO]:
    """Keep stdin/stdout for the protocol; user code sees /dev/null as stdin and stderr as stdout."""
    inp = os.fdopen(os.dup(0), "rb", buffering=0)
    out = os.fdopen(os.dup(1), "wb")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    return inp, out  # type: ignore[return-value]


def _run(frame: tuple[Any, ...]) -> Any:
    kind, module, *rest = frame
    if kind == "import":
        importlib.import_module(module)
        return None
    qualname, args, kwargs = rest
    return resolve(module, qualname)(*args, **kwargs)


def main() -> int:
    inp, out = _private_pipes()
    kind, sys_path, memory_mb = read_frame(inp)
    if kind != "init":
        raise RuntimeError(f"the first frame must be init, got {kind!r}")
    sys.path[:] = list(sys_path)
    if memory_mb:
        limit = int(memory_mb) * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    write_frame(out, ("ready",))
    while True:
        try:
            frame = read_frame(inp)
        except EOFError:
            return 0
        except FrameError as e:
            write_frame(out, ("internal", str(e)))
            continue
        try:
            value = _run(frame)
            data = pickle.dumps(("ok", value), protocol=pickle.HIGHEST_PROTOCOL)  # unpicklable: user's error
        except Exception as e:  # user code (MemoryError included): reported to the service, never fatal here
            tb = traceback.format_exc().strip().splitlines()[-6:]
            data = pickle.dumps(("error", f"{type(e).__name__}: {e}", "\n".join(tb)))
        write_all(out, HEADER.pack(len(data)) + data)


if __name__ == "__main__":
    sys.exit(main())
