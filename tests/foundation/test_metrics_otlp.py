"""``OTEL_METRICS_EXPORTER=otlp`` exports a service's metrics to a real OTLP/HTTP receiver started here
(the protobuf decoded with opentelemetry-proto): a durable consumer's queue depth and lag read from a real
nats-server (``services/runtime/lag.py``), a failed refresh counted, not raised, and a latency histogram."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

from tests.otlp_receiver import OtlpReceiver

REPO = Path(__file__).resolve().parents[2]

# a process of its own: the meter provider is per process
SCRIPT = textwrap.dedent("""
    import asyncio, sys
    import nats
    from proto import catalog
    from services.runtime import bus, lag, metrics

    async def main(url):
        metrics.setup("unit", "u0")
        nc = await nats.connect(url)
        js = nc.jetstream()
        await bus.provision_all(js)
        cdef = catalog.ECHO_IN.for_run("otlp")
        await bus.ensure_consumer(js, cdef)
        for i in range(3):
            await js.publish("rlbus.otlp.echo.in", b"x%d" % i)
        assert await lag.sample(js, cdef)
        missing = catalog.ConsumerDef(stream=cdef.stream, durable="nobody-otlp", filter_subject=cdef.filter_subject)
        assert not await lag.sample(js, missing, timeout_s=2.0)  # counted, not raised
        metrics.histogram("sandbox_request_seconds", unit="s")(0.25, verb="exec")
        await nc.close()
        metrics.shutdown()  # flushes the periodic reader: one export at least

    asyncio.run(main(sys.argv[1]))
""")


def decode_points(body: bytes) -> list[tuple[str, str, dict[str, str], float]]:
    """(service, metric, labels, value) of every data point of one ExportMetricsServiceRequest (POST /v1/metrics)."""
    got = []
    for rm in ExportMetricsServiceRequest.FromString(body).resource_metrics:
        service = next(a.value.string_value for a in rm.resource.attributes if a.key == "service.name")
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                kind = m.WhichOneof("data")
                for p in getattr(m, kind).data_points:
                    labels = {a.key: a.value.string_value for a in p.attributes}
                    got.append((service, m.name, labels, p.count if kind == "histogram" else (p.as_double or float(p.as_int))))
    return got


def test_otlp_exports_consumer_lag_and_latency(nats_url):
    receiver = OtlpReceiver(decode_points)
    try:
        env = {**os.environ, "PYTHONPATH": str(REPO), "OTEL_METRICS_EXPORTER": "otlp",
               "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
               "OTEL_METRIC_EXPORT_INTERVAL": "60000"}
        done = subprocess.run([sys.executable, "-c", SCRIPT, nats_url], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
    finally:
        receiver.close()
    points = {(name, labels.get("consumer", labels.get("verb", ""))): (service, labels, v)
              for service, name, labels, v in receiver.items}
    service, labels, pending = points[("rlbus_consumer_pending", "echo-otlp")]
    assert (service, labels["service"], labels["instance"], pending) == ("rlbus-unit", "unit", "u0", 3.0)
    assert points[("rlbus_consumer_ack_pending", "echo-otlp")][2] == 0.0
    assert points[("rlbus_consumer_info_failed", "nobody-otlp")][2] == 1.0
    assert points[("rlbus_sandbox_request_seconds", "exec")][2] == 1  # one recorded latency
