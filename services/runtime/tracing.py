"""OpenTelemetry tracing, set up once per process; context carried in NATS headers.

Exporter by ``OTEL_TRACES_EXPORTER``: ``console`` prints spans, ``otlp`` uses the
OTLP exporter if installed, anything else (default ``none``) records spans
without exporting (cheap, and trace ids still flow through headers).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

log = logging.getLogger("rlbus.tracing")
_tracer: trace.Tracer | None = None

_KINDS = {
    "internal": trace.SpanKind.INTERNAL,
    "producer": trace.SpanKind.PRODUCER,
    "consumer": trace.SpanKind.CONSUMER,
}


def setup(service: str) -> trace.Tracer:
    """Install the tracer provider for this process (idempotent)."""
    global _tracer
    if _tracer is not None:
        return _tracer
    provider = TracerProvider(resource=Resource.create({"service.name": f"rlbus-{service}"}))
    exporter = os.environ.get("OTEL_TRACES_EXPORTER", "none").lower()
    if exporter == "console":
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    elif exporter == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError:
            log.warning("OTEL_TRACES_EXPORTER=otlp but opentelemetry-exporter-otlp is not installed")
        else:
            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    _tracer = trace.get_tracer("rlbus")
    return _tracer


def tracer() -> trace.Tracer:
    return _tracer if _tracer is not None else trace.get_tracer("rlbus")


def inject(headers: dict[str, str]) -> None:
    """Write the current trace context (``traceparent``) into NATS headers."""
    propagate.inject(headers)


def extract(headers: Mapping[str, str] | None) -> otel_context.Context:
    return propagate.extract(dict(headers or {}))


@contextlib.contextmanager
def span(name: str, kind: str = "internal", headers: Mapping[str, str] | None = None, **attrs: Any) -> Iterator[Any]:
    """A span, parented on the trace context in ``headers`` when given."""
    ctx = extract(headers) if headers is not None else None
    with tracer().start_as_current_span(name, context=ctx, kind=_KINDS[kind], attributes=attrs or None) as s:
        yield s
