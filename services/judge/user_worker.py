"""A user-code worker: one process that runs task methods (reward functions, hidden-test builders) for the
judge, so that code which hangs, crashes the interpreter or eats memory never touches the judge's event loop.

Started by :class:`services.judge.user_code.ProcessUserCode` as ``python -m services.judge.user_worker``; it
speaks length-prefixed pickle frames on private copies of its stdin/stdout (the real fd 1 is pointed at
stderr first, so a ``print`` in user code lands in the judge's log instead of corrupting the protocol).

Frames (judge → worker): ``("init", sys_path, memory_mb)`` once, then ``("call", task_key, module, name,
options, method, args)``; worker → judge: ``("ready",)`` after init, then ``("ok", value)`` or
``("error", "ExcType: message", traceback_tail)`` per call, or ``("internal", why)`` when a call's frame
does not decode (the runner's fault: the judge does not blame the user's code for it). Frames of any size
are read whole (a pipe hands over at most 64 KiB per read). The worker builds each task once (importing the
module that defines it first, so tasks registered by a decorator in a plugin module are found) and keeps it.
A call that never returns is ended by the judge killing this process.
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
            raise EOFError(f"the judge closed the pipe ({got} of {size} bytes of a frame read)")
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def read_frame(stream: BinaryIO) -> Any:
    (size,) = HEADER.unpack(read_exactly(stream, HEADER.size))
    data = read_exactly(stream, size)
    try:
        return pickle.loads(data)
    except Exception as e:  # the frame was read whole, so the pipe is still in step: say so and go on
        raise FrameError(f"a {size}-byte frame from the judge does not unpickle: {type(e).__name__}: {e}") from e


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


def _private_pipes() -> tuple[BinaryIO, BinaryIO]:
    """Keep stdin/stdout for the protocol; user code sees /dev/null as stdin and stderr as stdout."""
    inp = os.fdopen(os.dup(0), "rb", buffering=0)
    out = os.fdopen(os.dup(1), "wb")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    return inp, out  # type: ignore[return-value]


def _task(tasks: dict[str, Any], key: str, module: str, name: str, options: dict[str, Any]) -> Any:
    if key not in tasks:
        from services.tasks import get_task

        if module and module != "__main__":
            importlib.import_module(module)  # registers a decorated task the entry points do not name
        tasks[key] = get_task(name, **options)
    return tasks[key]


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
    tasks: dict[str, Any] = {}
    while True:
        try:
            frame = read_frame(inp)
        except EOFError:
            return 0
        except FrameError as e:
            write_frame(out, ("internal", str(e)))
            continue
        _, key, module, name, options, method, args = frame
        try:
            value = getattr(_task(tasks, key, module, name, options), method)(*args)
            data = pickle.dumps(("ok", value), protocol=pickle.HIGHEST_PROTOCOL)  # unpicklable: user's error
        except Exception as e:  # user code (MemoryError included): reported to the judge, never fatal here
            tb = traceback.format_exc().strip().splitlines()[-6:]
            data = pickle.dumps(("error", f"{type(e).__name__}: {e}", "\n".join(tb)))
        write_all(out, HEADER.pack(len(data)) + data)


if __name__ == "__main__":
    sys.exit(main())
