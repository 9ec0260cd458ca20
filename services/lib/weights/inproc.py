"""Colocated trainer and engine in one process: weights are handed over as tensors, not bytes.

The sender puts the trainer's tensors on a named in-process channel, cloned by
default (``snapshot=True``: the learner changes its tensors in place on the next
step, and the sender leaves the caller free to do so once ``send`` returns);
``snapshot=False`` hands the very tensors over (same storage), and the engine
must then apply a version before the trainer changes its weights again.
Receivers wake up and get the channel's newest version. Nothing is serialised
or copied through the bus. All parties run on one asyncio event loop.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import AsyncIterator, Mapping

import torch

from services.lib.weights.transport import Weights, follow
from services.runtime import tracing
from services.runtime.weights_config import InprocConfig


class InprocChannel:
    """The newest version on one named channel and a condition receivers wait on."""

    def __init__(self) -> None:
        self.version: int | None = None
        self.tensors: dict[str, torch.Tensor] = {}
        self.traceparent = ""  # the sender's span when it put the newest version
        self.changed = asyncio.Condition()

    async def put(self, version: int, tensors: dict[str, torch.Tensor], traceparent: str = "") -> None:
        async with self.changed:
            if self.version is not None and version <= self.version:
                raise ValueError(f"inproc version {version} is not newer than {self.version}")
            self.version, self.tensors, self.traceparent = version, tensors, traceparent
            self.changed.notify_all()

    async def newer_than(self, held: int | None) -> tuple[int, dict[str, torch.Tensor]]:
        async with self.changed:
            await self.changed.wait_for(
                lambda: self.version is not None and (held is None or self.version > held)
            )
            return self.version, self.tensors  # type: ignore[return-value]


# per event loop (an asyncio.Condition belongs to one loop), then per (run id, channel name)
_CHANNELS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple[str, str], InprocChannel]] = (
    weakref.WeakKeyDictionary()
)


def channel(run_id: str, name: str) -> InprocChannel:
    """Channel ``name`` of run ``run_id`` on the running event loop (created on first use)."""
    per_loop = _CHANNELS.setdefault(asyncio.get_running_loop(), {})
    return per_loop.setdefault((run_id, name), InprocChannel())


class InprocSender:
    """:class:`~services.lib.weights.transport.WeightSender` for a colocated engine."""

    def __init__(self, config: InprocConfig, run_id: str) -> None:
        self.config = config
        self.run_id = run_id

    async def start(self) -> None:
        """Nothing to set up."""

    async def send(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        tensors = {
            k: (t.detach().clone() if self.config.snapshot else t.detach()) for k, t in state_dict.items()
        }
        await channel(self.run_id, self.config.channel).put(version, tensors, tracing.traceparent())

    async def latest(self) -> Weights | None:
        """None: a channel keeps nothing across a restart of the process."""
        return None

    async def close(self) -> None:
        """Nothing to release."""


class InprocReceiver:
    """:class:`~services.lib.weights.transport.WeightReceiver` for a colocated engine."""

    def __init__(self, config: InprocConfig, run_id: str) -> None:
        self.config = config
        self.run_id = run_id
        self._version: int | None = None
        self.refused = 0  # nothing is verified in process: never refused
        self.last_error = ""
        self.traces: dict[int, str] = {}  # per version, the sender's traceparent (the latest only)
        self.digests: dict[int, str] = {}  # nothing is verified in process: no digest

    @property
    def version(self) -> int | None:
        return self._version

    def __aiter__(self) -> AsyncIterator[Weights]:
        return follow(self, None)

    async def start(self) -> None:
        """Nothing to set up."""

    async def receive(self) -> tuple[int, dict[str, torch.Tensor]]:
        chan = channel(self.run_id, self.config.channel)
        version, tensors = await chan.newer_than(self._version)
        self._version = version
        self.traces = {version: chan.traceparent}
        return version, dict(tensors)

    async def close(self) -> None:
        """Nothing to release."""
