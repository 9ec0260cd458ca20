"""Traces end to end: a short loop run (every service its own process) exports its spans over OTLP/HTTP to
a real receiver started here (the protobuf decoded with opentelemetry-proto) and to the run directory's
trace files; one prompt group's chain is complete: admission → rollout → judge graders → the trainer's
receipt → the train step that used it (a link) → the weight version it published → the engine applying
it (a link). ``rlbus trace`` prints that chain from the run directory. An unreachable collector costs
nothing but the dropped spans."""

from __future__ import annotations

import subprocess
import sys
import time
from collections import defaultdict

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from services.runtime import tracing
from tests.conftest import free_port, run_file
from tests.otlp_receiver import OtlpReceiver


def decode_spans(body: bytes) -> list[dict]:
    """The spans of one ExportTraceServiceRequest (POST /v1/traces), flattened."""
    got = []
    for rs in ExportTraceServiceRequest.FromString(body).resource_spans:
        service = next(a.value.string_value for a in rs.resource.attributes if a.key == "service.name")
        for ss in rs.scope_spans:
            for s in ss.spans:
                got.append({"service": service, "name": s.name, "trace_id": s.trace_id.hex(),
                            "span_id": s.span_id.hex(), "parent_id": s.parent_span_id.hex() or None,
                            "attributes": {a.key: a.value for a in s.attributes},
                            "links": [(link.trace_id.hex(), link.span_id.hex()) for link in s.links]})
    return got


@pytest.mark.slow
def test_one_group_is_traced_from_admission_to_the_engine_applying_its_step(tmp_path, loop_model_dir):
    receiver = OtlpReceiver(decode_spans)
    try:
        cfg = run_file(tmp_path, loop_model_dir, run_id="traced",
                       services={"trainer": 1, "rollout": 1, "judge": 1},
                       trainer={"groups_per_step": 2, "total_steps": 3, "max_staleness": 0,
                                "eval": {"prompts": 4}},
                       rollout={"max_tickets": 8})
        env = {**__import__("os").environ, "OTEL_TRACES_EXPORTER": "otlp",
               "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
               "OTEL_BSP_SCHEDULE_DELAY": "200", "OTEL_TRACES_SAMPLER": "always_on"}  # default: 1 group in 10
        r = subprocess.run([sys.executable, "-m", "services.launcher.cli", "run", str(cfg)], capture_output=True,
                           text=True, timeout=600, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
    finally:
        receiver.close()
    spans = receiver.items
    by_id = {s["span_id"]: s for s in spans}
    by_trace: dict[str, list[dict]] = defaultdict(list)
    for s in spans:
        by_trace[s["trace_id"]].append(s)

    def ancestors(s: dict) -> list[str]:
        names = []
        while s["parent_id"] in by_id:
            s = by_id[s["parent_id"]]
            names.append(f"{s['service']}:{s['name']}")
        return names

    # a training group's trace: its root is the trainer's admission, and the trainer's receipt of one of its
    # trajectories descends from the rollout's generation and the judge's graders, in that order
    admits = [s for s in spans if s["name"] == "admit group" and not s["attributes"]["eval"].bool_value]
    assert admits, {s["name"] for s in spans}
    complete = None
    for admit in admits:
        for s in by_trace[admit["trace_id"]]:
            if s["service"] == "rlbus-trainer" and s["name"].startswith("handle rlbus.traced.trajectories"):
                chain = ancestors(s)
                if any(n.startswith("rlbus-judge:grade") for n in [f"{x['service']}:{x['name']}"
                                                                    for x in by_trace[admit["trace_id"]]]):
                    complete = (admit, s, chain)
                    break
        if complete:
            break
    assert complete is not None, "no group trace reaches the trainer"
    admit, receipt, chain = complete
    assert chain[-1] == "rlbus-trainer:admit group", chain
    assert any(n.startswith("rlbus-rollout:handle rlbus.traced.prompts") for n in chain), chain
    assert any(n.startswith("rlbus-judge:handle rlbus.traced.rollouts") for n in chain), chain
    group_spans = {f"{s['service']}:{s['name']}" for s in by_trace[admit["trace_id"]]}
    assert "rlbus-rollout:generate group" in group_spans and any(n.startswith("rlbus-judge:grade ")
                                                                  for n in group_spans), group_spans
    # the train step that used the group links to the trainer's receipt; its publish is its child
    steps = [s for s in spans if s["name"] == "train step"
             and (receipt["trace_id"], receipt["span_id"]) in s["links"]]
    assert len(steps) == 1, [s["links"] for s in spans if s["name"] == "train step"]
    step = steps[0]
    publish = [s for s in by_trace[step["trace_id"]] if s["name"] == "publish weights"]
    assert publish and publish[0]["parent_id"] == step["span_id"]
    # the engine applying that version links into the step's trace
    applies = [s for s in spans if s["name"] == "apply weights" and s["service"] == "rlbus-rollout"
               and any(t == step["trace_id"] for t, _ in s["links"])]
    assert applies, [(s["attributes"].get("version"), s["links"]) for s in spans if s["name"] == "apply weights"]
    version = publish[0]["attributes"]["version"].int_value
    assert applies[0]["attributes"]["version"].int_value == version

    # the same chain from the run directory's trace files, through `rlbus trace`
    group_id = admit["attributes"]["group_id"].string_value
    out = subprocess.run([sys.executable, "-m", "services.launcher.cli", "trace", group_id, "--run-dir",
                          str(tmp_path / "run")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for piece in ("admit group", "generate group", "grade ", "trained in (linked): train step",
                  "publish weights", "applied by (linked): rollout", "apply weights"):
        assert piece in out.stdout, (piece, out.stdout[:3000])
    slow = subprocess.run([sys.executable, "-m", "services.launcher.cli", "trace", "--slowest", "2", "--run-dir",
                           str(tmp_path / "run")], capture_output=True, text=True, timeout=60)
    assert slow.returncode == 0 and slow.stdout.count("from admission to its last span") == 2, slow.stderr
    missing = subprocess.run([sys.executable, "-m", "services.launcher.cli", "trace", "no-such-group", "--run-dir",
                              str(tmp_path / "run")], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 1 and "no trace of group 'no-such-group'" in missing.stderr


def test_an_unreachable_collector_drops_spans_counted_and_bounded(caplog):
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    dead = f"http://127.0.0.1:{free_port()}/v1/traces"  # nothing listens there
    guarded = tracing._Guarded("otlp-test", OTLPSpanExporter(endpoint=dead, timeout=2))
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    with provider.get_tracer("t").start_as_current_span("x"):
        pass
    t0 = time.monotonic()
    for _ in range(3):
        result = guarded.export(memory.get_finished_spans())
    assert result.name == "FAILURE" and tracing.DROPPED["otlp-test"] == 3
    assert time.monotonic() - t0 < 60  # bounded by the exporter's timeout, not hanging
    assert sum("dropped" in r.getMessage() for r in caplog.records) == 1  # one warning, not one per batch
