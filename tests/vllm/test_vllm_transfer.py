"""The ``vllm`` weight transport on the vLLM CPU build: the rollout's engine registers, the trainer drives
vLLM's own weight-transfer handshake over the bus (init, start, update, finish) and the bytes land straight
in the worker's parameters (the ``gloo`` backend: the nccl handshake and layerwise reload, the bytes on a
gloo group); the tokens after it are the new weights' (logprobs against a torch forward pass) and carry the
new version. A trainer without a GPU asking for nccl is refused before any collective. What stays for a GPU:
NCCL's and CUDA IPC's own data planes (bench/gpu_check.sh when vLLM is importable there).
"""

from __future__ import annotations

import asyncio

import msgspec
import nats
import pytest
import pytest_asyncio
import torch

from services.lib.engine.base import SamplingParams
from services.lib.engine.config import VllmEngineConfig
from services.lib.engine.vllm_engine import VllmEngine
from services.lib.weights.transport import make_receiver, make_sender
from services.runtime.weights_config import ConfigError, VllmTransferConfig

pytestmark = pytest.mark.asyncio(loop_scope="module")

BOS = 1
CONFIG = VllmTransferConfig(backend="gloo", engines=1, timeout_s=60.0, bucket_bytes=1 << 20)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(loop_model_dir):
    eng = VllmEngine(VllmEngineConfig(dtype="float32", max_num_seqs=8, enforce_eager=True, kv_cache_gib=0.25),
                     loop_model_dir, seed=0)
    eng.enable_weight_transfer(CONFIG.backend, CONFIG.timeout_s)
    await eng.start()
    yield eng
    await eng.stop()


@pytest.fixture(scope="module")
def perturbed(loop_model_dir):
    """The checkpoint with every floating tensor moved (seeded), and a torch model holding it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(loop_model_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


@torch.inference_mode()
def torch_logprobs(model, prompt_ids: list[int], tokens: list[int]) -> list[float]:
    ids = torch.tensor([prompt_ids + tokens])
    logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1:-1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()


async def test_weights_land_in_the_workers_through_vllms_transfer_api(engine, perturbed, nats_url):
    nc = await nats.connect(nats_url, max_reconnect_attempts=0)
    receiver = make_receiver(CONFIG, nc, "vx1", engine=engine)
    sender = make_sender(CONFIG, nc, "vx1")
    await sender.start()
    versions = aiter(receiver)
    got = asyncio.ensure_future(anext(versions))
    try:
        await receiver.start()
        prompt = [BOS] + engine.tokenizer.encode("12+34=", add_special_tokens=False)
        greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
        before = await engine.generate(prompt, greedy)
        assert before.versions == [0] * len(before.token_ids)

        state = {k: v.detach().clone() for k, v in perturbed.state_dict().items()}
        await sender.send(state, 3)
        version, applied = await asyncio.wait_for(got, 30)
        assert (version, applied) == (3, {}) and receiver.version == 3 and engine.version == 3
        await engine.update_weights(applied, version)  # the rollout's bookkeeping call: already in, a no-op

        after = await engine.generate(prompt, greedy)
        assert after.versions == [3] * len(after.token_ids)
        want = torch_logprobs(perturbed, prompt, after.token_ids)
        assert torch.allclose(torch.tensor(after.logprobs), torch.tensor(want), atol=2e-3), (after.logprobs, want)

        # the group stays formed: a second version goes over it too
        got = asyncio.ensure_future(anext(versions))
        await sender.send(state, 4)
        assert (await asyncio.wait_for(got, 30))[0] == 4 and engine.version == 4 and sender.failures == 0
    finally:
        got.cancel()
        await asyncio.gather(got, return_exceptions=True)
        await versions.aclose()
        await sender.close()
        await receiver.close()
        await nc.close()


async def test_nccl_from_a_trainer_without_a_gpu_is_refused_before_any_collective(engine, nats_url):
    nc = await nats.connect(nats_url, max_reconnect_attempts=0)
    config = VllmTransferConfig(backend="nccl", engines=1, timeout_s=20.0)  # ConfigError: never retried
    receiver = make_receiver(config, nc, "vx2", engine=engine)
    sender = make_sender(config, nc, "vx2")
    try:
        await sender.start()
        await receiver.start()
        assert await engine.worker_gpus() == ["cpu"]
        with pytest.raises(ConfigError, match="the trainer has none"):
            await sender.send({"lm_head.weight": torch.zeros(2)}, 1)
        assert sender.failures == 1 and engine.version == 4  # nothing reached the engine
    finally:
        await sender.close()
        await receiver.close()
        await nc.close()


async def test_an_engine_killed_without_unregistering_is_dropped_before_the_group_forms(engine, perturbed, nats_url):
    from nats.js.errors import KeyDeletedError, KeyNotFoundError

    from proto.codec import encode
    from proto.weights import VllmTransferEngine, vllm_engine_key
    from services.lib.weights.index import VersionIndex
    from services.lib.weights.vllm_receiver import VllmTransferError

    nc = await nats.connect(nats_url, max_reconnect_attempts=0)
    kv = await VersionIndex(nc, "vx3", "main").kv()

    async def killed(engine_id: str) -> None:  # what a killed rollout leaves: its registration, nobody answering
        await kv.put(vllm_engine_key("vx3", engine_id), encode(VllmTransferEngine(
            run_id="vx3", engine_id=engine_id, workers=1, gpus=["cpu"], backend="gloo")))

    sender = make_sender(msgspec.structs.replace(CONFIG, reform_for_s=0.0), nc, "vx3")  # one try: see it fail
    receiver = make_receiver(CONFIG, nc, "vx3", engine=engine)
    state = {k: v.detach().clone() for k, v in perturbed.state_dict().items()}
    versions = aiter(receiver)
    got = None
    try:
        await sender.start()
        await killed("gone")
        with pytest.raises(VllmTransferError, match=r"none of the registered vLLM engines \['gone'\] answered"):
            await sender.send(state, 5)  # the only engine is gone: the send fails, nothing waits in a group
        assert sender.failures == 1 and engine.version == 4
        with pytest.raises((KeyDeletedError, KeyNotFoundError)):
            await kv.get(vllm_engine_key("vx3", "gone"))  # dropped from the registry
        await killed("gone2")
        got = asyncio.ensure_future(anext(versions))  # a live engine registers beside the dead one
        await receiver.start()
        await sender.send(state, 5)  # the dead one is dropped before the group forms; the live one gets it
        assert (await asyncio.wait_for(got, 30))[0] == 5 and engine.version == 5 and sender.failures == 1
        with pytest.raises((KeyDeletedError, KeyNotFoundError)):
            await kv.get(vllm_engine_key("vx3", "gone2"))
    finally:
        if got is not None:
            got.cancel()
            await asyncio.gather(got, return_exceptions=True)
        await versions.aclose()
        await sender.close()
        await receiver.close()
        await nc.close()


async def test_the_cpu_build_accepts_an_ipc_engine_and_its_handshake_without_data(loop_model_dir):
    """An engine started for ``ipc`` (vLLM builds its IPC receiving side in the worker) takes the handshake's
    control steps on CPU: init with the trainer's wire parameters, start (layerwise reload opened), finish
    (closed, the version labelled, generation resumed). The data step needs CUDA IPC handles: GPU only."""
    eng = VllmEngine(VllmEngineConfig(dtype="float32", max_num_seqs=4, enforce_eager=True, kv_cache_gib=0.25),
                     loop_model_dir, seed=0)
    eng.enable_weight_transfer("ipc", 30.0)
    await eng.start()
    try:
        await eng.transfer_step("init", {"packed": True}, 0)
        await eng.transfer_step("start", {}, 7)
        await eng.transfer_step("finish", {}, 7)
        assert eng.version == 7
        out = await eng.generate([BOS, 5, 6], SamplingParams(max_new_tokens=3, temperature=0.0))
        assert out.versions == [7] * len(out.token_ids)
    finally:
        await eng.stop()
