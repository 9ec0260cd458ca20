"""``rlbus service sandbox`` with ``[common] metrics_port`` serves the backend's create and exec latency
(histogram ``rlbus_sandbox_request_seconds`` by verb) on its Prometheus endpoint; scraped after real
requests, the counts move with each request."""

from __future__ import annotations

import asyncio
import signal
import urllib.request

from prometheus_client.parser import text_string_to_metric_families
from sbx_bus import RUN, BusHarness, start_service, stop_process

from tests.conftest import free_port, wait_for_async


def _scrape(port: int) -> dict[tuple[str, str], float] | None:
    """``(sample name, verb) -> value`` of the latency histogram, or None when nothing answers."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return None
    return {(s.name, s.labels.get("verb", "")): s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name.startswith("rlbus_sandbox_request_seconds")}


async def test_create_and_exec_latency_on_the_endpoint(nats_url, state_root, tmp_path):
    port = free_port()
    cfg = tmp_path / "run.toml"
    cfg.write_text(f'[run]\nid = "{RUN}"\n[nats]\nurl = "{nats_url}"\n'
                   f'[common]\ndrain_timeout_s = 5.0\nheartbeat_s = 0.5\nmetrics_port = {port}\n'
                   f'[services.sandbox]\nroot_dir = "{state_root}"\n')
    proc = start_service(str(cfg), str(tmp_path / "service.log"))
    try:
        async with BusHarness(nats_url, state_root) as h:
            await h.client.wait_ready(timeout_s=60)
            sid = (await h.client.create()).sandbox_id
            assert (await h.client.exec(sid, "echo one")).stdout == b"one\n"

            async def counts(create: float, exec_: float) -> dict | None:
                got = await asyncio.to_thread(_scrape, port)
                return got if got and got.get(("rlbus_sandbox_request_seconds_count", "create")) == create \
                    and got.get(("rlbus_sandbox_request_seconds_count", "exec")) == exec_ else None

            first = await wait_for_async(lambda: counts(1, 1), 30, "one create and one exec on the endpoint",
                                          interval=0.5)
            assert first[("rlbus_sandbox_request_seconds_sum", "create")] > 0
            assert first[("rlbus_sandbox_request_seconds_sum", "exec")] > 0
            assert ("rlbus_sandbox_request_seconds_bucket", "exec") in first
            for i in range(2):
                assert (await h.client.exec(sid, f"echo {i}")).stdout == f"{i}\n".encode()
            moved = await wait_for_async(lambda: counts(1, 3), 30, "the exec count to move to 3", interval=0.5)
            assert moved[("rlbus_sandbox_request_seconds_sum", "exec")] > first[("rlbus_sandbox_request_seconds_sum", "exec")]
            await h.client.destroy(sid)
    finally:
        code = stop_process(proc, signal.SIGTERM)
    assert code == 0, (tmp_path / "service.log").read_text()[-3000:]
