"""OpenTelemetry tracing, set up once per process; context carried in NATS headers.

Which: one prompt group in ten by default, with its whole trace (the sampling decision is the root's and
travels with the context), and one train step in ten; ``OTEL_TRACES_SAMPLER=always_on`` traces everything
(the standard variables ``OTEL_TRACES_SAMPLER``/``_ARG`` choose any sampler).

Where spans go:

* **the run directory, always** (``<run dir>/traces/<service>-<pid>.jsonl``, one JSON object per span:
  trace/span/parent ids, name, service, start/end in ns, attributes, links): every run has its traces,
  and ``rlbus trace`` reads them back. ``RLBUS_TRACES_FILE=0`` turns it off; a file stops growing at
  ``RLBUS_TRACES_FILE_MB`` (default 256) with one warning.
* ``OTEL_TRACES_EXPORTER`` (comma-separated, the OpenTelemetry variable): ``otlp`` exports over OTLP with
  the protocol of ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` / ``OTEL_EXPORTER_OTLP_PROTOCOL`` (``grpc`` or
  ``http/protobuf``, the default) to ``OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT`` (the exporters read the
  standard variables themselves; install the ``otel`` extra); ``console`` prints spans; ``none`` (the
  default) adds nothing.

Telemetry never hurts the run: exports run in the batch processor's thread, never on the event loop;
an exporter that fails (an unreachable collector, a full disk) has its batches dropped, counted in
:data:`DROPPED`, with at most one warning a minute; :func:`shutdown` flushes within a bound.

How a trace runs through the loop: the trainer opens a root span per prompt group (``admit group``) and
publishes the ticket inside it; every publish is a producer span whose context goes into the message's
headers, and every consumer span is its child (rollout → sandbox execs → judge → trainer). The train step
that consumed many groups links to each of their trajectory spans; the weight version it sends carries
the step's context in its announcement, and each engine's ``apply weights`` span links to it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

log = logging.getLogger("rlbus.tracing")
_tracer: trace.Tracer | None = None
_provider: TracerProvider | None = None

_KINDS = {
    "internal": trace.SpanKind.INTERNAL,
    "producer": trace.SpanKind.PRODUCER,
    "consumer": trace.SpanKind.CONSUMER,
}

#: share of prompt groups (and train steps) traced unless OTEL_TRACES_SAMPLER says otherwise
DEFAULT_GROUP_RATIO = 0.1
#: spans dropped per exporter because an export failed (an unreachable collector, a full disk)
DROPPED: dict[str, int] = {}
_WARN_EVERY_S = 60.0


class _Guarded(SpanExporter):
    """An exporter whose failures drop the batch, count it and warn at most once a minute."""

    def __init__(self, name: str, inner: SpanExporter) -> None:
        self.name, self.inner = name, inner
        self._warned = 0.0
        DROPPED.setdefault(name, 0)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = self.inner.export(spans)
        except Exception as e:  # an exporter bug or I/O error must not reach the processor thread
            result, reason = SpanExportResult.FAILURE, repr(e)
        else:
            reason = "export failed"
        if result is not SpanExportResult.SUCCESS:
            DROPPED[self.name] += len(spans)
            now = time.monotonic()
            if now - self._warned >= _WARN_EVERY_S:
                self._warned = now
                log.warning("traces: %s exporter dropped %d spans so far (%s); the run goes on",
                            self.name, DROPPED[self.name], reason)
        return result

    def shutdown(self) -> None:
        with contextlib.suppress(Exception):
            self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        try:
            return self.inner.force_flush(timeout_millis)
        except Exception:
            return False


class JsonlSpanExporter(SpanExporter):
    """Spans as JSON lines in one file (appended; the run directory's ``traces/``)."""

    def __init__(self, path: Path, service: str, max_bytes: int) -> None:
        self.path, self.service, self.max_bytes = path, service, max_bytes
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", encoding="utf-8")
        self._size = path.stat().st_size
        self._full = False
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = "".join(json.dumps(span_record(s, self.service), separators=(",", ":")) + "\n" for s in spans)
        with self._lock:
            if self._full:
                return SpanExportResult.SUCCESS
            if self._size + len(lines) > self.max_bytes:
                self._full = True
                log.warning("traces: %s reached %d MB; later spans of this process are not written to it",
                            self.path, self.max_bytes >> 20)
                return SpanExportResult.SUCCESS
            self._file.write(lines)
            self._file.flush()
            self._size += len(lines)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            self._file.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def span_record(s: ReadableSpan, service: str) -> dict[str, Any]:
    """The JSON form of a finished span (what ``rlbus trace`` reads)."""
    ctx = s.get_span_context()
    return {
        "trace_id": f"{ctx.trace_id:032x}", "span_id": f"{ctx.span_id:016x}",
        "parent_id": f"{s.parent.span_id:016x}" if s.parent is not None else None,
        "name": s.name, "service": service, "kind": s.kind.name.lower(),
        "start_ns": s.start_time, "end_ns": s.end_time,
        "status": s.status.status_code.name.lower(),
        "attributes": {k: v if isinstance(v, (str, int, float, bool)) else list(v)
                       for k, v in (s.attributes or {}).items()},
        "links": [{"trace_id": f"{link.context.trace_id:032x}", "span_id": f"{link.context.span_id:016x}"}
                  for link in s.links],
    }


def _otlp_exporter() -> SpanExporter:
    protocol = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or "http/protobuf").lower()
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter()
    if protocol in ("http/protobuf", "http"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        return HttpExporter()
    raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: rlbus exports traces over 'grpc' or 'http/protobuf'")


def setup(service: str, run_dir: str | os.PathLike[str] | None = None) -> trace.Tracer:
    """Install the tracer provider for this process (idempotent): the run directory's trace file, and the
    exporters ``OTEL_TRACES_EXPORTER`` names."""
    global _tracer, _provider
    if _tracer is not None:
        return _tracer
    sampler = None  # OTEL_TRACES_SAMPLER (and _ARG), when set, is read by the SDK itself
    if "OTEL_TRACES_SAMPLER" not in os.environ:
        # by default one prompt group in DEFAULT_GROUP_RATIO is traced (its whole trace: parent-based), and so
        # is the same share of train steps: every span of every sample costs the hot path (BENCHMARKS.md)
        sampler = ParentBased(TraceIdRatioBased(DEFAULT_GROUP_RATIO))
    provider = TracerProvider(resource=Resource.create({"service.name": f"rlbus-{service}"}), sampler=sampler)
    if run_dir is not None and os.environ.get("RLBUS_TRACES_FILE", "1") != "0":
        path = Path(run_dir) / "traces" / f"{service}-{os.getpid()}.jsonl"
        try:
            max_bytes = int(float(os.environ.get("RLBUS_TRACES_FILE_MB", "256")) * (1 << 20))
            provider.add_span_processor(BatchSpanProcessor(_Guarded("file", JsonlSpanExporter(path, service,
                                                                                               max_bytes))))
        except (OSError, ValueError) as e:
            log.warning("traces: no trace file (%s: %s); the run goes on", path, e)
    for name in filter(None, (e.strip() for e in os.environ.get("OTEL_TRACES_EXPORTER", "none").lower().split(","))):
        if name == "none":
            continue
        try:
            inner = ConsoleSpanExporter() if name == "console" else _otlp_exporter() if name == "otlp" else None
        except ImportError:
            log.warning("OTEL_TRACES_EXPORTER=otlp but the OTLP exporter is not installed: pip install 'rlbus[otel]'")
            continue
        except ValueError as e:
            log.warning("traces: %s", e)
            continue
        if inner is None:
            log.warning("OTEL_TRACES_EXPORTER names %r, which rlbus does not know (otlp, console, none)", name)
            continue
        provider.add_span_processor(BatchSpanProcessor(_Guarded(name, inner)))
    trace.set_tracer_provider(provider)
    _provider = provider
    _tracer = trace.get_tracer("rlbus")
    return _tracer


def shutdown(timeout_s: float = 5.0) -> None:
    """Flush the spans still queued (bounded by ``timeout_s``) and close the exporters."""
    global _tracer, _provider
    provider, _provider, _tracer = _provider, None, None
    if provider is None:
        return
    done = threading.Event()

    def flush() -> None:
        with contextlib.suppress(Exception):
            provider.force_flush(int(timeout_s * 1000))
            provider.shutdown()
        done.set()

    threading.Thread(target=flush, name="rlbus-traces-flush", daemon=True).start()
    if not done.wait(timeout_s + 1.0):
        log.warning("traces: flushing took over %.0fs; the last spans may be lost", timeout_s)


def tracer() -> trace.Tracer:
    return _tracer if _tracer is not None else trace.get_tracer("rlbus")


def inject(headers: dict[str, str]) -> None:
    """Write the current trace context (``traceparent``) into NATS headers."""
    propagate.inject(headers)


def extract(headers: Mapping[str, str] | None) -> otel_context.Context:
    return propagate.extract(dict(headers or {}))


def traceparent() -> str:
    """The current span's context as a W3C ``traceparent`` string ("" outside any span)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier.get("traceparent", "")


def link_to(traceparents: Iterator[str] | Sequence[str]) -> list[trace.Link]:
    """Span links to the given ``traceparent`` strings (empty ones skipped): a span serving many."""
    links = []
    for tp in traceparents:
        if tp:
            ctx = trace.get_current_span(extract({"traceparent": tp})).get_span_context()
            if ctx.is_valid:
                links.append(trace.Link(ctx))
    return links


@contextlib.contextmanager
def span(name: str, kind: str = "internal", headers: Mapping[str, str] | None = None,
         links: Sequence[trace.Link] | None = None, root: bool = False, **attrs: Any) -> Iterator[Any]:
    """A span, parented on the trace context in ``headers`` when given; ``root``: the first span of a new
    trace, whatever the current context; ``links``: other spans this one serves."""
    ctx = otel_context.Context() if root else extract(headers) if headers is not None else None
    with tracer().start_as_current_span(name, context=ctx, kind=_KINDS[kind], links=links,
                                        attributes=attrs or None) as s:
        yield s
