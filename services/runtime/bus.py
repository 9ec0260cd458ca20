"""Connecting to NATS, provisioning streams/consumers/buckets, publishing."""

from __future__ import annotations

import asyncio
import logging
import ssl
import weakref
from collections.abc import Awaitable, Iterable
from typing import Any, TypeVar

import msgspec
import nats
from nats.aio.client import Client
from nats.js import JetStreamContext, api
from nats.js.errors import APIError, NotFoundError

from proto import catalog, codec
from services.runtime import tracing
from services.runtime.config import NatsSection

log = logging.getLogger("rlbus.bus")
T = TypeVar("T")


class BusError(RuntimeError):
    """The bus could not be reached or a provisioning call failed."""


async def connect(cfg: NatsSection, name: str, *, first_attempts: int = 0) -> Client:
    """Connect with reconnect + backoff; ``first_attempts`` retries the first connect too (0: forever if
    ``max_reconnect_attempts`` is -1, else once)."""
    tls = None
    if cfg.tls_ca or cfg.tls_cert:
        tls = ssl.create_default_context(cafile=cfg.tls_ca)
        if cfg.tls_cert:
            tls.load_cert_chain(cfg.tls_cert, cfg.tls_key)

    async def on_disconnect() -> None:
        log.info("%s: disconnected from NATS", name)

    async def on_reconnect() -> None:
        log.warning("%s: reconnected to NATS", name)

    auth_refused = asyncio.Event()

    async def on_error(e: Exception) -> None:
        if "authorization violation" in str(e).lower():
            auth_refused.set()
        log.warning("%s: NATS error: %s", name, e)

    opts: dict[str, Any] = dict(
        servers=cfg.servers(),
        name=name,
        connect_timeout=cfg.connect_timeout_s,
        reconnect_time_wait=cfg.reconnect_wait_s,
        max_reconnect_attempts=cfg.max_reconnect_attempts,
        allow_reconnect=True,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
        error_cb=on_error,
        tls=tls,
        user=cfg.user,
        password=cfg.password,
        user_credentials=cfg.creds_file,
        inbox_prefix=cfg.inbox_prefix,
        pending_size=64 * 1024 * 1024,
        ping_interval=cfg.ping_interval_s,
        max_outstanding_pings=cfg.max_outstanding_pings,
    )
    where = ", ".join(cfg.servers())
    attempts = first_attempts or (1_000_000 if cfg.max_reconnect_attempts < 0 else 1)
    delay = cfg.reconnect_wait_s
    for attempt in range(1, attempts + 1):
        try:
            connecting = asyncio.create_task(nats.connect(**opts), name=f"{name}-connect")
            refused = asyncio.create_task(auth_refused.wait(), name=f"{name}-auth-refused")
            await asyncio.wait({connecting, refused}, return_when=asyncio.FIRST_COMPLETED)
            refused.cancel()
            if auth_refused.is_set():
                connecting.cancel()
                raise BusError(f"NATS at {where} refused the credentials of user {cfg.user or '(none)'} "
                               "(Authorization Violation): check nats.user/nats.password or nats.creds_file")
            nc = connecting.result()
            _REPLICAS[nc] = cfg.replicas
            return nc
        except (OSError, nats.errors.NoServersError, TimeoutError) as e:
            if attempt >= attempts:
                raise BusError(f"cannot connect to NATS at {where}: {e}") from e
            log.warning("%s: NATS at %s not reachable (%s); retrying in %.1fs", name, where, e, delay)
            await asyncio.sleep(delay)  # connect backoff
            delay = min(delay * 2, 10.0)
    raise BusError(f"cannot connect to NATS at {where}")


# --- provisioning ---------------------------------------------------------------------------------
#
# Replicas: every stream, KV bucket and object store a run creates gets ``[nats] replicas`` (consumers
# inherit their stream's, num_replicas = 0). A client made by :func:`connect` remembers its section's
# replicas, so ``ensure_*`` called with that connection's JetStream context use it without every caller
# passing it along. Existing definitions are never lowered: replicas only go up, the storage type is never
# changed (JetStream cannot), and a service (``update=False``: per-service users have no STREAM.UPDATE
# right) leaves any other difference as it is and says so; the launcher (``update=True``) applies it.
# ensure_stream alone defaults to update=True; provision_all (what every service runs at start) to False.

_REPLICAS: weakref.WeakKeyDictionary[Client, int] = weakref.WeakKeyDictionary()

#: StreamConfig fields rlbus sets; any other field of an existing stream is the operator's and kept
_OWN_FIELDS = ("description", "subjects", "retention", "max_age", "max_bytes", "max_msgs", "max_msg_size",
               "duplicate_window")


def replicas_of(js: JetStreamContext) -> int:
    """The ``[nats] replicas`` of the connection ``js`` was made from (1 for a connection not made by
    :func:`connect`)."""
    return _REPLICAS.get(js._nc, 1)  # nats-py keeps the client as _nc; no public accessor


def stream_config(d: catalog.StreamDef, replicas: int = 1) -> api.StreamConfig:
    return api.StreamConfig(
        name=d.name,
        description=d.description or None,
        subjects=list(d.subjects),
        retention=api.RetentionPolicy(d.retention),
        max_age=d.max_age_s,
        max_bytes=d.max_bytes,
        max_msgs=d.max_msgs,
        max_msg_size=d.max_msg_size,
        duplicate_window=d.duplicate_window_s,
        storage=api.StorageType(d.storage),
        num_replicas=replicas,
    )


def consumer_config(d: catalog.ConsumerDef) -> api.ConsumerConfig:
    return api.ConsumerConfig(
        durable_name=d.durable,
        description=d.description or None,
        filter_subject=d.filter_subject,
        ack_policy=api.AckPolicy.EXPLICIT,
        deliver_policy=api.DeliverPolicy.ALL,
        ack_wait=d.ack_wait_s,
        max_deliver=d.max_deliver,
        max_ack_pending=d.max_ack_pending,
        max_waiting=512,
        num_replicas=0,  # the stream's replicas
    )


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return abs(float(a or 0) - float(b or 0)) < 1e-3
    if isinstance(a, list) or isinstance(b, list):
        return sorted(a or []) == sorted(b or [])
    return a == b


def merge_stream_config(existing: api.StreamConfig, wanted: api.StreamConfig) -> tuple[api.StreamConfig, list[str]]:
    """The configuration ``existing`` should be brought to, and what will not be changed (and why).

    rlbus's own fields (:data:`_OWN_FIELDS`) come from ``wanted``; replicas become the larger of the two;
    the storage type and every other field stay as they are."""
    merged = api.StreamConfig.from_response(existing.as_dict())
    kept: list[str] = []
    for f in _OWN_FIELDS:
        setattr(merged, f, getattr(wanted, f))
    have, want = existing.num_replicas or 1, wanted.num_replicas or 1
    merged.num_replicas = max(have, want)
    if have > want:
        kept.append(f"replicas {have} (not lowered to {want})")
    if existing.storage != wanted.storage:
        kept.append(f"storage {existing.storage.value if existing.storage else '?'} "
                    f"(not changed to {wanted.storage.value if wanted.storage else '?'})")
    return merged, kept


def stream_differences(existing: api.StreamConfig, target: api.StreamConfig) -> list[str]:
    """``field: existing -> target`` for every field of rlbus's (and replicas) that differs."""
    out = []
    for f in (*_OWN_FIELDS, "num_replicas"):
        a, b = getattr(existing, f), getattr(target, f)
        if f == "num_replicas":
            a, b = a or 1, b or 1
        if not _same(a, b):
            out.append(f"{f}: {a!r} -> {b!r}")
    return out


async def ensure_stream(js: JetStreamContext, d: catalog.StreamDef, *, replicas: int | None = None,
                        update: bool = True) -> api.StreamInfo:
    """Create the stream with ``replicas`` (default: the connection's ``[nats] replicas``), or reconcile
    an existing one: never lower its replicas nor change its storage; other differences from ``d`` are
    applied with ``update=True`` (the launcher) and reported, not applied, with ``update=False`` (services,
    whose users may create but not update streams)."""
    wanted = stream_config(d, replicas or replicas_of(js))
    try:
        return await js.add_stream(wanted)
    except APIError as e:
        if e.err_code != 10058:  # "stream name already in use with a different configuration"
            raise BusError(_provisioning_error(f"stream {d.name}", wanted.num_replicas, e)) from e
    info = await js.stream_info(d.name)
    target, kept = merge_stream_config(info.config, wanted)
    for k in kept:
        log.info("stream %s keeps its %s", d.name, k)
    changes = stream_differences(info.config, target)
    if not changes:
        return info
    if not update:
        log.warning("stream %s differs from this version's definition (%s); left as it is: services do not "
                    "change existing streams (rlbus up / rlbus provision do)", d.name, "; ".join(changes))
        return info
    log.info("stream %s: updating %s", d.name, "; ".join(changes))
    try:
        return await js.update_stream(target)
    except APIError as e:
        raise BusError(_provisioning_error(f"stream {d.name} ({'; '.join(changes)})", target.num_replicas or 1,
                                           e)) from e


def _provisioning_error(what: str, replicas: int, e: Exception) -> str:
    text = f"cannot provision {what}: {e}"
    if replicas > 1 and any(k in str(e).lower() for k in ("insufficient resources", "replicas", "clustered")):
        text += (f"; [nats] replicas = {replicas} needs a JetStream cluster of at least {replicas} nodes "
                 "(one server: replicas = 1)")
    if "insufficient storage" in str(e).lower():
        text += ("; the server has no room for the stream's reserved max_bytes: JetStream's store limit "
                 "(max_file_store) defaults to 75% of the disk's free space when nats-server starts, so free disk "
                 "space under its store directory (or raise max_file_store in its config) and start it again")
    return text


async def ensure_consumer(js: JetStreamContext, d: catalog.ConsumerDef) -> api.ConsumerInfo:
    cfg = consumer_config(d)
    try:
        return await js.add_consumer(d.stream, cfg)
    except APIError as e:
        raise BusError(f"cannot create consumer {d.durable} on {d.stream}: {e}") from e


async def _raise_replicas(js: JetStreamContext, stream: str, replicas: int, update: bool) -> None:
    """Bring the stream behind a bucket up to ``replicas`` (never down)."""
    info = await js.stream_info(stream)
    have = info.config.num_replicas or 1
    if have >= replicas:
        return
    if not update:
        log.warning("%s has %d replica(s), fewer than [nats] replicas = %d; left as it is: services do not "
                    "change existing buckets (rlbus up / rlbus provision do)", stream, have, replicas)
        return
    cfg = api.StreamConfig.from_response(info.config.as_dict())
    cfg.num_replicas = replicas
    log.info("%s: raising replicas %d -> %d", stream, have, replicas)
    try:
        await js.update_stream(cfg)
    except APIError as e:
        raise BusError(_provisioning_error(f"{stream} (replicas {have} -> {replicas})", replicas, e)) from e


async def ensure_kv(js: JetStreamContext, d: catalog.KVDef, *, replicas: int | None = None,
                    update: bool = False) -> Any:
    """Open the KV bucket, creating it with ``replicas`` (default: the connection's) when missing; an
    existing bucket is used as it is, except that ``update=True`` raises its replicas."""
    replicas = replicas or replicas_of(js)
    try:
        kv = await js.key_value(d.bucket)
    except (NotFoundError, nats.js.errors.BucketNotFoundError):
        pass
    else:
        if update:
            await _raise_replicas(js, f"KV_{d.bucket}", replicas, update)
        return kv
    try:
        return await js.create_key_value(api.KeyValueConfig(
            bucket=d.bucket, history=d.history, ttl=d.ttl_s or None, description=d.description or None,
            replicas=replicas))
    except APIError as e:
        try:
            return await js.key_value(d.bucket)  # created concurrently by another service
        except (NotFoundError, nats.js.errors.BucketNotFoundError):
            raise BusError(_provisioning_error(f"KV bucket {d.bucket}", replicas, e)) from e


async def kv_keys(js: JetStreamContext, bucket: str, prefix: str = "") -> list[str]:
    """Keys of a KV bucket (those starting with ``prefix``, which ends at a dot) from its stream's subject
    list: one API call, no consumer. nats-py's ``kv.keys()`` is a watch whose consumer the server keeps,
    one more per call. A deleted key may still be listed (its tombstone): ``kv.get`` then raises
    ``KeyDeletedError``."""
    head = f"$KV.{bucket}."
    info = await js.stream_info(f"KV_{bucket}", subjects_filter=f"{head}{prefix}>")
    return [subject[len(head):] for subject in info.state.subjects or {}]


async def ensure_object_store(js: JetStreamContext, bucket: str, *, replicas: int | None = None,
                              storage: str = "file", description: str = "", update: bool = False) -> None:
    """The object-store bucket exists with at least ``replicas`` (default: the connection's)."""
    replicas = replicas or replicas_of(js)
    try:
        await js.object_store(bucket)
    except (NotFoundError, nats.js.errors.BucketNotFoundError):
        try:
            await js.create_object_store(bucket, api.ObjectStoreConfig(
                bucket=bucket, description=description or None, replicas=replicas,
                storage=api.StorageType.FILE if storage == "file" else api.StorageType.MEMORY))
        except APIError as e:
            try:
                await js.object_store(bucket)
            except (NotFoundError, nats.js.errors.BucketNotFoundError):
                raise BusError(_provisioning_error(f"object store {bucket}", replicas, e)) from e
        return
    if update:
        await _raise_replicas(js, f"OBJ_{bucket}", replicas, update)


async def provision_all(js: JetStreamContext, *, replicas: int | None = None, update: bool = False) -> None:
    """Every stream and KV bucket of the catalog (consumers are per run, made by their services), with
    ``replicas`` (default: the connection's ``[nats] replicas``). Services call it with ``update=False``
    (create what is missing, report differences: their users may not update streams); the launcher with
    ``update=True`` (also apply differences and raise replicas). See :func:`ensure_stream`."""
    for d in catalog.STREAMS.values():
        await ensure_stream(js, d, replicas=replicas, update=update)
    for k in catalog.KV_BUCKETS.values():
        await ensure_kv(js, k, replicas=replicas, update=update)


# --- publishing -----------------------------------------------------------------------------------


def headers_for(msg: Any) -> dict[str, str]:
    headers: dict[str, str] = {}
    msg_id = getattr(msg, "msg_id", None)
    if msg_id:
        headers["Nats-Msg-Id"] = msg_id
    tracing.inject(headers)
    return headers


_RETRYABLE = (
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.OutboundBufferLimitError,
    nats.js.errors.ServiceUnavailableError,
    nats.js.errors.NoStreamResponseError,  # a replicated stream electing a new leader (a node went away)
    asyncio.TimeoutError,
)


async def publish(js: JetStreamContext, subject: str, msg: msgspec.Struct, timeout: float = 10.0,
                  retry_for_s: float = 120.0) -> api.PubAck:
    """Publish to a stream with ``Nats-Msg-Id`` and the trace context.

    While the server is unreachable (restarting, reconnecting) the publish is retried
    with backoff for up to ``retry_for_s`` seconds; the message id makes the retries
    safe (JetStream stores the message once).
    """
    data = codec.encode(msg)
    deadline = asyncio.get_running_loop().time() + retry_for_s
    delay = 0.2
    with tracing.span(f"publish {subject}", kind="producer"):
        headers = headers_for(msg)  # inside the span: the consumer's span is this publish span's child
        while True:
            try:
                return await js.publish(subject, data, headers=headers, timeout=timeout)
            except _RETRYABLE as e:
                if asyncio.get_running_loop().time() + delay > deadline:
                    raise BusError(f"publish to {subject} failed for {retry_for_s:.0f}s: {e!r}") from e
                log.warning("publish to %s failed (%r); retrying in %.1fs", subject, e, delay)
                await asyncio.sleep(delay)  # backoff while the server comes back
                delay = min(delay * 2, 5.0)


async def in_window(aws: Iterable[Awaitable[T]], window: int) -> list[T | BaseException]:
    """Await ``aws`` (publishes, usually) with at most ``window`` of them in flight at once; each one's result,
    or the exception it raised, in the order given. Every one runs to its end before this returns, so a
    caller knows which were stored and which failed (a :func:`publish` has already retried its own failures:
    a lost or timed-out ack is sent again under the same ``Nats-Msg-Id``, stored once).

    Why: a JetStream publish waits one round trip for its ack, so publishing n messages one at a time costs
    n round trips (more on a replicated stream, whose ack waits for the replicas); a window sends them
    together and awaits the acks together. They leave in the order given, but one that is retried may be
    stored after later ones: use it only where the consumers do not rely on the order between these
    messages (a work queue's tickets, a group's parts, outcome batches, each de-duplicated by its id).
    ``window`` 1 awaits each before the next starts (the order kept exactly)."""
    if window < 1:
        raise ValueError(f"in_window: window must be >= 1, got {window}")
    slots = asyncio.Semaphore(window)

    async def one(aw: Awaitable[T]) -> T:
        async with slots:
            return await aw

    return await asyncio.gather(*(one(aw) for aw in aws), return_exceptions=True)


async def publish_on(nc: Client, js: JetStreamContext, channel: catalog.Channel, run_id: str, msg: msgspec.Struct,
                     *subject_suffix: str) -> api.PubAck | None:
    """Publish ``msg`` on ``channel`` of run ``run_id``; TypeError when it is not of the channel's type.

    A stream channel gets :func:`publish` (retried, deduplicated; returns the ack), any other a core-NATS
    publish with the same headers (returns None).
    """
    channel.check(msg)
    subject = channel.subject(run_id, *subject_suffix)
    if channel.stream is not None:
        return await publish(js, subject, msg)
    with tracing.span(f"publish {subject}", kind="producer"):
        await nc.publish(subject, codec.encode(msg), headers=headers_for(msg) or None)
    return None
