"""The rollout service's configuration (section ``[services.rollout]``). No ML imports."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from services.weightsync.config import ObjStoreConfig, StoreConfig

Pos = Annotated[int, msgspec.Meta(ge=1)]


class TorchEngineSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, tag_field="type", tag="torch"):
    """The transformers engine with continuous batching (CPU or GPU)."""

    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    #: torch device; empty picks cuda when available
    device: str = ""
    #: most sequences decoded together
    max_batch_size: Pos = 128
    #: torch intra-op threads (0: torch's default)
    num_threads: Annotated[int, msgspec.Meta(ge=0)] = 0
    #: apply new weights between decode steps (in_flight) or only when no request runs
    weight_update_mode: Literal["in_flight", "between_requests"] = "in_flight"


EngineSection = TorchEngineSection


class RolloutConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    #: builtin model (tiny-addition, smollm2) or a Hugging Face directory (must match the trainer's)
    model: str = "tiny-addition"
    #: where builtin models are cached (default ~/.cache/rlbus or $RLBUS_CACHE)
    cache_dir: str = ""
    #: the inference engine, chosen by `type`
    engine: EngineSection = msgspec.field(default_factory=TorchEngineSection)
    #: prompt tickets worked on at once (each runs group_size agent loops concurrently)
    max_tickets: Pos = 64
    #: seconds between metrics reports (pending requests, tokens/s)
    report_every_s: Annotated[float, msgspec.Meta(gt=0)] = 2.0
    #: seconds to wait for the trainer's first weight version before serving anyway
    initial_weights_timeout_s: Annotated[float, msgspec.Meta(ge=0)] = 600.0
    #: seconds a ticket waits for the engine to reach the ticket's admission version
    version_wait_s: Annotated[float, msgspec.Meta(gt=0)] = 120.0
    #: seconds without an announcement after which the latest version is re-read (missed announcements)
    weights_recheck_s: Annotated[float, msgspec.Meta(gt=0)] = 10.0
    #: weight store (must match the trainer's)
    store: StoreConfig = msgspec.field(default_factory=ObjStoreConfig)
