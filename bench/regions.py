"""Bytes across the link between two regions per weight version: a relay in region B vs engines reading across.

    .venv/bin/python bench/regions.py --versions 6 --mib 4

Region A: a NATS hub with the trainer's weight store; region B: a leaf node (deploy/README.md, "Two
regions"); the leaf dials the hub through a TCP forwarder that counts bytes (``LinkProxy`` of
tests/cluster/test_regions.py). A publisher in A sends ``--versions`` versions of a ``--mib`` MiB float32
state (a full anchor every third version, sparse deltas between: 2 % of the weights change) and B's two
engines follow them, once through a relay in B (one read across the link, the engines read B's store),
once reading A's store across the link themselves. Prints each version's blob size and the bytes that
crossed while both engines took it; the last line is JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import nats  # noqa: E402
import torch  # noqa: E402

from services.lib.weights.client import WeightPublisher  # noqa: E402
from services.lib.weights.objstore import ObjectStoreBlobs  # noqa: E402
from services.lib.weights.transport import StoreReceiver  # noqa: E402
from services.runtime.natsd import hub_and_leaf  # noqa: E402
from services.runtime.weights_config import EncodingConfig, FsStoreConfig, StoreTransportConfig  # noqa: E402
from services.weightsync.config import RelayConfig, WeightsyncConfig  # noqa: E402
from services.weightsync.service import WeightsyncService  # noqa: E402
from tests.cluster.test_regions import LinkProxy, _linked  # noqa: E402
from tests.weightsync.helpers import perturb  # noqa: E402

RUN = "benchregions"


def states(n: int, mib: float) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    rows = max(1, int(mib * 1024 * 1024 / 4 / 1024))
    out = [{"w": torch.randn(rows, 1024, generator=g), "b": torch.randn(1024, generator=g)}]
    for i in range(1, n):
        out.append(perturb(out[-1], 0.02, seed=i))
    return out


async def measure(layout: str, versions: list[dict[str, torch.Tensor]], tmp: Path) -> list[dict]:
    proxy = LinkProxy()
    hub, leaf = hub_and_leaf(tmp / layout / "nats", leaf_link=f"{proxy.host}:{proxy.port}")
    proxy.start(hub.leafnode_port)
    hub.start()
    leaf.start()
    rows: list[dict] = []
    try:
        a = await nats.connect(hub.url)
        b = [await nats.connect(leaf.url) for _ in range(3)]
        while not await _linked(b[0]):
            await asyncio.sleep(0.2)  # the leaf dials once a second until the hub answers
        region = FsStoreConfig(root=str(tmp / layout / "regionb"), fsync=False)
        stop, relay_task = asyncio.Event(), None
        if layout == "relay":
            relay = WeightsyncService(b[0], WeightsyncConfig(run_id=RUN, gc_upstream=False, relay=RelayConfig(
                scope="regionb", store=region, keep_anchors=100)))
            relay_task = asyncio.create_task(relay.run(stop), name="relay")
            transport = StoreTransportConfig(scope="regionb", store=region, recheck_s=1.0)
        else:
            transport = StoreTransportConfig(recheck_s=1.0)  # A's store and scope, across the link
        engines = [StoreReceiver(transport, nc, RUN) for nc in b[1:]]
        followers = [asyncio.create_task(_follow(e), name=f"engine-{i}") for i, e in enumerate(engines)]
        pub = WeightPublisher(a, RUN, ObjectStoreBlobs(a), encoding=EncodingConfig(anchor_every=3))
        for v, state in enumerate(versions, start=1):
            before = proxy.down
            m = await pub.publish(state, version=v)
            while not all(e.version == v for e in engines):
                await asyncio.sleep(0.02)  # polling the engines' held version: the figure is bytes, not time
            rows.append({"layout": layout, "version": v, "kind": m.kind, "blob_bytes": m.blob_nbytes,
                         "link_bytes": proxy.down - before})
        stop.set()
        for t in followers:
            t.cancel()
        await asyncio.gather(*followers, return_exceptions=True)
        for e in engines:
            await e.close()
        if relay_task is not None:
            await relay_task
        for nc in (a, *b):
            await nc.close()
    finally:
        leaf.stop()
        hub.stop()
        proxy.stop()
    return rows


async def _follow(receiver: StoreReceiver) -> None:
    async for _ in receiver:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--versions", type=int, default=6)
    ap.add_argument("--mib", type=float, default=4.0, help="size of the float32 state")
    args = ap.parse_args()
    versions = states(args.versions, args.mib)
    with tempfile.TemporaryDirectory(prefix="rlbus-regions-") as tmp:
        rows = [r for layout in ("relay", "direct") for r in asyncio.run(measure(layout, versions, Path(tmp)))]
    print(f"{'layout':8} {'v':>2} {'kind':6} {'blob bytes':>12} {'link bytes':>12} {'link/blob':>9}")
    for r in rows:
        print(f"{r['layout']:8} {r['version']:>2} {r['kind']:6} {r['blob_bytes']:>12} {r['link_bytes']:>12} "
              f"{r['link_bytes'] / r['blob_bytes']:>9.2f}")
    totals = {lay: sum(r["link_bytes"] for r in rows if r["layout"] == lay) for lay in ("relay", "direct")}
    blobs = sum(r["blob_bytes"] for r in rows if r["layout"] == "relay")
    print(json.dumps({"blob_bytes": blobs, "link_bytes": totals,
                      "link_per_blob": {k: round(v / blobs, 3) for k, v in totals.items()}}))


if __name__ == "__main__":
    main()
