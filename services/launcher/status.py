"""``rlbus status``: members, stream depths, consumer lag, latest weight version."""

from __future__ import annotations

import importlib
import time
from typing import Any

from proto import catalog, codec
from proto.membership import Heartbeat


async def collect(nc: Any, run_id: str) -> dict[str, Any]:
    js = nc.jetstream()
    out: dict[str, Any] = {"run_id": run_id, "members": [], "streams": {}, "consumers": {}, "weights": None, "gang": None}
    try:
        kv = await js.key_value(catalog.MEMBERS.bucket)
        keys = await kv.keys()
    except Exception:
        keys = []
    for key in keys:
        if not key.startswith(f"{run_id}."):
            continue
        try:
            entry = await kv.get(key)
            hb = codec.decode(entry.value, Heartbeat)
        except Exception:
            continue
        out["members"].append({
            "service": hb.service, "instance": hb.instance, "state": hb.state, "host": hb.host, "pid": hb.pid,
            "age_s": round(time.time() - hb.created_at, 1), "metrics": hb.metrics,
        })
    for name in catalog.STREAMS:
        try:
            info = await js.stream_info(name)
        except Exception:
            continue
        out["streams"][name] = {"messages": info.state.messages, "bytes": info.state.bytes}
        try:
            consumers = await js.consumers_info(name)
        except Exception:
            consumers = []
        for ci in consumers:
            if ci.name.endswith(f"-{run_id}"):
                out["consumers"][f"{name}/{ci.name}"] = {
                    "pending": ci.num_pending, "ack_pending": ci.num_ack_pending, "redelivered": ci.num_redelivered,
                }
    try:
        weights = importlib.import_module("proto.weights")
        latest = getattr(weights, "status_latest", None)
        if latest is not None:
            out["weights"] = await latest(js, run_id)
    except ImportError:
        pass
    try:
        runs = await js.key_value(catalog.RUNS.bucket)
        entry = await runs.get(f"{run_id}.gang")
        out["gang"] = codec.msgspec.msgpack.decode(entry.value)
    except Exception:
        pass
    return out


def format_status(st: dict[str, Any]) -> str:
    lines = [f"run {st['run_id']}"]
    lines.append(f"members ({len(st['members'])}):")
    for m in sorted(st["members"], key=lambda m: (m["service"], m["instance"])):
        gauges = " ".join(f"{k}={v:g}" for k, v in sorted(m["metrics"].items()))
        lines.append(f"  {m['service']:<11} {m['instance']:<24} {m['state']:<9} pid {m['pid']:<7} "
                     f"seen {m['age_s']}s ago {gauges}")
    lines.append("streams:")
    for name, s in st["streams"].items():
        lines.append(f"  {name:<13} {s['messages']:>8} msgs {s['bytes']:>12} bytes")
    lines.append("consumers (this run):")
    for name, c in st["consumers"].items():
        lines.append(f"  {name:<28} pending {c['pending']:>6}  unacked {c['ack_pending']:>6}  redelivered {c['redelivered']}")
    lines.append(f"latest weight version: {st['weights'] if st['weights'] is not None else 'none'}")
    if st.get("gang") is not None:
        lines.append(f"gang: {st['gang']}")
    return "\n".join(lines)
