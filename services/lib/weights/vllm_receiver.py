"""The engine side of the ``vllm`` weight transport (:mod:`.vllm_transfer`): the rollout's vLLM engine
registered for the trainer's group (KV, nccl/gloo; or in this process, ipc), each handshake step the
trainer asks for run on it, and ``(version, {})`` yielded once a version is in (the engine applied it)."""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

from nats.aio.client import Client as NATS

from proto import catalog
from proto.codec import decode, encode
from proto.weights import VllmTransferEngine, VllmTransferReply, VllmTransferRequest, vllm_engine_key
from services.lib.weights.index import VersionIndex
from services.lib.weights.transport import Weights
from services.runtime.weights_config import ConfigError, VllmTransferConfig

log = logging.getLogger("rlbus.weightsync.vllm")

#: colocated engines of this process, by channel (the ipc backend's rendezvous)
_LOCAL: dict[str, Any] = {}
_LOCAL_CHANGED: dict[str, asyncio.Event] = {}


class VllmTransferError(RuntimeError):
    """A step of the vLLM weight transfer failed or timed out; the message says which and what to check."""


async def wait_local(channel: str, timeout_s: float) -> Any:
    """The receiver of the colocated engine registered under ``channel`` (bounded wait: the rollout may start later)."""
    event = _LOCAL_CHANGED.setdefault(channel, asyncio.Event())
    try:
        await asyncio.wait_for(event.wait(), timeout_s)
    except TimeoutError as err:
        raise VllmTransferError(f"no colocated vLLM engine registered on channel {channel!r} within {timeout_s}s; "
                                'weights.backend = "ipc" needs trainer+rollout in one process') from err
    return _LOCAL[channel]


class VllmReceiver:
    """:class:`~services.lib.weights.transport.WeightReceiver` of one vLLM engine: registers it, answers the
    trainer's handshake (the engine applies each version itself) and yields ``(version, {})`` per version."""

    def __init__(self, config: VllmTransferConfig, nc: NATS | None, run_id: str, engine: Any) -> None:
        if engine is None or not hasattr(engine, "transfer_step"):
            raise ConfigError('[weights] type = "vllm" needs the rollout\'s vllm engine '
                              '(services.rollout.engine type = "vllm")')
        if config.backend != "ipc" and nc is None:
            raise ValueError(f"the vllm transport ({config.backend}) needs a NATS connection for its control plane")
        self.config, self.nc, self.run_id, self.engine = config, nc, run_id, engine
        self.engine_id = uuid.uuid4().hex[:12]
        self.refused = 0
        self.last_error = ""
        self.traces: dict[int, str] = {}
        self.digests: dict[int, str] = {}
        self._applied: asyncio.Queue[int] = asyncio.Queue()
        self._version: int | None = None
        self._sub: Any = None
        self._steps: set[asyncio.Task] = set()  # handshake steps in flight

    @property
    def version(self) -> int | None:
        return self._version

    async def start(self) -> None:
        if self._sub is not None or _LOCAL.get(self.config.channel) is self:
            return
        if self.config.backend == "ipc":
            _LOCAL[self.config.channel] = self
            _LOCAL_CHANGED.setdefault(self.config.channel, asyncio.Event()).set()
            return
        assert self.nc is not None
        subject = catalog.WEIGHT_VLLM_TRANSFER.subject(self.run_id, self.engine_id)
        self._sub = await self.nc.subscribe(subject, cb=self._answer)
        gpus = await self.engine.worker_gpus()
        index = VersionIndex(self.nc, self.run_id, self.config.scope)
        await index.ensure()
        info = VllmTransferEngine(run_id=self.run_id, engine_id=self.engine_id, workers=len(gpus), gpus=gpus,
                                  backend=self.config.backend)
        await (await index.kv()).put(vllm_engine_key(self.run_id, self.engine_id), encode(info))
        log.info("vLLM engine %s registered for weight transfer (%d workers)", self.engine_id, len(gpus))

    async def _answer(self, msg: Any) -> None:
        """Each request in a task of its own: a ping is answered while a step waits in a collective (the
        trainer's next group must not take a busy engine for a dead one); the trainer orders the steps."""
        task = asyncio.create_task(self._step(msg), name="vllm-transfer-step")
        self._steps.add(task)
        task.add_done_callback(self._steps.discard)

    async def step(self, op: str, info: dict[str, Any], version: int) -> None:
        """One handshake step on the engine; a finished update yields its version to the iteration."""
        await self.engine.transfer_step(op, info, version)
        if op == "finish":
            self._applied.put_nowait(version)

    async def _step(self, msg: Any) -> None:
        try:
            request = decode(msg.data, VllmTransferRequest)
            await self.step(request.op, request.info, request.policy_version)
            reply = VllmTransferReply(run_id=self.run_id, ok=True)
        except Exception as err:
            self.last_error = f"{type(err).__name__}: {err}"
            log.error("weight transfer step failed: %s", self.last_error)
            reply = VllmTransferReply(run_id=self.run_id, ok=False, error=self.last_error)
        try:
            await msg.respond(encode(reply))
        except Exception as e:  # the bus is away: the trainer's request times out and it forms the group again
            log.warning("answering the trainer's weight transfer step: %s", e)

    async def receive(self) -> Weights:
        await self.start()
        version = await self._applied.get()
        self._version = version
        return version, {}

    def __aiter__(self) -> Any:
        from services.lib.weights.transport import follow

        return follow(self, None)

    async def close(self) -> None:
        if _LOCAL.get(self.config.channel) is self:
            del _LOCAL[self.config.channel]
            _LOCAL_CHANGED.pop(self.config.channel, None)
        if self._sub is not None:
            sub, self._sub = self._sub, None
            await sub.unsubscribe()
            for task in list(self._steps):
                task.cancel()
            await asyncio.gather(*self._steps, return_exceptions=True)
            try:
                index = VersionIndex(self.nc, self.run_id, self.config.scope)  # type: ignore[arg-type]
                await (await index.kv()).delete(vllm_engine_key(self.run_id, self.engine_id))
            except Exception as e:  # the bus may be away; a stale entry makes the next group wait, bounded
                log.debug("unregistering vLLM engine %s: %s", self.engine_id, e)
