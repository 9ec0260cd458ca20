"""A step's figures besides the learner's own (its loss, KL, ... come from :meth:`Learner.step`).

* the **version lag** of every trained sample: how many versions its oldest token is behind the trainer when
  the step is taken (the histogram ``trainer_staleness``; ``trainer/staleness_mean`` / ``_max`` in the step's
  metrics: the names keep "staleness", which the dashboard and the simulator's fit read). Unlike
  :func:`services.trainer.step_input.behind_freshest`, which measures it against the batch's freshest sample;
* the **batch's** figures: dynamic sampling's filtered groups and fraction (from the collector) and, in a
  mixture of environments (``[[task.mix]]``), each environment's reward and share of the batch
  (:func:`services.tasks.mixture.env_figures`);
* the **commit's** figures: the ledger's bookkeeping (version, totals, groups in flight, admission bound) and
  the weights sent (``weights/bytes``, ``weights/undelivered``);
* the time each part of a step took (``time/*_s``), measured with :func:`timed`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from services.runtime import metrics
from services.tasks.mixture import env_figures
from services.trainer.admission import Sample
from services.trainer.ledger import Ledger
from services.trainer.outbox import Versions

#: the trainer's version minus each trained sample's oldest-token version (its ``version_lag``)
_STALENESS = metrics.histogram("trainer_staleness", "versions between a trained sample's oldest token and the step")


def record_version_lag(samples: list[Sample], version: int) -> list[int]:
    """Versions each sample's oldest token is behind ``version`` (the trainer's, before the step moves it),
    each recorded in the ``trainer_staleness`` histogram."""
    lag = [version - s.version for s in samples]
    for v in lag:
        _STALENESS(v)
    return lag


def batch_figures(samples: list[Sample], collected: dict[str, float], mixture: bool) -> dict[str, float]:
    """``collected``: the collector's figures of the batch (dynamic sampling's filtered fraction); ``mixture``:
    each environment's reward and share of the batch too."""
    out = dict(collected)
    if mixture:
        out.update(env_figures([(s.item.rollout.task, s.item.reward) for s in samples]))
    return out


def commit_figures(ledger: Ledger, versions: Versions, version_lag: list[int]) -> dict[str, float]:
    """The bookkeeping's, the version lag's and the weights' figures once the step is committed."""
    return {**ledger.figures(), "trainer/staleness_mean": sum(version_lag) / len(version_lag),
            "trainer/staleness_max": float(max(version_lag)), "weights/bytes": float(versions.bytes),
            "weights/undelivered": float(versions.undelivered)}


@contextmanager
def timed(figures: dict[str, float], name: str) -> Iterator[None]:
    """``figures[name]``: the seconds the body took (not set when it raises)."""
    t0 = time.perf_counter()
    yield
    figures[name] = time.perf_counter() - t0
