"""Metrics reports, for the progress display and anyone tapping the run.

Subject ``rlbus.<run>.metrics.<service>`` — published by services (trainer per
step, rollout/judge periodically), stored by stream METRICS, read by
``rlbus run``'s progress display and ``rlbus tap``.
"""

from __future__ import annotations

from proto.envelope import Envelope

FAMILY = "metrics"


class MetricsReport(Envelope, kw_only=True, tag="metrics"):
    service: str
    instance: str
    step: int = -1
    #: values named by path, e.g. ``eval/reward``, ``rollout/tokens_per_s``
    values: dict[str, float] = {}
