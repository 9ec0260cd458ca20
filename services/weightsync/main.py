"""Entry point of the weightsync service for the runtime harness (``rlbus service weightsync``).

Config section ``[services.weightsync]`` is a :class:`WeightsyncConfig`, e.g.::

    [services.weightsync]
    keep_anchors = 2
    relay = {scope = "node-a", store = {type = "fs", root = "/mnt/local/weights"}}

The launcher's service registry maps ``weightsync`` to ``(WeightsyncConfig, build)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from services.weightsync.config import WeightsyncConfig

if TYPE_CHECKING:
    from services.runtime.config import Loaded
    from services.runtime.service import ServiceContext

__all__ = ["WeightsyncConfig", "build"]


class WeightsyncRunner:
    """Adapts :class:`~services.weightsync.service.WeightsyncService` to the harness's ``run(ctx)``."""

    def __init__(self, config: WeightsyncConfig) -> None:
        self.config = config

    async def run(self, ctx: ServiceContext) -> None:
        from services.weightsync.service import WeightsyncService

        await WeightsyncService(ctx.nc, self.config).run(ctx.stop)


def build(loaded: Loaded) -> WeightsyncRunner:
    """The service for a resolved config; ``run_id`` defaults to the run's id."""
    config: WeightsyncConfig = loaded.service
    if not config.run_id:
        config = msgspec.structs.replace(config, run_id=loaded.run.id)
    return WeightsyncRunner(config)
