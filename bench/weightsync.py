"""Weight sync figures, all measured in one run on this machine.

* ``delta_ratio``: anchor bytes / mean sparse-delta bytes over a few real GRPO
  steps (sampled groups, task rewards, group advantages, the trainer's
  ``grpo_loss``, AdamW at lr 1e-6, fp32 master weights published as bf16) of
  SmolLM2-135M-Instruct; ``delta_ratio_tiny`` the same on the tiny default
  example model at its own learning rate (1e-4). Without SmolLM2 in the cache
  (``services.tasks.smollm2``) the figure comes from a locally built model of
  the same architecture with random weights and says so in ``delta_model``.
* ``objstore_pull_MBps`` / ``s3_pull_MBps``: fetch + verify of one full
  version (256 MB; 64 MB with ``--quick``) from the JetStream object store and
  from S3 (moto's server, its own process on 127.0.0.1), next to ``raw_loopback_MBps``: a plain
  socket copy of the same bytes into a fresh buffer on the same machine.
  ``*_read_unverified_MBps``: the same chunks read from the store without
  hashing (the transport alone); ``sha256_MBps`` / ``blake3_MBps``: hashing the same bytes once,
  single thread. The pulls run once per chunk digest (``--digests``, default both side by side):
  ``pulls.<digest>`` holds each one's pull, publish and ``*_vs_raw`` figures; the top-level
  ``objstore_pull_MBps`` / ``s3_pull_MBps`` / ``*_vs_raw`` are the publishers' default, BLAKE3.
  Each pull is set against a raw copy measured just before it (``*_raw_MBps``), over
  ``--rounds`` rounds with the digest order alternating; the best ratio of each is kept.
  ``*_pull_cpu_s``: the bench process's CPU seconds per verified pull (least of all pulls), the
  digest's cost in a figure a loaded machine disturbs less than wall time.
  ``--pulls-only`` stops after the pulls (no relay, broadcast or GRPO deltas).
* ``publish_to_all_applied_s``: publish until 8 engines have fetched and
  verified the version, relay off (every engine reads upstream) and on (one
  weightsync relay reads upstream, engines read its local bucket), with the
  upstream bytes of each.
* ``broadcast_MBps``: the gloo ``broadcast`` transport between 2 processes.

Usage: ``python bench/weightsync.py [--quick] [--pulls-only] [--digests sha256,blake3]``; the last
stdout line is JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import nats  # noqa: E402
import torch  # noqa: E402

from services.lib.weights.client import WeightPublisher, WeightSubscriber, cast_for_publish  # noqa: E402
from services.lib.weights.encoding import (  # noqa: E402
    DIGESTS,
    digest_hex,
    encode_delta,
    encode_full,
    split_aliases,
)
from services.lib.weights.objstore import ObjectStoreBlobs  # noqa: E402
from services.lib.weights.store import open_store  # noqa: E402
from services.lib.weights.transport import make_receiver, make_sender  # noqa: E402
from services.runtime.natsd import EmbeddedNats, free_port  # noqa: E402
from services.runtime.service import install_uvloop  # noqa: E402
from services.runtime.weights_config import (  # noqa: E402
    BroadcastConfig,
    EncodingConfig,
    ObjStoreConfig,
    S3StoreConfig,
)
from services.weightsync.config import RelayConfig, WeightsyncConfig  # noqa: E402
from services.weightsync.service import WeightsyncService  # noqa: E402

MB = 1e6
log = logging.getLogger("bench.weightsync")


def random_state(nbytes: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """bf16 tensors of 4 MiB each adding up to ``nbytes``."""
    g = torch.Generator().manual_seed(seed)
    per = 2 * 1024 * 1024  # elements per tensor
    n = max(1, nbytes // (2 * per))
    return {f"layer{i}.weight": torch.randn(per, generator=g).to(torch.bfloat16) for i in range(n)}


# -- raw loopback -------------------------------------------------------------------------------
def raw_loopback_MBps(data: bytes | bytearray) -> float:
    """A plain TCP copy of ``data`` over 127.0.0.1 into a preallocated buffer (best of 3)."""
    best = 0.0
    for _ in range(3):
        srv = socket.socket()
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)

        def send(s: socket.socket = srv) -> None:
            conn, _ = s.accept()
            conn.sendall(data)
            conn.close()

        th = threading.Thread(target=send, name="raw-sender")
        th.start()
        cl = socket.create_connection(srv.getsockname())
        t0 = time.perf_counter()
        out = memoryview(bytearray(len(data)))  # a fresh buffer, as a fetch allocates one
        pos = 0
        while pos < len(data):
            pos += cl.recv_into(out[pos:])
        best = max(best, len(data) / (time.perf_counter() - t0) / MB)
        th.join()
        cl.close()
        srv.close()
    return best


# -- store pulls --------------------------------------------------------------------------------
async def pull_MBps(nc, store_cfg, state, run: str, digest: str) -> dict[str, float]:
    encoding = EncodingConfig(anchor_every=1, digest=digest)
    pub = WeightPublisher(nc, run, open_store(store_cfg, nc), encoding=encoding)
    t0 = time.perf_counter()
    manifest = await pub.publish(state, 1)
    put_s = time.perf_counter() - t0
    best = best_read = 0.0
    cpu_s = float("inf")
    for _ in range(2):
        sub = WeightSubscriber(nc, run, open_store(store_cfg, nc))
        t0, c0 = time.perf_counter(), time.process_time()
        await sub.fetch(manifest, copy=False)  # read + verify every chunk's digest + rebuild
        best = max(best, manifest.blob_nbytes / (time.perf_counter() - t0) / MB)
        cpu_s = min(cpu_s, time.process_time() - c0)  # this process's CPU (all threads); the server's is apart
        # the store alone: the same chunks into a fresh buffer, no hashing
        t0 = time.perf_counter()
        view = memoryview(bytearray(manifest.blob_nbytes))
        offsets = [sum(c.size for c in manifest.chunks[:i]) for i in range(len(manifest.chunks))]
        await asyncio.gather(
            *(
                sub.store.read_into(c.name, view[o : o + c.size])
                for c, o in zip(manifest.chunks, offsets, strict=True)
            )
        )
        best_read = max(best_read, manifest.blob_nbytes / (time.perf_counter() - t0) / MB)
        await sub.store.close()
    await pub.store.close()
    return {
        "publish_MBps": manifest.blob_nbytes / put_s / MB,
        "pull_MBps": best,
        "read_MBps": best_read,
        "pull_cpu_s": cpu_s,
    }


def s3_config(endpoint: str) -> S3StoreConfig:
    # large ranges: moto answers each request slowly, so fewer, bigger ones read fastest from it
    return S3StoreConfig(
        bucket="bench",
        endpoint_url=endpoint,
        access_key_id="x",
        secret_access_key="x",
        part_bytes=32 * 1024 * 1024,
        parallel=2,
    )


async def wait_for_port(port: int, timeout: float = 30.0) -> None:
    """Until something accepts connections on 127.0.0.1:``port`` (a server process starting up)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens on port {port} after {timeout}s") from None
            await asyncio.sleep(0.1)  # a child process starting: nothing to wait on but the socket


# -- relay on/off -------------------------------------------------------------------------------
async def all_applied(url: str, state, engines: int, relay: bool, run: str) -> dict[str, float]:
    """Seconds from publish to ``engines`` engines holding the verified version, and upstream bytes."""
    nc = await nats.connect(url)
    scope = "node1" if relay else "main"
    service = stop = task = None
    if relay:
        cfg = WeightsyncConfig(
            run_id=run, relay=RelayConfig(scope=scope, store=ObjStoreConfig()), gc_upstream=False
        )
        service, stop = WeightsyncService(nc, cfg), asyncio.Event()
        await service.ensure()
        task = asyncio.create_task(service.run(stop), name="relay")
    conns = [await nats.connect(url) for _ in range(engines)]
    subs = [WeightSubscriber(c, run, ObjectStoreBlobs(c, scope=scope), scope=scope) for c in conns]
    for s in subs:
        await s.ensure()
    pub = WeightPublisher(nc, run, ObjectStoreBlobs(nc), encoding=EncodingConfig(anchor_every=1))
    await pub.ensure()

    async def engine(sub: WeightSubscriber) -> None:
        async for ann in sub.watch(include_current=False):
            await sub.fetch(ann.manifest, copy=False)
            return

    waiting = [asyncio.create_task(engine(s), name=f"engine-{i}") for i, s in enumerate(subs)]
    await asyncio.sleep(0.5)  # let every watcher subscribe before the clock starts
    t0 = time.perf_counter()
    manifest = await pub.publish(state, 1)
    await asyncio.gather(*waiting)
    elapsed = time.perf_counter() - t0
    upstream = service.stats.upstream_bytes if service else sum(s.store.stats.bytes_read for s in subs)
    if stop is not None and task is not None:
        stop.set()
        await task
    for s, c in zip(subs, conns, strict=True):
        await s.store.close()
        await c.close()
    await nc.close()
    return {"s": elapsed, "upstream_bytes": upstream, "version_bytes": manifest.blob_nbytes}


# -- broadcast ----------------------------------------------------------------------------------
async def broadcast_receiver(url: str, run: str, versions: int) -> None:
    nc = await nats.connect(url)
    rx = make_receiver(BroadcastConfig(world_size=2, backend="gloo", timeout_s=60), nc, run)
    await rx.start()
    for _ in range(versions):
        await rx.receive()
    await rx.close()
    await nc.close()


async def broadcast_MBps(url: str, state) -> float:
    run = "bench-bcast"
    proc = subprocess.Popen(
        [sys.executable, __file__, "--broadcast-receiver", url, run, "2"],
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    nc = await nats.connect(url)
    try:
        tx = make_sender(BroadcastConfig(world_size=2, backend="gloo", timeout_s=60), nc, run)
        await tx.start()
        await tx.send(state, 1)  # warm-up
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        t0 = time.perf_counter()
        await tx.send(state, 2)
        rate = nbytes / (time.perf_counter() - t0) / MB
        if await asyncio.to_thread(proc.wait, 60) != 0:
            raise RuntimeError("broadcast receiver process failed")
        await tx.close()
        return rate
    finally:
        if proc.poll() is None:
            proc.kill()
        await nc.close()


# -- deltas over real GRPO steps ---------------------------------------------------------------
def _local_smollm2_shaped() -> tuple[object, object, str]:
    """A random model with SmolLM2-135M's architecture and the tiny char tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from services.tasks.tiny_model import build_char_tokenizer

    tok = build_char_tokenizer()
    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    return (
        LlamaForCausalLM(cfg),
        tok,
        "local random model with SmolLM2-135M architecture (SmolLM2 not cached)",
    )


def load_policy(spec: str) -> tuple[object, object, str]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.tasks.models import resolve_model

    if spec == "smollm2":
        try:
            path = resolve_model("smollm2")
        except (ImportError, OSError, RuntimeError, ValueError) as err:
            log.warning("SmolLM2 unavailable (%s); using a locally built model", err)
            return _local_smollm2_shaped()
    else:
        path = resolve_model(spec)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(path), f"{spec} ({path})"


def grpo_delta_ratio(
    spec: str, task_name: str, lr: float, steps: int, prompts: int, group: int, max_new: int
):
    """Anchor bytes / mean delta bytes of the bf16 versions published after each GRPO step."""
    from services.tasks.base import get_task
    from services.tasks.evaluate import generate_completions
    from services.trainer.loss import group_advantages, grpo_loss

    model, tok, described = load_policy(spec)
    if getattr(tok, "chat_template", None) is None and task_name == "word_problems":
        task_name = "addition"  # the local stand-in has a character tokenizer without a chat template
        described += "; task addition"
    task = get_task(task_name)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    stream = task.train_prompts(seed=0)
    prev = encode_full(cast_for_publish(split_aliases(model.state_dict())[0], "bf16"))
    deltas, changed = [], []
    for _ in range(steps):
        batch = [next(stream) for _ in range(prompts)]
        prompt_ids = [task.format_prompt(tok, p) for p in batch for _ in range(group)]
        model.eval()
        comps, behaviour = generate_completions(model, tok, prompt_ids, max_new_tokens=max_new)
        texts = [tok.decode(c, skip_special_tokens=True) for c in comps]
        # task reward, plus a small shaping term so a group whose task rewards tie still carries signal
        rewards = [
            task.reward(batch[i // group], t).value + 0.1 * sum(ch.isdigit() for ch in t) / max(1, len(t))
            for i, t in enumerate(texts)
        ]
        adv = group_advantages(rewards, [i // group for i in range(len(texts))])
        width = max(len(p) + len(c) for p, c in zip(prompt_ids, comps, strict=True))
        ids = torch.full((len(comps), width), tok.pad_token_id)
        mask = torch.zeros(len(comps), width)
        blp = torch.zeros(len(comps), width)
        for i, (p, c) in enumerate(zip(prompt_ids, comps, strict=True)):
            ids[i, : len(p) + len(c)] = torch.tensor(p + c)
            mask[i, len(p) : len(p) + len(c)] = 1
            blp[i, len(p) : len(p) + len(c)] = torch.tensor(behaviour[i])
        model.train()
        logits = (
            model(input_ids=ids, attention_mask=(ids != tok.pad_token_id) | (mask > 0)).logits[:, :-1].float()
        )
        logprobs = torch.log_softmax(logits, -1).gather(2, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        loss, _ = grpo_loss(logprobs, blp[:, 1:], adv, mask[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        cur = encode_full(cast_for_publish(split_aliases(model.state_dict())[0], "bf16"))
        blob, entries = encode_delta(prev.buf, cur.buf, cur.tensors)
        numel = sum(e.nbytes // 2 for e in entries if e.dtype == "BF16")
        deltas.append(len(blob))
        changed.append(sum(e.nnz for e in entries) / max(1, numel))
        prev = cur
    mean_delta = sum(deltas) / len(deltas)
    return {
        "ratio": len(prev.buf) / max(1.0, mean_delta),
        "anchor_bytes": len(prev.buf),
        "delta_bytes": deltas,
        "changed_fraction": [round(c, 5) for c in changed],
        "model": described,
    }


# -- main ---------------------------------------------------------------------------------------
async def transfers(args, tmp: Path) -> dict[str, object]:
    out: dict[str, object] = {}
    size = (64 if args.quick else 256) * 1024 * 1024
    state = random_state(size)
    data = encode_full(state).buf
    out["version_MB"] = round(len(data) / MB, 1)
    out["raw_loopback_MBps"] = round(raw_loopback_MBps(data), 1)
    # what verification alone costs on this CPU (every pulled byte is hashed once)
    for digest in args.digests:
        t0 = time.perf_counter()
        digest_hex(data, digest)
        out[f"{digest}_MBps"] = round(len(data) / (time.perf_counter() - t0) / MB, 1)
    pulls: dict[str, dict[str, float]] = {d: {} for d in args.digests}
    unverified = {"objstore": 0.0, "s3": 0.0}
    with EmbeddedNats(tmp / "nats", port=None) as server:
        nc = await nats.connect(server.url)
        # moto's S3 server in its own process (in-process it would share our GIL)
        port = free_port()
        moto = subprocess.Popen(
            [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            await wait_for_port(port)
            stores = {"objstore": ObjStoreConfig(), "s3": s3_config(f"http://127.0.0.1:{port}")}
            # the same version pulled and verified with each digest in turn, the order alternating
            # between rounds; each pull is set against a raw copy measured just before it (a shared
            # machine's load drifts), and the best ratio of the rounds is kept
            for rnd in range(args.rounds):
                for digest in args.digests if rnd % 2 == 0 else args.digests[::-1]:
                    for kind, cfg in stores.items():
                        raw = raw_loopback_MBps(data)
                        r = await pull_MBps(nc, cfg, state, f"bench-{kind}-{digest}-{rnd}", digest)
                        got = pulls[digest]
                        if r["pull_MBps"] / raw > got.get(f"{kind}_vs_raw", 0.0):
                            got[f"{kind}_pull_MBps"] = round(r["pull_MBps"], 1)
                            got[f"{kind}_raw_MBps"] = round(raw, 1)
                            got[f"{kind}_vs_raw"] = round(r["pull_MBps"] / raw, 3)
                            got[f"{kind}_publish_MBps"] = round(r["publish_MBps"], 1)
                        # the client's CPU per verified pull: what the digest costs, steadier than wall
                        # time on a loaded machine
                        cpu = round(r["pull_cpu_s"], 3)
                        got[f"{kind}_pull_cpu_s"] = min(got.get(f"{kind}_pull_cpu_s", cpu), cpu)
                        unverified[kind] = max(unverified[kind], r["read_MBps"])
        finally:
            moto.terminate()
            moto.wait()
        await nc.close()
        out["pulls"] = pulls
        default = pulls.get("blake3") or pulls[args.digests[0]]
        for kind in ("objstore", "s3"):
            out[f"{kind}_pull_MBps"] = default[f"{kind}_pull_MBps"]
            out[f"{kind}_read_unverified_MBps"] = round(unverified[kind], 1)
            out[f"{kind}_publish_MBps"] = default[f"{kind}_publish_MBps"]
            out[f"{kind}_vs_raw"] = default[f"{kind}_vs_raw"]
        if args.pulls_only:
            return out
        small = random_state((16 if args.quick else 64) * 1024 * 1024, seed=1)
        off = await all_applied(server.url, small, args.engines, relay=False, run="bench-relay-off")
        on = await all_applied(server.url, small, args.engines, relay=True, run="bench-relay-on")
        out["publish_to_all_applied_s"] = {"relay_off": round(off["s"], 3), "relay_on": round(on["s"], 3)}
        out["upstream_bytes"] = {"relay_off": off["upstream_bytes"], "relay_on": on["upstream_bytes"]}
        out["relay_version_bytes"] = off["version_bytes"]
        out["engines"] = args.engines
        out["broadcast_MBps"] = round(await broadcast_MBps(server.url, state), 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="smaller versions and fewer GRPO steps (< 1 min)"
    )
    parser.add_argument("--engines", type=int, default=8)
    parser.add_argument(
        "--digests",
        type=lambda v: [d for d in v.split(",") if d],
        default=["sha256", "blake3"],
        help=f"chunk digests to pull with, side by side (comma-separated among {', '.join(DIGESTS)})",
    )
    parser.add_argument(
        "--rounds", type=int, default=2, help="rounds of the store pulls (digest order alternating; best kept)"
    )
    parser.add_argument(
        "--pulls-only", action="store_true", help="only the store pulls (no relay, broadcast or GRPO deltas)"
    )
    parser.add_argument(
        "--steps", type=int, default=0, help="GRPO steps per model (default 3; 1 with --quick)"
    )
    parser.add_argument("--broadcast-receiver", nargs=3, metavar=("URL", "RUN", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not args.digests or set(args.digests) - set(DIGESTS):
        parser.error(f"--digests takes a comma-separated list among {', '.join(DIGESTS)}")
    if args.broadcast_receiver:
        url, run, n = args.broadcast_receiver
        asyncio.run(broadcast_receiver(url, run, int(n)))
        return
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's per-request lines
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    steps = args.steps or (1 if args.quick else 3)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        # the event loop the services run on (rlbus service installs uvloop when it is there)
        loop_name = "uvloop" if install_uvloop() else "asyncio"
        result = asyncio.run(transfers(args, Path(tmp)))
        result["event_loop"] = loop_name
    print(f"transfers done in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    if args.pulls_only:
        result["wall_s"] = round(time.perf_counter() - t0, 1)
        print(json.dumps(result))
        return
    t1 = time.perf_counter()
    tiny = grpo_delta_ratio("tiny-addition", "addition", 1e-4, steps, 8, 8, 6)
    result["delta_ratio_tiny"] = round(tiny["ratio"], 1)
    result["delta_tiny"] = tiny
    big = grpo_delta_ratio(
        "smollm2",
        "word_problems",
        1e-6,
        steps,
        2 if args.quick else 4,
        2 if args.quick else 4,
        8 if args.quick else 32,
    )
    result["delta_ratio"] = round(big["ratio"], 1)
    print(f"GRPO deltas done in {time.perf_counter() - t1:.1f}s", file=sys.stderr)
    result["delta_model"] = big.pop("model")
    result["delta_smollm2"] = big
    result["broadcast_vs_raw"] = round(result["broadcast_MBps"] / result["raw_loopback_MBps"], 3)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
