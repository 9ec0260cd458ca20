"""``rlbus up``'s own autoscaler: the signal KEDA's NATS JetStream scaler uses, applied locally.

Off by default. ``[launcher] autoscale = { rollout = { min = 1, max = 4, target_pending = 8 } }`` sizes
the rollout fleet on the lag of its durable consumer (messages not yet delivered plus delivered but not
yet acked: the work outstanding), like KEDA: ``desired = ceil(lag / target_pending)``, clamped to
``[min, max]``. Scaling up happens at once; scaling down only after the lag has allowed it for
``cooldown_s`` (removed workers drain, and what they held is redelivered, so nothing is lost, but churn
costs model loads). :func:`desired_count` is the whole decision, pure; the supervisor polls the consumer
and applies it through :meth:`Supervisor.scale`.
"""

from __future__ import annotations

import math
from typing import Annotated

import msgspec

from proto import catalog


class AutoscaleRule(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How one service's worker count follows its consumer's lag."""

    #: fewest workers (0 allowed: the fleet stops when there is no work)
    min: Annotated[int, msgspec.Meta(ge=0, le=64)] = 1
    #: most workers
    max: Annotated[int, msgspec.Meta(ge=1, le=64)] = 4
    #: outstanding messages one worker should have (KEDA's lagThreshold)
    target_pending: Annotated[int, msgspec.Meta(ge=1)] = 16
    #: seconds between looks at the consumer
    period_s: Annotated[float, msgspec.Meta(gt=0)] = 5.0
    #: seconds the lag must allow fewer workers before any is removed
    cooldown_s: Annotated[float, msgspec.Meta(ge=0)] = 60.0


#: the durable consumer whose lag sizes each scalable service
CONSUMERS: dict[str, catalog.ConsumerDef] = {
    "rollout": catalog.ROLLOUT_PROMPTS,
    "judge": catalog.JUDGE_ROLLOUTS,
}


def desired_count(current: int, lag: int, rule: AutoscaleRule, low_since: float | None,
                  now: float) -> tuple[int, float | None]:
    """The worker count to run now and the new ``low_since`` (when the lag first allowed fewer workers,
    or None). ``current`` workers run, ``lag`` messages are outstanding."""
    want = min(max(math.ceil(lag / rule.target_pending), rule.min), rule.max)
    if want >= current:
        return want, None
    if low_since is None:
        return current, now
    if now - low_since >= rule.cooldown_s:
        return want, None
    return current, low_since
