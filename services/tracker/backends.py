"""Tracker backends (TensorBoard, Weights & Biases, trackio) and the worker that keeps them harmless.

A backend is a small class with ``open()``, ``scalars(step, values, wall_time)``,
``table(table)`` and ``close()``, chosen by the config's ``type``; it imports its package in
``open()``, so only the trackers a run uses need to be installed.

Telemetry never hurts the run. Each backend runs in a :class:`BackendWorker`: a daemon thread of
its own fed by a bounded queue. ``submit`` never blocks: when the queue is full (the backend is
slow or hung) the record is dropped. A backend whose ``open()`` fails, or whose write raises,
drops those records too. Every drop is counted and reported by a warning at most once per
``warn_every_s`` (with the count since the last one). ``close(timeout)`` gives the backend that
long to write what is queued and close; a backend still busy after that is abandoned (its thread
is a daemon), and what it had not written is counted as dropped.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any, Protocol

from services.tracker.config import Backend, TensorBoardBackend, TrackioBackend, WandbBackend
from services.tracker.table import Table

log = logging.getLogger("rlbus.tracker.backends")


class Writer(Protocol):
    name: str

    def open(self) -> None: ...

    def scalars(self, step: int, values: dict[str, float], wall_time: float) -> None: ...

    def table(self, table: Table) -> None: ...

    def close(self) -> None: ...


def markdown_table(table: Table) -> str:
    """A table as GitHub Markdown (TensorBoard's text plugin renders it); cells on one line each."""

    def cell(v: object) -> str:
        text = f"{v:.4g}" if isinstance(v, float) else str(v)
        return text.replace("\\", "\\\\").replace("|", "\\|").replace("\r", " ").replace("\n", "⏎")

    lines = ["| " + " | ".join(table.columns) + " |", "|" + "---|" * len(table.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in table.rows]
    return "\n".join(lines)


class TensorBoardWriter:
    """Event files in ``logdir``: one scalar per value (float32, as TensorBoard stores them), the
    completions table as the text summary ``completions`` of its step."""

    def __init__(self, cfg: TensorBoardBackend, run_dir: Path, run_id: str) -> None:
        self.name = "tensorboard"
        self.logdir = Path(cfg.dir) if Path(cfg.dir).is_absolute() else run_dir / cfg.dir
        self._w: Any = None

    def open(self) -> None:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.logdir.mkdir(parents=True, exist_ok=True)
        self._w = EventFileWriter(str(self.logdir), max_queue_size=100, flush_secs=5)

    def scalars(self, step: int, values: dict[str, float], wall_time: float) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        summary = Summary(value=[Summary.Value(tag=k, simple_value=v) for k, v in values.items()])
        self._w.add_event(Event(wall_time=wall_time, step=step, summary=summary))

    def table(self, table: Table) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.plugins.text.summary_v2 import text_pb

        self._w.add_event(Event(wall_time=time.time(), step=table.step,
                                summary=text_pb("completions", markdown_table(table))))

    def close(self) -> None:
        if self._w is not None:
            self._w.close()


class WandbWriter:
    """A W&B run named after the rlbus run (offline by default: a directory ``wandb sync`` uploads).

    W&B wants steps that never go back: values of an older step (an evaluation that finished late)
    are logged at the newest step seen; the completions table carries its own ``step`` column."""

    def __init__(self, cfg: WandbBackend, run_dir: Path, run_id: str) -> None:
        self.name = "wandb"
        self.cfg = cfg
        self.dir = Path(cfg.dir) if Path(cfg.dir).is_absolute() else run_dir / cfg.dir
        self.run_id = run_id
        self._run: Any = None
        self._step = 0

    def open(self) -> None:
        import wandb

        self.dir.mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(mode=self.cfg.mode, init_timeout=self.cfg.init_timeout_s, console="off",
                                  silent=True, x_disable_stats=True)
        self._run = wandb.init(project=self.cfg.project, entity=self.cfg.entity or None, name=self.run_id,
                               dir=str(self.dir), settings=settings, config={"rlbus_run_id": self.run_id},
                               reinit="create_new")

    def _at(self, step: int) -> int:
        self._step = max(self._step, step)
        return self._step

    def scalars(self, step: int, values: dict[str, float], wall_time: float) -> None:
        self._run.log(dict(values), step=self._at(step))

    def table(self, table: Table) -> None:
        import wandb

        self._run.log({"completions": wandb.Table(columns=table.columns, data=table.rows)}, step=self._at(table.step))

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()


class TrackioWriter:
    """A trackio run named after the rlbus run, in a local database (``trackio show`` opens it)."""

    def __init__(self, cfg: TrackioBackend, run_dir: Path, run_id: str) -> None:
        self.name = "trackio"
        self.cfg = cfg
        self.dir = Path(cfg.dir) if Path(cfg.dir).is_absolute() else run_dir / cfg.dir
        self.run_id = run_id
        self._run: Any = None

    def open(self) -> None:
        # trackio reads TRACKIO_DIR once, when first imported; an operator's own setting wins
        os.environ.setdefault("TRACKIO_DIR", str(self.dir))
        import trackio

        self._run = trackio.init(project=self.cfg.project, name=self.run_id, config={"rlbus_run_id": self.run_id},
                                 resume="allow", embed=False, auto_log_gpu=False, auto_log_cpu=False)

    def scalars(self, step: int, values: dict[str, float], wall_time: float) -> None:
        self._run.log(dict(values), step=step)

    def table(self, table: Table) -> None:
        import trackio

        self._run.log({"completions": trackio.Table(columns=table.columns, data=table.rows)}, step=table.step)

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()


WRITERS: dict[type[Any], type[Any]] = {
    TensorBoardBackend: TensorBoardWriter, WandbBackend: WandbWriter, TrackioBackend: TrackioWriter,
}


def make_writer(cfg: Backend, run_dir: Path, run_id: str) -> Writer:
    return WRITERS[type(cfg)](cfg, run_dir, run_id)


class _Stop:
    """The end of a worker's queue."""


class BackendWorker:
    """One backend in a daemon thread behind a bounded queue: ``submit`` never blocks, failures drop."""

    def __init__(self, writer: Writer, queue_size: int, warn_every_s: float, label: str = "") -> None:
        self.writer = writer
        #: the backend's name in warnings and metrics (``wandb``; ``tensorboard-2`` for a second one)
        self.name = label or writer.name
        self.warn_every_s = warn_every_s
        self._q: queue.Queue[Any] = queue.Queue(maxsize=queue_size)
        self._lock = threading.Lock()
        self.written = 0
        self.dropped = 0
        self._dropped_since_warning = 0
        self._last_warning = -math.inf
        self.failed: str | None = None  # why the backend is dead (open failed)
        self._thread = threading.Thread(target=self._work, name=f"tracker-{self.name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, kind: str, *args: Any) -> None:
        """Queue ``writer.<kind>(*args)``; a full queue drops it (counted)."""
        try:
            self._q.put_nowait((kind, args))
        except queue.Full:
            self._drop(1, "its queue is full (the backend is slow or hung)")

    def _drop(self, n: int, why: str) -> None:
        with self._lock:
            self.dropped += n
            self._dropped_since_warning += n
            now = time.monotonic()
            if now - self._last_warning < self.warn_every_s:
                return
            count, self._dropped_since_warning, self._last_warning = self._dropped_since_warning, 0, now
        log.warning("tracker backend %s dropped %d record(s) (%d in all): %s; the run goes on", self.name, count,
                    self.dropped, why)

    def _work(self) -> None:
        try:
            self.writer.open()
        except Exception as e:  # any failure of a third-party tracker: the run must not notice
            self.failed = f"{type(e).__name__}: {e}"
            log.warning("tracker backend %s could not start (%s); its records are dropped", self.name, self.failed)
        while True:
            item = self._q.get()
            if isinstance(item, _Stop):
                break
            if self.failed is not None:
                self._drop(1, "the backend could not start (see above)")
                continue
            kind, args = item
            try:
                getattr(self.writer, kind)(*args)
                self.written += 1
            except Exception as e:  # a failing write drops that record only
                self._drop(1, f"{kind} failed: {type(e).__name__}: {e}")
        if self.failed is None:
            try:
                self.writer.close()
            except Exception as e:
                log.warning("tracker backend %s failed to close: %s: %s", self.name, type(e).__name__, e)

    def close(self, timeout: float) -> bool:
        """Write what is queued and close within ``timeout`` seconds; False if the backend had to be abandoned."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._q.put(_Stop(), timeout=max(deadline - time.monotonic(), 0.01))
                break
            except queue.Full:
                if time.monotonic() >= deadline:
                    break
        self._thread.join(max(deadline - time.monotonic(), 0.0))
        if self._thread.is_alive():
            left = self._q.qsize()
            self._last_warning = -math.inf  # this one is always said
            self._drop(left, f"it did not finish within {timeout:.0f}s of the stop; abandoned")
            return False
        return True
