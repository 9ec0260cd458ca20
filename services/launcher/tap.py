"""``rlbus tap``: print bus messages as JSON lines, decoded with the proto schema."""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import json
import re
import sys
from typing import Any, TextIO

import msgspec
from nats.js import api

from proto import catalog, codec, registry, subjects

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")


def parse_since(text: str) -> dt.datetime:
    """``30s``, ``5m``, ``2h``, ``1d`` ago, or an ISO-8601 time."""
    m = _DURATION.match(text.strip())
    now = dt.datetime.now(dt.UTC)
    if m:
        n, unit = float(m.group(1)), m.group(2)
        return now - dt.timedelta(seconds=n * {"s": 1, "m": 60, "h": 3600, "d": 86400}[unit])
    try:
        t = dt.datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"--since {text!r}: use a duration like 30s/5m/2h/1d or an ISO-8601 time") from None
    return t if t.tzinfo else t.replace(tzinfo=dt.UTC)


def expand_target(target: str, run_id: str) -> list[str]:
    """A full subject stays as is; a channel name (``sandbox_events``) means that channel of this run,
    any other bare name that family of this run."""
    if "." in target or target.startswith("$"):
        return [target]
    channel = catalog.CHANNELS.get(target.lower())
    if channel is not None and channel.name != channel.family:
        return [channel.wildcard(run_id)]
    return [subjects.subject(run_id, target), subjects.subject(run_id, target, ">")]


def render(subject: str, data: bytes, headers: dict[str, str] | None, raw: bool,
           seq: int | None = None, ts: Any = None) -> str:
    """A message as a JSON line; a group message (a prompt group's rollouts or trajectories, a batch of
    outcomes) as one line per record, each naming the message (``"message"``). ``raw``: schema-less."""
    rec: dict[str, Any] = {"subject": subject}
    if seq is not None:
        rec["seq"] = seq
    if ts is not None:
        rec["time"] = ts.isoformat() if isinstance(ts, dt.datetime) else ts
    if headers:
        rec["headers"] = headers
    if raw:
        try:
            rec["data"] = msgspec.to_builtins(msgspec.msgpack.decode(data), enc_hook=str)
        except msgspec.DecodeError:
            rec["data_b64"] = base64.b64encode(data).decode()
    else:
        try:
            msg = registry.decode_any(subject, data)
        except codec.DecodeError as e:
            rec["error"] = str(e)
            rec["data_b64"] = base64.b64encode(data).decode()
        else:
            records = catalog.members(msg)
            if records != [msg]:  # a group message: a line per rollout / trajectory / outcome, naming the message
                return "\n".join(json.dumps({**rec, "message": msg.msg_id, "data": msgspec.to_builtins(r)},
                                             default=str) for r in records)
            rec["data"] = msgspec.to_builtins(msg)
    return json.dumps(rec, default=str)


async def tap(nc: Any, target: str, run_id: str, *, from_start: bool = False, since: str | None = None,
              count: int | None = None, raw: bool = False, out: TextIO = sys.stdout,
              stop: asyncio.Event | None = None, until_end: bool = False) -> int:
    """Print messages until ``count`` were printed or ``stop`` is set (``until_end``, with
    ``from_start``/``since``: or the stream's messages stored when the tap started were all printed).
    Returns how many were printed."""
    if until_end and not (from_start or since is not None):
        raise SystemExit("tap: --until-end reads what a stream stored: give --from-start or --since too")
    js = nc.jetstream()
    queue: asyncio.Queue[str] = asyncio.Queue()
    subs = []
    stream_name: str | None = None
    if re.fullmatch(r"[A-Z0-9_]+", target):
        stream_name = target
        filters = [">"]
    else:
        filters = expand_target(target, run_id)
    stored = from_start or since is not None
    if stream_name is None and stored:
        kept = []
        for f in filters:
            try:
                found = await js.find_stream_name_by_subject(f)
            except Exception:
                continue  # no stream stores this filter
            if stream_name in (None, found):
                stream_name = found
                kept.append(f)
        if stream_name is None:
            raise SystemExit(f"tap: no stream stores {target!r}; drop --from-start/--since to watch it live")
        filters = kept

    if stream_name is not None:
        if from_start:
            policy, start = api.DeliverPolicy.ALL, None
        elif since is not None:
            policy, start = api.DeliverPolicy.BY_START_TIME, parse_since(since)
        else:
            policy, start = api.DeliverPolicy.NEW, None
        for f in filters:

            async def cb(m: Any) -> None:
                md = m.metadata
                await queue.put(render(m.subject, m.data, m.headers, raw, md.sequence.stream, md.timestamp))

            cfg_kwargs: dict[str, Any] = {"deliver_policy": policy}
            if start is not None:
                cfg_kwargs["opt_start_time"] = start.isoformat().replace("+00:00", "Z")
            sub = await js.subscribe(f, stream=stream_name, cb=cb, ordered_consumer=True,
                                     config=api.ConsumerConfig(**cfg_kwargs))
            subs.append(sub)
        if until_end:  # what was stored when the tap started: delivered so far + still pending
            end = 0
            for sub in subs:
                info = await sub.consumer_info()
                end += info.num_pending + (info.delivered.consumer_seq if info.delivered else 0)
            count = end if count is None else min(count, end)
    else:
        for f in filters:
            async def live_cb(m: Any) -> None:
                await queue.put(render(m.subject, m.data, m.headers, raw))

            subs.append(await nc.subscribe(f, cb=live_cb))

    printed = 0
    stop = stop or asyncio.Event()
    stop_task = asyncio.create_task(stop.wait(), name="tap-stop")
    try:
        while count is None or printed < count:
            get = asyncio.create_task(queue.get(), name="tap-get")
            done, _ = await asyncio.wait({get, stop_task}, return_when=asyncio.FIRST_COMPLETED)
            if get not in done:
                get.cancel()
                break
            print(get.result(), file=out, flush=True)
            printed += 1
    finally:
        stop_task.cancel()
        for s in subs:
            try:
                await s.unsubscribe()
            except Exception:
                pass
    return printed
