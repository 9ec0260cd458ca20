"""The judge service's configuration (section ``[services.judge]``)."""

from __future__ import annotations

from typing import Annotated

import msgspec


class JudgeConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    #: rollouts graded at once by one judge process
    concurrency: Annotated[int, msgspec.Meta(ge=1)] = 64
    #: options per task name, passed to the task factory (must match the trainer's)
    task_options: dict[str, dict[str, int | float | str | bool]] = {}
