"""The capabilities of bench/gpu_check.sh other than the trainer's: each a subcommand whose last stdout line is
one JSON object ``{"status": "ok" | "skipped", "reason": ..., ...figures}``; a failed check raises (non-zero exit).

* ``probe``: torch, CUDA, NCCL and driver-side facts, the GPU and its free memory, which extras import;
* ``fsdp``: FSDP2 (``fully_shard`` per decoder layer and on the root, bf16 policy) on one NCCL rank (gloo on
  CPU): an AdamW step, then a torch.distributed.checkpoint save and load round trip, compared exactly;
* ``digest``: the broadcast transport's on-device digest of 256 MiB on the GPU equals the same bytes' on the host;
* ``refusal``: the vllm transport refuses an nccl engine on the trainer's own GPU (its real UUID) and accepts
  ipc there, before any collective;
* ``vllm``: only where vLLM is importable: the vllm engine on the GPU, a staged weight update, sleep/wake,
  and a staging directory too small for the update (ENOSPC) leaving nothing behind;
* ``colocated``: ``rlbus run`` of 3 synchronous steps with trainer and rollout in one process on the device
  (the torch engine asleep while the learner steps; weights handed over in-process).

The probe and fsdp need torch and transformers only; the others import rlbus's modules (msgspec, nats-py,
...: bench/gpu_check.sh brings them as wheels where they are missing).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def skipped(reason: str) -> dict:
    return {"status": "skipped", "reason": reason}


def importable(name: str) -> bool:
    spec = importlib.util.find_spec(name)
    return spec is not None and spec.origin is not None


def probe(device: str) -> dict:
    out: dict = {"status": "ok", "python": sys.version.split()[0], "torch": torch.__version__,
                 "cuda_build": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
                 "imports": {m: importable(m) for m in ("transformers", "msgspec", "nats", "vllm", "blake3",
                                                         "zstandard", "uvloop", "safetensors")}}
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        props = torch.cuda.get_device_properties(0)
        out.update(gpus=[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
                   gpu_uuid=str(props.uuid), free_gib=round(free / 2**30, 1), total_gib=round(total / 2**30, 1),
                   capability=list(torch.cuda.get_device_capability(0)), bf16=torch.cuda.is_bf16_supported(),
                   nccl=".".join(map(str, torch.cuda.nccl.version())))
    return out


def _tiny_llama(vocab: int = 512):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab))


def fsdp(device: str) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    cuda = device.startswith("cuda")
    backend = "nccl" if cuda else "gloo"
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        t0 = time.perf_counter()
        model = _tiny_llama().to(device)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ids = torch.randint(0, 512, (4, 64), device=device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optim.step()
        model_sd, optim_sd = get_state_dict(model, optim)
        before = {k: v.full_tensor().detach().cpu().clone() for k, v in model_sd.items()}
        with tempfile.TemporaryDirectory() as ckpt:
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=ckpt)
            with torch.no_grad():
                for p in model.parameters():
                    p.zero_()
            model_sd, optim_sd = get_state_dict(model, optim)
            state = {"model": model_sd, "optim": optim_sd}
            dcp.load(state, checkpoint_id=ckpt)
            set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
        after = {k: v.full_tensor().detach().cpu() for k, v in get_state_dict(model, optim)[0].items()}
        same = all(torch.equal(before[k], after[k]) for k in before)
        if not same:
            raise RuntimeError("DCP round trip changed the model's weights")
        loss2 = model(input_ids=ids, labels=ids).loss
        return {"status": "ok", "backend": backend, "loss": round(float(loss), 4), "loss_after": round(float(loss2), 4),
                "round_trip_equal": same, "tensors": len(before), "seconds": round(time.perf_counter() - t0, 2)}
    finally:
        dist.destroy_process_group()


def digest(device: str) -> dict:
    if not device.startswith("cuda"):
        return skipped("no GPU: the on-device digest is checked against the host's on a GPU only")
    from services.lib.weights.broadcast_group import DeviceDigest

    data = torch.randint(0, 256, (256 << 20,), dtype=torch.uint8, device="cuda")
    on_gpu, on_host = DeviceDigest(), DeviceDigest()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for part in data.split(64 << 20):  # bucket cuts must not matter
        on_gpu.update(part)
    torch.cuda.synchronize()
    gpu_s = time.perf_counter() - t0
    on_host.update(data.cpu())
    if on_gpu.digest() != on_host.digest():
        raise RuntimeError(f"on-device digest {on_gpu.hexdigest()} != host digest {on_host.hexdigest()}")
    return {"status": "ok", "bytes": data.numel(), "gpu_gib_per_s": round(data.numel() / gpu_s / 2**30, 2)}


def refusal(device: str) -> dict:
    if not device.startswith("cuda"):
        return skipped("no GPU: the refusal compares real GPU UUIDs")
    from services.lib.weights.vllm_layout import check_gpus, device_uuid
    from services.runtime.weights_config import ConfigError

    mine = device_uuid()
    try:
        check_gpus("nccl", mine, {"engine-on-my-gpu": [mine]})
    except ConfigError as err:
        message = str(err)
    else:
        raise RuntimeError("an nccl engine on the trainer's own GPU was not refused")
    check_gpus("ipc", mine, {"colocated": [mine]})  # the colocated layout is accepted
    return {"status": "ok", "gpu_uuid": mine, "refused_with": message[:160]}


def vllm(device: str) -> dict:
    if not importable("vllm"):
        return skipped("vLLM is not importable here: the vllm engine, its updates and sleep/wake are NOT verified")
    if not device.startswith("cuda"):
        return skipped("no GPU: sleep/wake is GPU-only (tests/vllm covers the CPU build)")
    import asyncio

    from services.lib.engine.base import SamplingParams
    from services.lib.engine.config import VllmEngineConfig
    from services.lib.engine.vllm_engine import VllmEngine

    root = Path(tempfile.mkdtemp(prefix="rlbus-gpu-vllm-"))
    model_dir = _save_tiny(root / "model")

    async def run() -> dict:
        engine = VllmEngine(VllmEngineConfig(dtype="bfloat16", enable_sleep_mode=True, gpu_memory_utilization=0.3,
                                             max_model_len=256), model_dir, seed=0)
        t0 = time.perf_counter()
        await engine.start()
        out: dict = {"status": "ok", "start_s": round(time.perf_counter() - t0, 1)}
        try:
            prompt, params = [1, 5, 6, 7], SamplingParams(max_new_tokens=8, temperature=0.0)
            await engine.generate(prompt, params)
            state = {k: v.to(torch.bfloat16) for k, v in _tiny_llama().state_dict().items()}
            t0 = time.perf_counter()
            await engine.update_weights(state, 1)
            out["update_s"] = round(time.perf_counter() - t0, 3)
            if (await engine.generate(prompt, params)).versions[0] != 1:
                raise RuntimeError("tokens after the update do not carry version 1")
            await engine.sleep(1)
            await engine.wake_up()
            out["after_wake_tokens"] = len((await engine.generate(prompt, params)).token_ids)
            out["enospc"] = await _enospc(engine, state)
        finally:
            await engine.stop()
        return out

    return asyncio.run(run())


async def _enospc(engine, state) -> str:
    """An update staged into a 1 MiB tmpfs: refused with an error, no partial file left behind."""
    import msgspec

    small = Path(tempfile.mkdtemp(prefix="rlbus-enospc-"))
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)], capture_output=True).returncode:
        return "skipped: cannot mount a small tmpfs here (not root?)"
    try:
        engine.config = msgspec.structs.replace(engine.config, staging_dir=str(small))
        try:
            await engine.update_weights(state, 2)
        except Exception as err:  # the staging error, named
            left = list(small.iterdir())
            if left:
                raise RuntimeError(f"ENOSPC left {left} behind") from err
            return f"ok: {type(err).__name__}: {str(err)[:120]}"
        raise RuntimeError("an update larger than the staging directory was not refused")
    finally:
        subprocess.run(["umount", str(small)], capture_output=True)


def _save_tiny(out: Path) -> Path:
    sys.path.insert(0, str(ROOT / "bench"))
    from gpu_check_trainer import build_model

    return build_model(out, "tiny")


def colocated(device: str) -> dict:
    root = Path(tempfile.mkdtemp(prefix="rlbus-gpu-colocated-"))
    cuda = device.startswith("cuda")
    run = root / "run.toml"
    run.write_text(f"""
[run]
id = "gpucheck"
dir = "{root / 'run'}"
[launcher]
services = {{ "trainer+rollout" = 1, judge = 1 }}
nats_port = {free_port()}
[model]
name = "tiny-addition"
dtype = "{'bfloat16' if cuda else 'float32'}"
[weights]
type = "inproc"
[services.trainer]
groups_per_step = 2
group_size = 4
total_steps = 3
max_staleness = 0
checkpoint_every = 0
sampling = {{ max_new_tokens = 6 }}
eval = {{ every = 0 }}
devices = {{ device = "{device}", num_threads = 2 }}
[services.rollout]
max_tickets = 8
engine = {{ type = "torch", device = "{device}", enable_sleep_mode = true }}
""")
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "services.launcher.cli", "run", str(run)], capture_output=True, text=True,
                       timeout=float(os.environ.get("RLBUS_GPU_CHECK_COLOCATED_S", "300")), cwd=ROOT)
    if r.returncode != 0 or "run finished at step 3" not in r.stderr:
        logs = "\n".join(p.read_text()[-1500:] for p in (root / "run" / "logs").glob("*.log"))
        raise RuntimeError(f"rlbus run exited {r.returncode}: {r.stderr[-2000:]}\n{logs}")
    return {"status": "ok", "steps": 3, "seconds": round(time.perf_counter() - t0, 1)}


PARTS = {"probe": probe, "fsdp": fsdp, "digest": digest, "refusal": refusal, "vllm": vllm, "colocated": colocated}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("part", choices=sorted(PARTS))
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    if args.part != "probe" and args.device.startswith("cuda") and not torch.cuda.is_available():
        print(json.dumps(skipped("no CUDA device")))
        return
    print(json.dumps(PARTS[args.part](args.device)))


if __name__ == "__main__":
    main()
