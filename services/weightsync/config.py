"""The weightsync service's configuration: retention of the trainer's versions and a relay near engines.

The upstream (the trainer's scope, store and HMAC key) is the run's ``[weights]`` section; stores are
configured as there (``services/runtime/weights_config.py``).
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from services.runtime.weights_config import ConfigError, ObjStoreConfig, StoreConfig


class RelayConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Re-publish every upstream version once into a local store, announced under a local scope."""

    #: scope local engines subscribe to (e.g. the node or region name)
    scope: str
    #: where local engines read chunks from
    store: StoreConfig = msgspec.field(default_factory=ObjStoreConfig)
    #: anchors kept in the local store (and the deltas after them)
    keep_anchors: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 2


class WeightsyncConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The weightsync service: retention of the trainer's versions and/or a relay near engines."""

    #: run whose versions this instance handles; empty = the run's id from the ``[run]`` section
    run_id: str = ""
    #: run retention on the upstream scope (exactly one weightsync instance per run should)
    gc_upstream: bool = True
    #: anchors kept upstream (and every delta after the oldest of them)
    keep_anchors: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 2
    #: relay into a local scope; None = no relay (retention only)
    relay: RelayConfig | None = None
    #: chunks transferred concurrently
    parallel: Annotated[int, msgspec.Meta(ge=1, le=64)] = 4
    #: seconds without an upstream announcement after which the relay reads the upstream's latest version
    #: itself and, if it is new, subscribes afresh (a watch across a dropped link can fall silent)
    recheck_s: Annotated[float, msgspec.Meta(gt=0)] = 10.0

    def __post_init__(self) -> None:
        if not self.gc_upstream and self.relay is None:
            raise ConfigError("weightsync with gc_upstream=false and no relay has nothing to do")
