"""The ``vllm`` transport: weights straight into each vLLM worker's parameters through vLLM's own
weight-transfer API (``weight_transfer_config``; ``vllm/distributed/weight_transfer/``).

vLLM ships both halves of the data plane: a worker-side engine inside every vLLM worker (made when the
engine starts with ``weight_transfer_config``) and a trainer-side engine
(``WeightTransferTrainerFactory.trainer_init``) that drives the handshake through a
``VLLMWeightSyncClient`` (``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights``,
``finish_weight_update``). rlbus supplies the client and nothing of the data plane:

* **nccl** (disaggregated): the rollout registers its engine in the scope's KV (workers, GPU UUIDs)
  and answers the handshake on ``rlbus.<run>.weights.vllm.<engine_id>`` (:class:`BusClient` fans each
  step out to every engine, giving each its ``rank_offset`` in one group of ``1 + workers``). Trainer
  rank 0 broadcasts packed buckets of ``bucket_bytes`` (vLLM's ``packed_buffer_size_bytes``; at most
  ``num_buffers`` in flight), and every worker receives on its own device straight into its
  parameters (layerwise reload). A trainer whose GPU is any worker's is refused before any NCCL call
  (NCCL would fail with "Duplicate GPU detected").
* **gloo** (CPU engines, the vLLM CPU build, the tests): the nccl handshake and layerwise reload with
  the bytes on a gloo group (:mod:`services.lib.weights.vllm_gloo`, registered in vLLM's factories).
* **ipc** (colocated, ``trainer+rollout`` in one process): the engine registers in this process
  (:class:`LocalClient`); the trainer's tensors go to the workers as CUDA IPC handles, on the same GPU
  (an engine on another GPU is refused).

Every step is bounded by ``timeout_s``; a failed send leaves the group (the workers are told to
shut their side down, bounded) and the next send forms it again. The engine side applies each
version itself, so the receiver yields ``(version, {})`` once a version is in (the rollout's
bookkeeping runs as for every transport). Needs vLLM importable on both sides.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from nats.aio.client import Client as NATS

from proto import catalog
from proto.codec import decode, encode
from proto.weights import (
    VllmTransferEngine,
    VllmTransferReply,
    VllmTransferRequest,
    vllm_engine_key,
    vllm_engine_prefix,
)
from services.lib.weights.client import cast_for_publish
from services.lib.weights.index import VersionIndex, stop_watch
from services.lib.weights.transport import Weights
from services.lib.weights.vllm_layout import check_gpus, device_uuid, rank_offsets
from services.lib.weights.vllm_receiver import VllmTransferError, wait_local
from services.runtime.natsd import free_port
from services.runtime.weights_config import ConfigError, VllmTransferConfig

log = logging.getLogger("rlbus.weightsync.vllm")

#: between leaving a failed group and forming the next
REFORM_PAUSE_S = 1.0


class StateSource:
    """vLLM's ``WeightSource`` over the state dict of the version being sent (set before each send): the
    names, dtypes and shapes first (``metadata``), then the tensors in the same order."""

    def __init__(self) -> None:
        self.state: dict[str, torch.Tensor] = {}
        #: where the tensors are sent from: the trainer's GPU for nccl/ipc (a tensor gathered to the host is
        #: copied there one at a time, as its bucket is packed), None for gloo (host tensors)
        self.device: torch.device | None = None

    def metadata(self) -> list[Any]:
        from vllm.distributed.weight_transfer.base import ParamMeta

        return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.state.items()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.state.items():
            yield name, tensor if self.device is None else tensor.to(self.device)

    def held_names(self) -> None:
        return None


# --------------------------------------------------------------------------- trainer side
class _SyncClient:
    """vLLM's ``VLLMWeightSyncClient`` (synchronous; called from the send thread) whose steps run as
    coroutines on the sender's event loop, each bounded by ``timeout_s``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout_s: float) -> None:
        self.loop = loop
        self.timeout_s = timeout_s
        self.version = 0

    def _run(self, what: str, coro: Any) -> None:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            future.result(self.timeout_s)
        except concurrent.futures.TimeoutError as err:
            future.cancel()
            raise VllmTransferError(f"{what} got no answer within {self.timeout_s}s") from err

    async def step(self, op: str, info: dict[str, Any] | None = None) -> None:
        raise NotImplementedError

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._run("init_weight_transfer_engine", self.step("init", init_info))

    def start_weight_update(self) -> None:
        self._run("start_weight_update", self.step("start"))

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._run("update_weights", self.step("update", update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._run("finish_weight_update", self.step("finish"))


class BusClient(_SyncClient):
    """The handshake over the bus, fanned out to every engine (each with its own ``rank_offset``)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, nc: NATS, run_id: str, timeout_s: float,
                 offsets: Mapping[str, int]) -> None:
        super().__init__(loop, timeout_s)
        self.nc, self.run_id, self.offsets = nc, run_id, dict(offsets)
        #: engines that did not answer (gone without unregistering: killed): dropped from the registry
        self.silent: set[str] = set()

    async def ask(self, engine: str, request: VllmTransferRequest) -> None:
        subject = catalog.WEIGHT_VLLM_TRANSFER.subject(self.run_id, engine)
        try:
            msg = await self.nc.request(subject, encode(request), timeout=self.timeout_s)
        except Exception as err:
            self.silent.add(engine)
            raise VllmTransferError(f"engine {engine} did not answer {request.op!r} within {self.timeout_s}s "
                                    f"({type(err).__name__}); is its rollout running?") from err
        reply = decode(msg.data, VllmTransferReply)
        if not reply.ok:
            raise VllmTransferError(f"engine {engine} failed {request.op!r}: {reply.error}")

    async def step(self, op: str, info: dict[str, Any] | None = None) -> None:
        async def one(engine: str) -> None:
            mine = dict(info or {})
            if op == "init":
                mine["rank_offset"] = self.offsets[engine]
            await self.ask(engine, VllmTransferRequest(run_id=self.run_id, op=op, info=mine,  # type: ignore[arg-type]
                                                       policy_version=self.version))

        await asyncio.gather(*(one(e) for e in self.offsets))


class LocalClient(_SyncClient):
    """The handshake with the colocated engine of this process (ipc: no bus, CUDA IPC handles)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, receiver: Any, timeout_s: float) -> None:
        super().__init__(loop, timeout_s)
        self.receiver = receiver  # the colocated engine's VllmReceiver

    async def step(self, op: str, info: dict[str, Any] | None = None) -> None:
        await self.receiver.step(op, info or {}, self.version)


class VllmSender:
    """:class:`~services.lib.weights.transport.WeightSender` through vLLM's trainer-side engine."""

    def __init__(self, config: VllmTransferConfig, nc: NATS | None, run_id: str) -> None:
        if config.backend != "ipc" and nc is None:
            raise ValueError(f"the vllm transport ({config.backend}) needs a NATS connection for its control plane")
        self.config, self.nc, self.run_id = config, nc, run_id
        self.source = StateSource()
        self.client: _SyncClient | None = None
        self.engine: Any = None  # vLLM's TrainerWeightTransferEngine, once the group is formed
        #: sends that failed and left the group (the next send forms it again)
        self.failures = 0

    async def start(self) -> None:
        """Check that vLLM is importable here; the group is formed by the first send (engines may come later)."""
        try:
            import vllm.distributed.weight_transfer.factory  # noqa: F401

            if self.config.backend == "gloo":
                import services.lib.weights.vllm_gloo  # noqa: F401  (registers the gloo backend)
        except ImportError as err:
            raise ConfigError('[weights] type = "vllm" runs vLLM\'s trainer-side engine in the trainer: install vLLM '
                              'there too (pip install "rlbus[vllm]"), or use type = "store"') from err

    async def _engines(self) -> dict[str, VllmTransferEngine]:
        """The registered engines, once ``engines`` of them are (bounded by ``timeout_s``)."""
        assert self.nc is not None
        index = VersionIndex(self.nc, self.run_id, self.config.scope)
        await index.ensure()
        kv = await index.kv()
        want = max(self.config.engines, 1)
        engines: dict[str, VllmTransferEngine] = {}

        async def registered() -> None:  # every registration there is (all of them), then each new one
            watcher = await kv.watch(vllm_engine_prefix(self.run_id) + "*")
            listed = False  # the registrations there were have all arrived
            try:
                async for entry in watcher:
                    if entry is None:
                        listed = True  # nats-py's marker after the current values
                    else:
                        engine_id = entry.key.rsplit(".", 1)[-1]
                        if entry.value:
                            engines[engine_id] = decode(entry.value, VllmTransferEngine)
                        else:
                            engines.pop(engine_id, None)  # unregistered (a rollout that stopped)
                    if listed and len(engines) >= want:
                        return
            finally:
                await stop_watch(watcher)

        try:
            await asyncio.wait_for(registered(), self.config.timeout_s)
        except TimeoutError as err:
            raise VllmTransferError(f"{len(engines)} of {want} vLLM engines registered within {self.config.timeout_s}s; "
                                    "are the rollouts running with the vllm engine and this [weights] section?") from err
        return engines

    async def _answering(self, engines: dict[str, VllmTransferEngine]) -> dict[str, VllmTransferEngine]:
        """The registered engines that answer a ping; the others (killed, never unregistered) are dropped from
        the registry before any rendezvous, so that no live engine waits in a group one of them cannot join."""
        probe = BusClient(asyncio.get_running_loop(), self.nc, self.run_id, self.config.timeout_s,  # type: ignore[arg-type]
                          dict.fromkeys(engines, 0))
        answers = await asyncio.gather(*(probe.ask(e, VllmTransferRequest(run_id=self.run_id, op="ping"))
                                         for e in engines), return_exceptions=True)
        if probe.silent:
            await self._forget(probe.silent)
        live = {e: info for (e, info), answer in zip(engines.items(), answers, strict=True)
                if not isinstance(answer, BaseException)}
        if not live:
            raise VllmTransferError(f"none of the registered vLLM engines {sorted(engines)} answered: "
                                    f"{answers[0]}")
        return live

    async def _form(self) -> None:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        cfg, loop = self.config, asyncio.get_running_loop()
        if cfg.backend != "gloo" and torch.cuda.is_available():
            self.source.device = torch.device("cuda", torch.cuda.current_device())
        if cfg.backend == "ipc":
            receiver = await wait_local(cfg.channel, cfg.timeout_s)
            check_gpus("ipc", device_uuid(), {"colocated": await receiver.engine.worker_gpus()})
            self.client = LocalClient(loop, receiver, cfg.timeout_s)
            from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

            init: Any = IPCTrainerInitInfo(rank=0, packed=True, packed_buffer_size_bytes=cfg.bucket_bytes)
        else:
            assert self.nc is not None
            engines = await self._answering(await self._engines())
            check_gpus(cfg.backend, device_uuid(), {e: i.gpus for e, i in engines.items()})
            offsets, world = rank_offsets({e: i.workers for e, i in engines.items()})
            self.client = BusClient(loop, self.nc, self.run_id, cfg.timeout_s, offsets)
            port = cfg.master_port or free_port(cfg.master_addr)
            if cfg.backend == "gloo":
                from services.lib.weights.vllm_gloo import GlooTrainerInitInfo

                init = GlooTrainerInitInfo(rank=0, master_address=cfg.master_addr, master_port=port, world_size=world,
                                           bucket_bytes=cfg.bucket_bytes, timeout_s=cfg.timeout_s)
            else:
                from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

                init = NCCLTrainerInitInfo(rank=0, master_address=cfg.master_addr, master_port=port, world_size=world,
                                           packed=True, packed_buffer_size_bytes=cfg.bucket_bytes,
                                           packed_num_buffers=cfg.num_buffers)
            log.info("forming the vLLM weight-transfer group: %d engines, %d ranks", len(engines), world)
        client = self.client
        self.engine = await self._bounded("forming the transfer group", lambda: WeightTransferTrainerFactory.trainer_init(
            init, client=client, source=self.source))

    async def _bounded(self, what: str, fn: Callable[[], Any]) -> Any:
        try:
            return await asyncio.wait_for(asyncio.to_thread(fn), self.config.timeout_s + 5.0)
        except TimeoutError as err:
            raise VllmTransferError(f"{what} did not finish within {self.config.timeout_s}s") from err

    async def send(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Send ``version`` into every engine's workers. A failed try leaves the group (engines that did not
        answer are dropped from the registry) and forms it again, for up to ``reform_for_s``; then
        :class:`VllmTransferError`. A layout the backend cannot serve raises ConfigError at once."""
        deadline = time.monotonic() + self.config.reform_for_s
        while True:
            try:
                return await self._send_once(state_dict, version)
            except VllmTransferError as err:
                if time.monotonic() + REFORM_PAUSE_S > deadline:
                    raise
                log.warning("sending version %d failed (%s); forming the transfer group again", version, err)
                await asyncio.sleep(REFORM_PAUSE_S)  # back-off: a restarted engine registers again meanwhile

    async def _send_once(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        sd = cast_for_publish(state_dict, self.config.dtype) if self.config.dtype == "bf16" else dict(state_dict)
        self.source.state = {n: t.detach() for n, t in sd.items()}
        try:
            if self.engine is None:
                await self._form()
            assert self.client is not None
            self.client.version = version
            await self._bounded(f"sending version {version}", self.engine.send_weights)
        except Exception as err:
            self.failures += 1
            await self._leave()
            if isinstance(err, (VllmTransferError, ConfigError)):
                raise
            raise VllmTransferError(f"sending version {version} failed: {err}") from err
        finally:
            self.source.state = {}
        log.info("sent v%d into vLLM's workers (%s)", version, self.config.backend)

    async def _leave(self) -> None:
        engine, client, self.engine = self.engine, self.client, None
        if client is not None:
            try:
                await asyncio.wait_for(client.step("shutdown"), self.config.timeout_s)
            except Exception as e:  # an engine that died cannot answer; its restart starts clean
                log.debug("engines leaving the transfer group: %s", e)
        if isinstance(client, BusClient) and client.silent:
            await self._forget(client.silent)
        if engine is not None:
            threading_shutdown = asyncio.to_thread(engine.shutdown)
            try:
                await asyncio.wait_for(threading_shutdown, self.config.timeout_s)
            except Exception as e:
                log.warning("shutting the trainer's transfer endpoint down: %s", e)

    async def _forget(self, engines: set[str]) -> None:
        """Drop engines that did not answer from the registry (a killed rollout never unregisters; its
        restart registers afresh), so the next group is formed without them."""
        index = VersionIndex(self.nc, self.run_id, self.config.scope)  # type: ignore[arg-type]
        for engine in sorted(engines):
            try:
                await (await index.kv()).delete(vllm_engine_key(self.run_id, engine))
                log.warning("vLLM engine %s did not answer; dropped from the weight-transfer group", engine)
            except Exception as e:  # the bus is away: the next group finds it silent again
                log.debug("dropping vLLM engine %s: %s", engine, e)

    async def latest(self) -> Weights | None:
        """None: the transfer keeps nothing (a restarted trainer continues from its checkpoint)."""
        return None

    async def close(self) -> None:
        await self._leave()
