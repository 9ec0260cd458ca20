"""Every service of a run serves its metrics on a Prometheus endpoint (``[common] metrics_port``): a real
``rlbus run`` is scraped while it trains, and named series move (the trainer's version and trained count,
messages the consumers handled, the staleness histogram, the rollout's engine figures, each consumer's queue
depth and ack-pending lag, the trainer's wait for a batch) or are there (step time split, weight bytes)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import free_port, run_file, wait_for

REPO = Path(__file__).resolve().parents[2]


def scrape(port: int) -> list[tuple[str, dict[str, str], float]] | None:
    """The endpoint's samples ``(name, labels, value)``, or None when nothing answers there."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return None
    return [(s.name, dict(s.labels), s.value) for f in text_string_to_metric_families(text) for s in f.samples]


def value(samples: list | None, name: str, **labels: str) -> float | None:
    """The largest value of ``name`` among samples whose labels include ``labels`` (prefix match on
    values ending in ``*``); None when there is none."""
    def matches(have: dict[str, str]) -> bool:
        return all(have.get(k, "").startswith(v[:-1]) if v.endswith("*") else have.get(k) == v
                   for k, v in labels.items())
    found = [v for n, have, v in samples or [] if n == name and matches(have)]
    return max(found) if found else None


def names(samples: list | None) -> list[str]:
    return sorted({n for n, _, _ in samples or [] if n.startswith("rlbus_")})


@pytest.mark.slow
def test_each_service_serves_metrics_that_move(tmp_path, loop_model_dir):
    base = free_port()
    cfg = run_file(tmp_path, loop_model_dir, run_id="scraped", services={"trainer": 1, "rollout": 1, "judge": 1},
                   common={"metrics_port": base},
                   trainer={"groups_per_step": 2, "total_steps": 400, "max_wall_s": 240, "max_staleness": 1},
                   rollout={"max_tickets": 8})
    proc = subprocess.Popen([sys.executable, "-m", "services.launcher.cli", "run", str(cfg)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        def endpoints() -> dict[str, int] | None:
            """service -> port, once all three answer."""
            found = {}
            for port in range(base, base + 8):
                labels = [have for n, have, _ in scrape(port) or [] if n == "rlbus_metrics_port"]
                if labels:
                    found[labels[0]["service"]] = port
            return found if {"trainer", "rollout", "judge"} <= set(found) else None

        ports = wait_for(endpoints, 180, "the three services' metrics endpoints")
        assert len(set(ports.values())) == 3  # one host: each took its own port above the base

        def trainer_version() -> float | None:
            return value(scrape(ports["trainer"]), "rlbus_trainer_version")

        first = wait_for(trainer_version, 180, "the trainer's first step on its endpoint")
        wait_for(lambda: (trainer_version() or 0) > first + 1, 180, "the trainer's version series to move")
        trainer = scrape(ports["trainer"])
        assert (value(trainer, "rlbus_trainer_trained_total") or 0) > 0, names(trainer)
        assert (value(trainer, "rlbus_trainer_staleness_count") or 0) > 0, names(trainer)
        assert (value(trainer, "rlbus_trajectory_outcomes_total", outcome="trained") or 0) > 0, names(trainer)
        assert (value(trainer, "rlbus_messages_handled_total", consumer="trainer-*") or 0) > 0, names(trainer)
        for service in ("rollout", "judge"):
            scraped = scrape(ports[service])
            assert (value(scraped, "rlbus_messages_handled_total", consumer=f"{service}-*") or 0) > 0, \
                (service, names(scraped))
        # the rollout's engine figures come with its first report (every report_every_s)
        def rollout_reported() -> list | None:
            samples = scrape(ports["rollout"])
            return samples if value(samples, "rlbus_rollout_tokens_per_s") is not None else None

        rollout = wait_for(rollout_reported, 60, "the rollout's engine figures on its endpoint")
        assert value(rollout, "rlbus_rollout_pending_requests") is not None, names(rollout)
        assert value(rollout, "rlbus_metrics_port", service="rollout") == ports["rollout"]
        # the step time split: the wait for a batch beside compute, publish and commit; the bytes of each version
        for series in ("rlbus_time_wait_s", "rlbus_time_step_s", "rlbus_time_publish_s", "rlbus_time_commit_s"):
            assert value(trainer, series) is not None, (series, names(trainer))
        assert (value(trainer, "rlbus_weights_bytes") or 0) > 0, names(trainer)
        # queue depth and lag of every service's durable consumer (refreshed every few seconds), and they move
        seen: dict[str, set[float]] = {}

        def lag_moved() -> dict | None:
            for service in ("trainer", "rollout", "judge"):
                scraped = scrape(ports[service])
                for series in ("rlbus_consumer_pending", "rlbus_consumer_ack_pending"):
                    found = value(scraped, series, consumer=f"{service}-*")
                    if found is not None:
                        seen.setdefault(f"{service}:{series}", set()).add(found)
            wait = trainer_wait()
            seen.setdefault("trainer:wait", set()).update([] if wait is None else [wait])
            return seen if len(seen) == 7 and any(len(v) > 1 for k, v in seen.items() if "consumer" in k) \
                and len(seen["trainer:wait"]) > 1 else None

        def trainer_wait() -> float | None:
            return value(scrape(ports["trainer"]), "rlbus_time_wait_s")

        wait_for(lag_moved, 120, "each consumer's pending/ack-pending series and the wait time to move", interval=1.0)
        # every series the Grafana dashboard in deploy/ queries is one a service serves (failure counters
        # appear with their first event, so they are named here rather than observed)
        served = set(names(trainer)) | set(names(rollout)) | set(names(scrape(ports["judge"])))
        served |= {"rlbus_messages_failed_total", "rlbus_dead_letters_total"}
        # the sandbox's latency histogram: scraped in tests/sandbox/test_sandbox_metrics.py (no sandbox here)
        served |= {"rlbus_sandbox_request_seconds_bucket"}
        served |= {n.removesuffix("_count") + "_bucket" for n in served if n.endswith("_count")}
        dashboard = json.loads((REPO / "deploy" / "grafana" / "rlbus-dashboard.json").read_text())
        queried = {m for panel in dashboard["panels"] for t in panel["targets"]
                   for m in re.findall(r"rlbus_[a-z0-9_]+", t["expr"])}
        assert queried and queried <= served, sorted(queried - served)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode == 0, err[-3000:]
