"""``rlbus status``: members, stream depths, consumer lag, latest weight version."""

from __future__ import annotations

import time
from typing import Any

from proto import catalog, codec
from proto.membership import Heartbeat
from services.runtime import bus, gang


async def collect(nc: Any, run_id: str) -> dict[str, Any]:
    js = nc.jetstream()
    out: dict[str, Any] = {"run_id": run_id, "members": [], "streams": {}, "consumers": {}, "weights": None, "gang": None}
    out["members"] = await members(js, run_id)
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
    out["weights"] = await latest_weights(js, run_id)
    try:
        runs = await js.key_value(catalog.RUNS.bucket)
    except Exception:
        runs = None
    if runs is not None:
        try:
            value = codec.msgspec.msgpack.decode((await runs.get(f"{run_id}.state")).value)
            out["trainer"] = {k: value.get(k) for k in ("state", "step", "version")}
        except Exception:
            pass  # not there (yet), or unreadable: status shows what it can
        try:
            decided = await gang.decision(js, run_id)
        except Exception:
            decided = None
        if decided is not None:
            # the first proposal stored decides; later ones that disagree are shown as ignored, never obeyed
            out["gang"] = {**codec.msgspec.to_builtins(decided.state), "by": decided.by,
                           **({"ignored_later": decided.ignored} if decided.ignored else {})}
    return out


async def members(js: Any, run_id: str) -> list[dict[str, Any]]:
    """The run's members as their last heartbeats in the members bucket say (what health checks read)."""
    out: list[dict[str, Any]] = []
    try:
        kv = await js.key_value(catalog.MEMBERS.bucket)
        keys = await bus.kv_keys(js, catalog.MEMBERS.bucket, f"{run_id}.")
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
        out.append({
            "service": hb.service, "instance": hb.instance, "state": hb.state, "host": hb.host, "pid": hb.pid,
            "age_s": round(time.time() - hb.created_at, 1), "metrics": hb.metrics,
        })
    return out


async def latest_weights(js: Any, run_id: str, scope: str = "main") -> dict[str, Any] | None:
    """The newest version announced in ``scope``: through the store (manifest) or a broadcast group."""
    from proto.weights import BroadcastReady, WeightAnnouncement, broadcast_ready_key, kv_bucket, latest_key

    try:
        kv = await js.key_value(kv_bucket(scope))
    except Exception:
        return None
    found: list[dict[str, Any]] = []
    for key, typ in ((latest_key(run_id), WeightAnnouncement), (broadcast_ready_key(run_id), BroadcastReady)):
        try:
            entry = await kv.get(key)
            msg = codec.decode(entry.value, typ, max_bytes=None)
        except Exception:
            continue
        if isinstance(msg, WeightAnnouncement):
            m = msg.manifest
            found.append({"version": m.version, "transport": f"store ({m.store})", "kind": m.kind,
                          "anchor": m.anchor_version, "bytes": m.blob_nbytes, "at": msg.created_at})
        else:
            found.append({"version": msg.policy_version, "transport": "broadcast", "group": msg.group_id,
                          "bytes": msg.data_nbytes, "at": msg.created_at})
    return max(found, key=lambda w: (w["at"], w["version"])) if found else None


def healthy_here(st: dict[str, Any], service: str, max_age_s: float, host: str | None = None) -> tuple[bool, str]:
    """Whether ``service`` has an instance on ``host`` (default: this host's name, which is the container's
    or pod's) whose last heartbeat is at most ``max_age_s`` old, whose state is starting, waiting or
    running and which reports no ``*_unhealthy`` gauge (:func:`unhealthy`); with the reason either way."""
    import socket

    host = host or socket.gethostname()
    mine = [m for m in st["members"] if m["service"] == service and m["host"] == host]
    if not mine:
        return False, f"no {service} instance of run {st['run_id']} heartbeats from host {host}"
    best = min(mine, key=lambda m: m["age_s"])
    if best["age_s"] > max_age_s:
        return False, f"{service} {best['instance']} on {host}: last heartbeat {best['age_s']}s ago (> {max_age_s:g}s)"
    if best["state"] not in ("starting", "waiting", "running"):
        return False, f"{service} {best['instance']} on {host} is {best['state']}"
    if unhealthy(best):
        return False, (f"{service} {best['instance']} on {host} reports itself unhealthy "
                       f"({', '.join(unhealthy(best))})")
    return True, f"{service} {best['instance']} on {host} is {best['state']} (heartbeat {best['age_s']}s ago)"


def unhealthy(member: dict[str, Any]) -> list[str]:
    """The gauges by which a member says it is unhealthy (named ``*_unhealthy``, non-zero: e.g. a rollout
    failing to apply weight versions, ``rollout/weights_unhealthy``)."""
    return sorted(k for k, v in member["metrics"].items() if k.endswith("_unhealthy") and v)


def _weights_line(w: dict[str, Any] | None) -> str:
    if w is None:
        return "none announced"
    if w["transport"] == "broadcast":
        return f"v{w['version']} by broadcast (group {w['group']}, {w['bytes']} bytes)"
    return f"v{w['version']} in the {w['transport']} ({w['kind']}, anchor v{w['anchor']}, {w['bytes']} bytes)"


def format_status(st: dict[str, Any]) -> str:
    lines = [f"run {st['run_id']}"]
    lines.append(f"members ({len(st['members'])}):")
    for m in sorted(st["members"], key=lambda m: (m["service"], m["instance"])):
        gauges = " ".join(f"{k}={v:g}" for k, v in sorted(m["metrics"].items()))
        lines.append(f"  {m['service']:<11} {m['instance']:<24} {m['state']:<9} pid {m['pid']:<7} "
                     f"seen {m['age_s']}s ago {'UNHEALTHY ' if unhealthy(m) else ''}{gauges}")
    lines.append("streams:")
    for name, s in st["streams"].items():
        lines.append(f"  {name:<13} {s['messages']:>8} msgs {s['bytes']:>12} bytes")
    lines.append("consumers (this run):")
    for name, c in st["consumers"].items():
        lines.append(f"  {name:<28} pending {c['pending']:>6}  unacked {c['ack_pending']:>6}  redelivered {c['redelivered']}")
    lines.append(f"latest weight version: {_weights_line(st['weights'])}")
    if st.get("trainer") is not None:
        t = st["trainer"]
        lines.append(f"trainer: {t['state']} at step {t['step']}, version {t['version']}")
    if st.get("gang") is not None:
        lines.append(f"gang: {st['gang']}")
    return "\n".join(lines)
