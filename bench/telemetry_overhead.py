"""The cost of telemetry: the default example (``examples/addition.toml``) with tracing and metrics all on vs
all off, the same steps, alternating in one invocation (this machine is shared: pairs, not single runs).

* on: spans to the run directory's trace files *and* over OTLP/HTTP to a receiver in this process (which
  decodes nothing, it only counts the requests), every service's Prometheus endpoint
  (``[common] metrics_port``) scraped every 2 s by this process;
* off: ``RLBUS_TRACES_FILE=0``, ``OTEL_TRACES_EXPORTER=none``, no metrics endpoint.

Figure: seconds per trainer step (trainer clock, first to last step) of each run; ``overhead`` is the mean
of on/off over the pairs (goal <= 1.03). Last stdout line: one JSON object.

    python bench/telemetry_overhead.py                 # 2 pairs of 200 steps
    python bench/telemetry_overhead.py --steps 60 --pairs 1 --quick-check   # a smoke run (figure not meaningful)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import statistics
import sys
import tempfile
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._rlbus_runs import run_rlbus  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Receiver:
    """Accepts OTLP/HTTP posts and counts them (and their bytes)."""

    def __init__(self) -> None:
        self.requests = self.bytes = 0
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                n = int(self.headers.get("Content-Length", 0))
                self.rfile.read(n)
                receiver.requests += 1
                receiver.bytes += n
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


class Scraper:
    """Scrapes ports base..base+7 every ``period`` seconds while running (what a Prometheus server does)."""

    def __init__(self, base: int, period: float = 2.0) -> None:
        self.base, self.period, self.scrapes = base, period, 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(self.period):
            for port in range(self.base, self.base + 8):
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1) as r:
                        r.read()
                    self.scrapes += 1
                except OSError:
                    pass

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--quick-check", action="store_true", help="say the figure is not meaningful (smoke run)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    receiver = Receiver()
    common = {"services.trainer.total_steps": args.steps, "services.trainer.max_wall_s": 0,
              "services.trainer.eval.every": 0, "services.trainer.checkpoint_every": 0}
    per_step: dict[str, list[float]] = {"on": [], "off": []}
    scrapes = 0
    with tempfile.TemporaryDirectory() as tmp:
        for pair in range(args.pairs):
            for side in (("off", "on") if pair % 2 == 0 else ("on", "off")):
                overrides = dict(common)
                env = {"RLBUS_TRACES_FILE": "0", "OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none"}
                scraper = None
                if side == "on":
                    base = free_port()
                    overrides["common.metrics_port"] = base
                    env = {"RLBUS_TRACES_FILE": "1", "OTEL_TRACES_EXPORTER": "otlp",
                           "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
                           "OTEL_METRICS_EXPORTER": "none"}
                    scraper = Scraper(base)
                try:
                    result = run_rlbus(f"telemetry-{side}-{pair}", Path(tmp) / f"{side}-{pair}", overrides, env=env)
                finally:
                    if scraper is not None:
                        scraper.close()
                        scrapes += scraper.scrapes
                per_step[side].append(result.stats["s_per_step"])
                print(f"pair {pair + 1} {side:3s}: {result.stats['steps']} steps, {result.stats['s_per_step']:.4f} "
                      f"s/step", file=sys.stderr)
    ratios = [on / off for on, off in zip(per_step["on"], per_step["off"], strict=True)]
    print(json.dumps({
        "overhead": round(statistics.mean(ratios), 4), "ratios": [round(r, 4) for r in ratios],
        "s_per_step_on": per_step["on"], "s_per_step_off": per_step["off"], "steps": args.steps,
        "pairs": args.pairs, "otlp_requests": receiver.requests, "otlp_bytes": receiver.bytes,
        "metric_scrapes": scrapes, "meaningful": not args.quick_check,
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }))


if __name__ == "__main__":
    main()
