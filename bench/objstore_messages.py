"""Object-store pull speed by chunk-message size, side by side with a raw loopback copy.

Each variant publishes one full version (random bf16, ``--mb`` MB) into the
embedded nats-server's object store with a given ``message_bytes`` and fetches
it verified (sha256 of every chunk) three times; the best of three is compared
with a plain socket copy of the same bytes measured just before it.

Usage: ``python bench/objstore_messages.py [--mb 256]``; the last stdout line is JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import nats  # noqa: E402
from weightsync import MB, random_state, raw_loopback_MBps  # noqa: E402

from services.lib.weights.client import WeightPublisher, WeightSubscriber  # noqa: E402
from services.lib.weights.encoding import encode_full  # noqa: E402
from services.lib.weights.store import open_store  # noqa: E402
from services.runtime.natsd import EmbeddedNats  # noqa: E402
from services.runtime.service import install_uvloop  # noqa: E402
from services.runtime.weights_config import EncodingConfig, ObjStoreConfig  # noqa: E402

KiB = 1024
SIZES = [512 * KiB, 2048 * KiB, 4096 * KiB, 7168 * KiB]


async def pull(nc, cfg: ObjStoreConfig, state, run: str) -> float:
    pub = WeightPublisher(nc, run, open_store(cfg, nc), encoding=EncodingConfig(anchor_every=1))
    manifest = await pub.publish(state, 1)
    best = 0.0
    for _ in range(3):
        sub = WeightSubscriber(nc, run, open_store(cfg, nc))
        t0 = time.perf_counter()
        await sub.fetch(manifest, copy=False)
        best = max(best, manifest.blob_nbytes / (time.perf_counter() - t0) / MB)
        await sub.store.close()
    await pub.store.close()
    return best


async def main(mb: int) -> dict[str, object]:
    state = random_state(mb * 1024 * 1024)
    data = encode_full(state).buf
    out: dict[str, object] = {"version_MB": round(len(data) / MB, 1)}
    with tempfile.TemporaryDirectory() as tmp, EmbeddedNats(Path(tmp) / "nats", port=None) as server:
        nc = await nats.connect(server.url)
        for i, size in enumerate(SIZES):
            raw = raw_loopback_MBps(data)
            got = await pull(nc, ObjStoreConfig(message_bytes=size, bucket=f"msgbench{i}"), state, f"m{i}")
            out[f"msg_{size // KiB}KiB"] = {"pull_MBps": round(got, 1), "raw_MBps": round(raw, 1),
                                            "vs_raw": round(got / raw, 3)}
            print(f"message {size // KiB:5d} KiB: pull {got:7.1f} MB/s, raw {raw:7.1f} MB/s, "
                  f"ratio {got / raw:.3f}", file=sys.stderr)
        await nc.close()
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=256, help="version size in MB (default 256)")
    args = parser.parse_args()
    loop_name = "uvloop" if install_uvloop() else "asyncio"  # the services' event loop
    print(json.dumps({**asyncio.run(main(args.mb)), "event_loop": loop_name}))
