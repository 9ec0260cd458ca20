"""The tracker service's configuration (section ``[services.tracker]``): where a run's metrics and
completions go (TensorBoard, Weights & Biases, trackio) and how much of them.

No ML dependency here: each backend's package is imported only by the backend that uses it
(``services/tracker/backends.py``), so a bad key is reported before anything heavy loads.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec


class TensorBoardBackend(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, tag="tensorboard"):
    """TensorBoard event files: scalars, and the completions table as a text (Markdown) summary."""

    #: directory of the event files; relative paths are under the run directory
    dir: str = "tensorboard"


class WandbBackend(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, tag="wandb"):
    """Weights & Biases: scalars and a ``wandb.Table`` per trainer step."""

    #: W&B project
    project: str = "rlbus"
    #: W&B entity (team or user); empty: the account's default
    entity: str = ""
    #: "offline" writes the run under ``dir`` and needs no network (``wandb sync`` uploads it later);
    #: "online" streams to the server (WANDB_BASE_URL / WANDB_API_KEY from the environment)
    mode: Literal["offline", "online"] = "offline"
    #: parent of W&B's ``wandb/`` directory; relative paths are under the run directory
    dir: str = "."
    #: seconds ``wandb.init`` may take before the backend is given up for this run
    init_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 90.0


class TrackioBackend(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, tag="trackio"):
    """trackio (a local, W&B-compatible tracker): scalars and a ``trackio.Table`` per trainer step."""

    #: trackio project
    project: str = "rlbus"
    #: trackio's database directory (TRACKIO_DIR); relative paths are under the run directory. The
    #: environment variable TRACKIO_DIR, when set, wins (trackio reads it once per process)
    dir: str = "trackio"


Backend = TensorBoardBackend | WandbBackend | TrackioBackend


class TrackerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The tracker: follows METRICS, TRAJECTORIES and OUTCOMES into experiment trackers.

    Telemetry never hurts the run: each backend writes from a thread of its own through a bounded
    queue, so a slow, hung or failing backend drops records (counted, with a rate-limited warning)
    and never blocks the tracker or the other backends.
    """

    #: where to write, chosen by ``type``: e.g. [{ type = "tensorboard" }, { type = "wandb" }]
    backends: list[Backend] = msgspec.field(default_factory=lambda: [TensorBoardBackend()])
    #: completion rows per trainer step in the completions table (a deterministic uniform sample of the
    #: trajectories trained in that step; 0: no table)
    rows_per_step: Annotated[int, msgspec.Meta(ge=0, le=1024)] = 8
    #: characters of prompt and of completion kept per row (the rest is cut, marked with "…")
    max_text_chars: Annotated[int, msgspec.Meta(ge=16, le=100_000)] = 2000
    #: records waiting per backend; beyond this new records are dropped (and counted)
    queue_size: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] = 10_000
    #: trajectories held while their outcome has not arrived; beyond this the oldest are forgotten
    max_waiting: Annotated[int, msgspec.Meta(ge=1, le=10_000_000)] = 20_000
    #: a step's table is written once outcomes of a later step arrive, or after this many seconds
    #: without news of the step
    table_after_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 30.0
    #: on stop: seconds to read what the streams already hold (the run's last step), then seconds the
    #: backends get to write what is queued; both within the launcher's stop_timeout_s
    catch_up_s: Annotated[float, msgspec.Meta(ge=0, le=600)] = 5.0
    flush_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=600)] = 8.0
    #: seconds between two warnings about one backend's dropped records
    warn_every_s: Annotated[float, msgspec.Meta(gt=0)] = 30.0
    #: seconds between the tracker's own metrics reports (tracker/...)
    report_every_s: Annotated[float, msgspec.Meta(gt=0)] = 10.0
