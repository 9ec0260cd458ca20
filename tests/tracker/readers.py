"""Reading back what the tracker wrote: TensorBoard event files and a W&B offline run directory."""

from __future__ import annotations

import glob
import json
import struct
from pathlib import Path
from typing import Any


def tensorboard(logdir: Path) -> Any:
    """An EventAccumulator over ``logdir`` with every event kept (no sampling)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def tb_scalars(acc: Any) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value), ...] in the order written."""
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def tb_texts(acc: Any, tag: str = "completions") -> list[tuple[int, str]]:
    """(step, text) of every text summary ``tag``."""
    if tag not in acc.Tags()["tensors"]:
        return []
    return [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(tag)]


_BLOCK = 32 * 1024
_HEADER = 7  # ":W&B", magic, version


def _log_records(raw: bytes) -> list[bytes]:
    """The records of a W&B transaction log (``run-<id>.wandb``): LevelDB's log format of 32 KiB blocks,
    each record a 7-byte header (crc32, length, type: full/first/middle/last) and its data."""
    out, pos, part = [], _HEADER, b""
    while pos + 7 <= len(raw):
        left = _BLOCK - pos % _BLOCK
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        pos += 7
        if kind == 0 and length == 0:  # zero padding to the end of the block
            pos += left - 7
            continue
        data, pos = raw[pos:pos + length], pos + length
        if kind == 1:
            out.append(data)
        elif kind == 2:
            part = data
        elif kind == 3:
            part += data
        elif kind == 4:
            out.append(part + data)
    return out


def wandb_offline_run(parent: Path) -> Path:
    """The one offline run directory under ``parent/wandb``."""
    runs = glob.glob(str(parent / "wandb" / "offline-run-*"))
    assert len(runs) == 1, f"expected one W&B offline run under {parent / 'wandb'}, found {runs}"
    return Path(runs[0])


def wandb_history(run_dir: Path) -> list[dict[str, Any]]:
    """Every history row (one per logged step) of a W&B offline run, decoded from its transaction log."""
    from wandb.proto import wandb_internal_pb2

    (log,) = run_dir.glob("run-*.wandb")
    rows = []
    for data in _log_records(log.read_bytes()):
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(data)
        if rec.WhichOneof("record_type") == "history":
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
    return rows


def wandb_tables(run_dir: Path) -> list[dict[str, Any]]:
    """The completions tables of a W&B offline run (``columns``, ``data``), as W&B stored them."""
    return [json.loads(Path(p).read_text())
            for p in sorted(glob.glob(str(run_dir / "files" / "media" / "table" / "completions_*.table.json")))]
