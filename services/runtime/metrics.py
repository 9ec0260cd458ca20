"""OpenTelemetry metrics of a service, on a Prometheus endpoint and over OTLP.

Every figure a service keeps as a heartbeat gauge (``ctx.gauges``: the rollout's pending requests and
tokens/s, the trainer's step time split and staleness, the sandbox's live sandboxes, ...) becomes an
observable gauge named ``rlbus_<name>`` (``/`` and other characters become ``_``), labelled with the
service and instance; the runtime adds counters (messages handled per consumer and outcome, dead letters
per reason; each durable consumer's queue depth and lag, :mod:`services.runtime.lag`, through the labelled
:func:`gauge`) and services add histograms (:func:`histogram`: the trainer's staleness, the sandbox's
request latency by verb).

Where they go:

* ``[common] metrics_port = N`` (0, the default: no endpoint): a Prometheus endpoint at
  ``http://<host>:N/metrics``. Several services of one host (``rlbus run``) take the next free port
  above N; each says which in its log and its heartbeat (gauge ``metrics_port``), so ``rlbus status``
  shows them. A Kubernetes pod gets N itself.
* ``OTEL_METRICS_EXPORTER=otlp``: OTLP export every ``OTEL_METRIC_EXPORT_INTERVAL`` ms (the ``otel`` extra;
  protocol and endpoint from the standard ``OTEL_EXPORTER_OTLP_*`` variables).

Metrics never hurt the run: export happens in the exporters' own threads; a port that cannot be bound
or an exporter that is missing is one warning, and the service runs without it.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

from opentelemetry import metrics as otel_metrics
from opentelemetry.metrics import CallbackOptions, Observation

log = logging.getLogger("rlbus.metrics")

_provider: Any = None
_meter: otel_metrics.Meter = otel_metrics.NoOpMeter("rlbus")
_labels: dict[str, str] = {}
_gauges: dict[str, Any] = {}
_instruments: dict[str, Any] = {}
_gauge_values: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
_PORT_TRIES = 64


def metric_name(key: str) -> str:
    """``rollout/tokens_per_s`` -> ``rlbus_rollout_tokens_per_s`` (Prometheus' character set)."""
    return "rlbus_" + re.sub(r"[^a-zA-Z0-9_]", "_", key).strip("_")


def setup(service: str, instance: str, port: int = 0) -> int | None:
    """Install this process's meter provider (idempotent); returns the Prometheus port bound, if any."""
    global _provider, _meter
    if _provider is not None:
        return None
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.resources import Resource

    readers: list[Any] = []
    bound = None
    if port:
        bound = _prometheus(readers, port)
    if os.environ.get("OTEL_METRICS_EXPORTER", "none").lower() == "otlp":
        try:
            readers.append(_otlp_reader())
        except ImportError:
            log.warning("OTEL_METRICS_EXPORTER=otlp but the OTLP exporter is not installed: pip install 'rlbus[otel]'")
    _labels.update(service=service, instance=instance)
    if not readers:
        return None
    _provider = MeterProvider(resource=Resource.create({"service.name": f"rlbus-{service}",
                                                        "service.instance.id": instance}),
                              metric_readers=readers)
    _meter = _provider.get_meter("rlbus")
    _instruments.clear()  # made on the no-op meter before: made again on this one at their next use
    return bound


def _prometheus(readers: list[Any], port: int) -> int | None:
    try:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import start_http_server
    except ImportError:
        log.warning("metrics_port is set but opentelemetry-exporter-prometheus is not installed: "
                    "pip install 'rlbus[otel]'; no metrics endpoint")
        return None
    for candidate in range(port, port + _PORT_TRIES):
        try:
            start_http_server(candidate)
        except OSError:
            continue
        readers.append(PrometheusMetricReader(scope_info_enabled=False))
        log.info("metrics: Prometheus endpoint on http://0.0.0.0:%d/metrics", candidate)
        return candidate
    log.warning("metrics: no free port in %d..%d; no metrics endpoint", port, port + _PORT_TRIES - 1)
    return None


def _otlp_reader() -> Any:
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

    protocol = (os.environ.get("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or "http/protobuf").lower()
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    return PeriodicExportingMetricReader(OTLPMetricExporter())


def active() -> bool:
    """Whether this process exports metrics (an endpoint or OTLP): figures that cost a request to get
    (:mod:`services.runtime.lag`) are only fetched then."""
    return _provider is not None


def follow_gauges(gauges: Mapping[str, float]) -> None:
    """Export every key of ``gauges`` (a service's heartbeat gauges) as an observable gauge; call again when
    keys were added (the heartbeat loop does)."""
    if _provider is None:
        return
    for key in list(gauges):
        if key in _gauges:
            continue

        def observe(options: CallbackOptions, key: str = key) -> list[Observation]:
            value = gauges.get(key)
            return [] if value is None else [Observation(float(value), _labels)]

        _gauges[key] = _meter.create_observable_gauge(metric_name(key), callbacks=[observe])


def counter(name: str, description: str = "") -> Callable[..., None]:
    """``add(amount=1, **labels)`` on the counter ``rlbus_<name>_total`` (a no-op without metrics). The
    instrument is looked up at each call, so counters made before :func:`setup` count once it ran."""
    key = "counter:" + name

    def add(amount: float = 1, **labels: str) -> None:
        instrument = _instruments.get(key)
        if instrument is None:
            instrument = _instruments[key] = _meter.create_counter(metric_name(name), description=description)
        instrument.add(amount, {**_labels, **labels})
    return add


def gauge(name: str, description: str = "") -> Callable[..., None]:
    """``set(value, **labels)`` on the observable gauge ``rlbus_<name>``: each label set keeps its last value
    (the consumers' pending and ack-pending counts, per consumer). A no-op without metrics."""
    key = "gauge:" + name
    values = _gauge_values.setdefault(key, {})

    def observe(options: CallbackOptions) -> list[Observation]:
        return [Observation(v, dict(labels)) for labels, v in list(values.items())]

    def set_value(value: float, **labels: str) -> None:
        if _provider is None:
            return
        values[tuple(sorted({**_labels, **labels}.items()))] = float(value)
        if key not in _instruments:
            _instruments[key] = _meter.create_observable_gauge(metric_name(name), callbacks=[observe],
                                                               description=description)
    return set_value


def histogram(name: str, description: str = "", unit: str = "") -> Callable[..., None]:
    """``record(value, **labels)`` on the histogram ``rlbus_<name>`` (a no-op without metrics)."""
    key = "histogram:" + name

    def record(value: float, **labels: str) -> None:
        instrument = _instruments.get(key)
        if instrument is None:
            instrument = _instruments[key] = _meter.create_histogram(metric_name(name), description=description,
                                                                     unit=unit)
        instrument.record(value, {**_labels, **labels})
    return record


def shutdown() -> None:
    global _provider
    provider, _provider = _provider, None
    if provider is not None:
        try:
            provider.shutdown(timeout_millis=3000)
        except Exception as e:
            log.debug("metrics shutdown: %s", e)
