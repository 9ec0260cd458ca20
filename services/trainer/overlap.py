"""A step's publish and commit beside the next learner step (``overlap_publish``, on by default).

The loop hands each step's "send its version, then commit its batch" here: run in the background while the
next batch is collected and trained on, or awaited at once when overlapping is off. At most one is in the
background: the next step :meth:`Overlap.settle`\\ s it before it moves the state (step, version), so the state
saved, the outcomes and the acks are exactly those of the serial loop. Overlapping needs a copy of the weights
the next step cannot change (``Learner.snapshot``), and never happens while colocated engines sleep in this
process (they take the device between steps: :mod:`services.lib.colocation`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

from services.lib.colocation import DEVICE_SHARE

log = logging.getLogger("rlbus.trainer")


class Overlap:
    """The last step's publish and commit, while it runs in the background."""

    def __init__(self, enabled: bool) -> None:
        """``enabled``: ``overlap_publish``."""
        self.enabled = enabled
        self._pending: asyncio.Task[None] | None = None

    def now(self) -> bool:
        """Whether this step's publish overlaps the next step (never while colocated engines sleep)."""
        return self.enabled and DEVICE_SHARE.engines == 0

    async def hand_off(self, work: Coroutine[Any, Any, None], background: bool, name: str) -> None:
        """Run ``work`` (a step's publish and commit) as the task ``name`` in the ``background``, else now."""
        if background:
            self._pending = asyncio.create_task(work, name=name)
        else:
            await work

    async def settle(self, quiet: bool = False) -> None:
        """Wait for the previous step's publish and commit; its error is raised (``quiet``: logged)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            await pending
        except Exception:
            if not quiet:
                raise
            log.exception("sending the last version or committing its batch failed")
