"""Connecting to NATS, provisioning streams/consumers/buckets, publishing."""

from __future__ import annotations

import asyncio
import logging
import ssl
from typing import Any

import msgspec
import nats
from nats.aio.client import Client
from nats.js import JetStreamContext, api
from nats.js.errors import BadRequestError, NotFoundError

from proto import catalog, codec
from services.runtime import tracing
from services.runtime.config import NatsSection

log = logging.getLogger("rlbus.bus")


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
        servers=[u.strip() for u in cfg.url.split(",")],
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
    )
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
                raise BusError(f"NATS at {cfg.url} refused the credentials of user {cfg.user or '(none)'} "
                               "(Authorization Violation): check nats.user/nats.password or nats.creds_file")
            return connecting.result()
        except (OSError, nats.errors.NoServersError, TimeoutError) as e:
            if attempt >= attempts:
                raise BusError(f"cannot connect to NATS at {cfg.url}: {e}") from e
            log.warning("%s: NATS at %s not reachable (%s); retrying in %.1fs", name, cfg.url, e, delay)
            await asyncio.sleep(delay)  # connect backoff
            delay = min(delay * 2, 10.0)
    raise BusError(f"cannot connect to NATS at {cfg.url}")


# --- provisioning ---------------------------------------------------------------------------------


def stream_config(d: catalog.StreamDef) -> api.StreamConfig:
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
    )


async def ensure_stream(js: JetStreamContext, d: catalog.StreamDef) -> api.StreamInfo:
    """Create the stream, or bring an existing one to this definition (idempotent)."""
    cfg = stream_config(d)
    try:
        return await js.add_stream(cfg)
    except BadRequestError as e:
        if e.err_code != 10058:  # "stream name already in use with a different configuration"
            raise BusError(f"cannot create stream {d.name}: {e}") from e
        return await js.update_stream(cfg)


async def ensure_consumer(js: JetStreamContext, d: catalog.ConsumerDef) -> api.ConsumerInfo:
    cfg = consumer_config(d)
    try:
        return await js.add_consumer(d.stream, cfg)
    except BadRequestError as e:
        raise BusError(f"cannot create consumer {d.durable} on {d.stream}: {e}") from e


async def ensure_kv(js: JetStreamContext, d: catalog.KVDef) -> Any:
    try:
        return await js.key_value(d.bucket)
    except (NotFoundError, nats.js.errors.BucketNotFoundError):
        pass
    try:
        return await js.create_key_value(
            api.KeyValueConfig(bucket=d.bucket, history=d.history, ttl=d.ttl_s or None, description=d.description or None)
        )
    except BadRequestError:
        return await js.key_value(d.bucket)  # created concurrently by another service


async def provision_all(js: JetStreamContext) -> None:
    """Every stream and KV bucket of the catalog (consumers are per run, made by their services)."""
    for d in catalog.STREAMS.values():
        await ensure_stream(js, d)
    for k in catalog.KV_BUCKETS.values():
        await ensure_kv(js, k)


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
    headers = headers_for(msg)
    deadline = asyncio.get_running_loop().time() + retry_for_s
    delay = 0.2
    with tracing.span(f"publish {subject}", kind="producer"):
        while True:
            try:
                return await js.publish(subject, data, headers=headers, timeout=timeout)
            except _RETRYABLE as e:
                if asyncio.get_running_loop().time() + delay > deadline:
                    raise BusError(f"publish to {subject} failed for {retry_for_s:.0f}s: {e!r}") from e
                log.warning("publish to %s failed (%r); retrying in %.1fs", subject, e, delay)
                await asyncio.sleep(delay)  # backoff while the server comes back
                delay = min(delay * 2, 5.0)


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
