"""Two regions, one copy of each weight version across the link between them.

Region A is a NATS hub (the run's JetStream, domain ``hub``) with the trainer's weight store; region B is a
NATS leaf node without JetStream of its own (its clients use the hub's, ``default_js_domain``). The leaf
dials the hub through :class:`LinkProxy`, a TCP forwarder this file owns that counts the bytes crossing
and can cut the link and restore it. In region B a weightsync relay reads each version once across the
link into region B's store (a directory standing for a regional filesystem or bucket) and announces it
under scope ``regionb``; region B's two engines read it there. Cutting the link keeps B's engines on their
last version; they catch up when it returns (deploy/README.md, "Two regions")."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import nats
import pytest
import torch

from proto import catalog
from services.launcher.accounting import accounting, read_channel
from services.launcher.status import members
from services.lib.weights.client import WeightPublisher
from services.lib.weights.index import VersionIndex
from services.lib.weights.objstore import ObjectStoreBlobs
from services.lib.weights.transport import StoreReceiver
from services.runtime.natsd import free_port, hub_and_leaf
from services.runtime.weights_config import EncodingConfig, FsStoreConfig, StoreTransportConfig
from services.weightsync.config import RelayConfig, WeightsyncConfig
from services.weightsync.service import WeightsyncService
from tests.conftest import run_file, trainer_records, wait_for, wait_for_async
from tests.weightsync.helpers import assert_bit_identical, make_state, perturb

RUN = "regions"
ROOT = Path(__file__).resolve().parents[2]
KiB = 1024


class LinkProxy:
    """TCP forwarder on ``port`` to ``target_port`` (the hub's leaf-node port) in a thread of its own.

    ``down`` counts bytes from the hub to the leaf (what region B reads), ``up`` the other way.
    :meth:`cut` stops listening and aborts every connection (the link is down: the leaf's redials are
    refused); :meth:`restore` listens again on the same port."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host, self.port = host, free_port(host)
        self.target_port: int | None = None
        self.down = self.up = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="link-proxy", daemon=True)
        self._server: asyncio.Server | None = None
        self._transports: set[asyncio.BaseTransport] = set()

    def _call(self, coro):  # run a coroutine on the proxy's loop and wait for it
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    def start(self, target_port: int) -> None:
        self.target_port = target_port
        self._thread.start()
        self.restore()

    def restore(self) -> None:
        async def listen() -> None:
            self._server = await asyncio.start_server(self._connection, self.host, self.port)
        self._call(listen())

    def cut(self) -> None:
        async def close() -> None:
            if self._server is not None:
                self._server.close()
                self._server = None
            for t in list(self._transports):
                t.abort()
            self._transports.clear()
        self._call(close())

    def stop(self) -> None:
        if self._thread.is_alive():
            self.cut()
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(self.host, self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self._transports |= {writer.transport, up_writer.transport}
        await asyncio.gather(self._pipe(reader, up_writer, "up"), self._pipe(up_reader, writer, "down"))

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, way: str) -> None:
        try:
            while data := await reader.read(1 << 16):
                if way == "down":
                    self.down += len(data)
                else:
                    self.up += len(data)
                writer.write(data)
                await writer.drain()
        except (OSError, ConnectionError):
            pass  # the link was cut (or a side closed): the other pipe ends too
        finally:
            self._transports.discard(writer.transport)
            writer.transport.abort()


@pytest.fixture
def regions(tmp_path):
    """(hub, leaf, proxy): region A's hub, region B's leaf node, the counted link between them."""
    proxy = LinkProxy()
    hub, leaf = hub_and_leaf(tmp_path / "nats", leaf_link=f"{proxy.host}:{proxy.port}")
    proxy.start(hub.leafnode_port)
    try:
        hub.start()
        leaf.start()
        yield hub, leaf, proxy
    finally:
        leaf.stop()
        hub.stop()
        proxy.stop()


async def _linked(nc: nats.NATS) -> bool:
    """Whether a client of the leaf reaches the hub's JetStream (the leaf link is up)."""
    try:
        await nc.jetstream(timeout=1.0).account_info()
        return True
    except Exception:  # no responders / timeout while the link is down
        return False


def _states(n: int) -> list[dict[str, torch.Tensor]]:
    states = [make_state(1, torch.bfloat16, scale=256)]  # ~0.5 MiB of weights
    for i in range(1, n):
        states.append(perturb(states[-1], 0.02, seed=100 + i))
    return states


async def test_relay_reads_each_version_once_across_the_link_and_catches_up_after_a_cut(regions, tmp_path):
    hub, leaf, proxy = regions
    a = await nats.connect(hub.url)
    b = [await nats.connect(leaf.url) for _ in range(3)]  # region B: the relay and two engines
    await wait_for_async(lambda: _linked(b[0]), 30, "the leaf link to come up", interval=0.2)
    region_store = FsStoreConfig(root=str(tmp_path / "regionb-weights"), fsync=False)
    relay = WeightsyncService(b[0], WeightsyncConfig(
        run_id=RUN, gc_upstream=False, recheck_s=1.0,
        relay=RelayConfig(scope="regionb", store=region_store, keep_anchors=3)))
    stop = asyncio.Event()
    relay_task = asyncio.create_task(relay.run(stop), name="relay")
    engines = [StoreReceiver(StoreTransportConfig(scope="regionb", store=region_store, recheck_s=1.0), nc, RUN)
               for nc in b[1:]]
    held: list[dict[int, dict[str, torch.Tensor]]] = [{}, {}]

    async def follow(i: int) -> None:
        async for version, state in engines[i]:
            held[i][version] = {k: t.clone() for k, t in state.items()}

    followers = [asyncio.create_task(follow(i), name=f"engine-{i}") for i in range(2)]
    pub = WeightPublisher(a, RUN, ObjectStoreBlobs(a), encoding=EncodingConfig(anchor_every=3, chunk_bytes=256 * KiB))
    states = _states(5)
    try:
        # versions 1-3 (an anchor and two deltas) with the link up: each crosses once
        per_version = []
        for v in (1, 2, 3):
            before = proxy.down
            manifest = await pub.publish(states[v - 1], version=v)
            await wait_for_async(lambda v=v: all(e.version == v for e in engines), 30, f"both engines at v{v}")
            per_version.append((v, manifest.blob_nbytes, proxy.down - before))
        for _, blob, crossed in per_version:
            # one copy plus the announcements, manifests and acks the two engines and the relay exchange
            assert blob <= crossed < 1.1 * blob + 64 * KiB, per_version
        anchor, crossed = per_version[0][1:]
        assert anchor > 512 * KiB and crossed < 1.5 * anchor, per_version  # one copy; one per engine is 2x
        assert relay.upstream_store.stats.bytes_read == sum(blob for _, blob, _ in per_version)

        # the link is cut: two more versions upstream; region B keeps v3 and keeps trying
        proxy.cut()
        failures = relay.stats.upstream_failures
        cut_m4 = await pub.publish(states[3], version=4)
        cut_m5 = await pub.publish(states[4], version=5)
        await wait_for_async(lambda: relay.stats.upstream_failures > failures, 60,
                             "the relay to notice the upstream is unreachable")
        assert [e.version for e in engines] == [3, 3]
        assert relay.last_handled == 3

        # the link returns: the relay copies v5 and the chain it needs (v4, its anchor) once; both engines catch up
        before = proxy.down
        proxy.restore()
        await wait_for_async(lambda: all(e.version == 5 for e in engines), 60, "both engines at v5 after the cut")
        crossed = proxy.down - before
        chain = cut_m4.blob_nbytes + cut_m5.blob_nbytes
        assert cut_m4.kind == "full" and cut_m5.kind == "delta"
        assert chain <= crossed < 1.1 * chain + 64 * KiB, (crossed, chain)
        for i in range(2):
            assert_bit_identical(held[i][5], {k: t for k, t in states[4].items()})
            assert 4 not in held[i]  # skipped: the engines went from v3 to v5
    finally:
        stop.set()
        for t in followers:
            t.cancel()
        await asyncio.gather(*followers, return_exceptions=True)
        for e in engines:
            await e.close()
        await asyncio.wait_for(relay_task, 20)
        for nc in (a, *b):
            await nc.close()



# ---- the RL loop across the two regions ----


def trainer_version(metrics: Path) -> int:
    return max((int(r["trainer/version"]) for r in trainer_records(metrics)), default=0)


def region_b_versions(url: str, run: str) -> dict[str, int]:
    """Weight version each region-B engine last reported (heartbeats in the hub's members bucket)."""
    async def go() -> dict[str, int]:
        nc = await nats.connect(url)
        try:
            return {m["instance"]: int(m["metrics"].get("rollout/weight_version", -1))
                    for m in await members(nc.jetstream(), run)
                    if m["instance"].startswith("rollout-b") and m["age_s"] < 5}
        finally:
            await nc.close()
    return asyncio.run(go())


def relay_gauges(url: str, run: str) -> dict[str, float]:
    """The region-B relay's figures from its last heartbeat (``weightsync/...``)."""
    async def go() -> dict[str, float]:
        nc = await nats.connect(url)
        try:
            return next(m["metrics"] for m in await members(nc.jetstream(), run) if m["instance"] == "relay-b")
        finally:
            await nc.close()
    return asyncio.run(go())


def stored_versions(root: Path, run: str) -> list[int]:
    """Versions region B's store holds (chunk directories ``<run>/v<version>``)."""
    d = root / run
    return sorted(int(p.name[1:]) for p in d.iterdir() if p.name.startswith("v")) if d.is_dir() else []


@pytest.mark.slow
def test_loop_across_two_regions_sends_one_copy_per_version_and_rides_out_a_cut(regions, tmp_path, loop_model_dir):
    hub, leaf, proxy = regions
    run = "tworegions"
    store = tmp_path / "regionb-weights"
    common = {"heartbeat_s": 1.0, "drain_timeout_s": 3.0}
    trainer = {"groups_per_step": 4, "total_steps": 100000, "max_staleness": 1, "group_timeout_s": 60}
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    cfg_a = run_file(tmp_path / "a", loop_model_dir, run_id=run, nats_url=hub.url, common=common, trainer=trainer,
                     rollout={"max_tickets": 4})
    region_store = {"type": "fs", "root": str(store), "fsync": False}
    cfg_b = run_file(tmp_path / "b", loop_model_dir, run_id=run, nats_url=leaf.url, common=common, trainer=trainer,
                     rollout={"max_tickets": 2, "weights_from": {"scope": "regionb", "store": region_store}},
                     weights={"type": "store", "recheck_s": 2.0},
                     extra="[services.weightsync]\ngc_upstream = false\nrecheck_s = 2.0\n"
                           f"relay = {{ scope = \"regionb\", keep_anchors = 1000, store = {{ type = \"fs\", "
                           f"root = {json.dumps(str(store))}, fsync = false }} }}\n")
    metrics = tmp_path / "a" / "run" / "metrics.jsonl"
    layout = [(cfg_a, "trainer", "trainer-0"), (cfg_a, "judge", "judge-0"), (cfg_a, "rollout", "rollout-a0"),
              (cfg_b, "weightsync", "relay-b"), (cfg_b, "rollout", "rollout-b0"), (cfg_b, "rollout", "rollout-b1")]
    procs: list[subprocess.Popen] = []
    try:
        for cfg, svc, instance in layout:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "services.launcher.cli", "service", svc, "--config", str(cfg),
                 "--instance", instance], cwd=ROOT, stdout=open(tmp_path / f"{instance}.log", "wb"),
                stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}))
        wait_for(lambda: trainer_version(metrics) >= 3, 600, "three steps", interval=1.0)
        wait_for(lambda: len([v for v in region_b_versions(hub.url, run).values() if v >= 1]) == 2, 300,
                 "both region-B engines on a relayed version", interval=1.0)
        assert all(p.poll() is None for p in procs), [p.args for p in procs if p.poll() is not None]

        # cut the link: region A trains on; region B's store (its engines' only source) gets nothing new
        def notices() -> dict[str, int]:  # the relay's and the engines' logged failures to reach region A
            logs = {name: (tmp_path / f"{name}.log").read_text() for name in ("relay-b", "rollout-b0", "rollout-b1")}
            return {"relay-b": logs["relay-b"].count("upstream unavailable"),
                    **{n: logs[n].count("weight transport interrupted") for n in ("rollout-b0", "rollout-b1")}}

        before = notices()
        proxy.cut()
        wait_for(lambda: all(n > before[k] for k, n in notices().items()), 60,
                 "the relay and both region-B engines to notice the link is down", interval=0.5)
        at_cut = max(stored_versions(store, run))  # a copy already across when the link went is stored
        wait_for(lambda: trainer_version(metrics) >= at_cut + 3, 600, "three versions past region B's", interval=1.0)
        assert max(stored_versions(store, run)) == at_cut
        assert all(p.poll() is None for p in procs), "a service died while the link was down"

        # restore it: the relay copies the newest version (and its chain) once; both engines catch up
        proxy.restore()
        target = trainer_version(metrics)
        wait_for(lambda: len([v for v in region_b_versions(hub.url, run).values() if v >= target]) == 2, 300,
                 f"both region-B engines at v{target} or newer", interval=1.0)
        at_restore = trainer_version(metrics)
        wait_for(lambda: trainer_version(metrics) >= at_restore + 2, 600, "two more steps", interval=1.0)
        relay = relay_gauges(hub.url, run)
        for p in procs[1:]:
            p.terminate()
        for p in procs[1:]:
            p.wait(60)
        procs[0].terminate()
        procs[0].wait(60)

        async def check() -> tuple[dict, int, int, list, list]:
            nc = await nats.connect(hub.url)
            try:
                acc = await accounting(nc.jetstream(), run)
                index = VersionIndex(nc, run, "regionb")
                relayed = [await index.manifest(v) for v in await index.versions()]
                main = VersionIndex(nc, run, "main")
                published = len(await main.versions())
                trajectories = await read_channel(nc.jetstream(), catalog.TRAJECTORIES, run)
                outcomes = await read_channel(nc.jetstream(), catalog.OUTCOMES, run)
                return acc, published, [m for m in relayed if m], trajectories, outcomes
            finally:
                await nc.close()

        acc, published, relayed, trajectories, outcomes = asyncio.run(check())
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    by_worker = {t.msg_id: t.rollout.worker for t in trajectories}
    b_outcomes = [o for o in outcomes if by_worker.get(o.trajectory_id, "").startswith("rollout-b")]
    relayed_bytes = sum(m.blob_nbytes for m in relayed)
    print(f"\nlink: {proxy.down} B down, {proxy.up} B up; {len(relayed)} of {published} versions relayed "
          f"({sum(m.kind == 'full' for m in relayed)} full), {relayed_bytes} B of weights, "
          f"{proxy.down / len(relayed):.0f} B down per relayed version, largest version {max(m.blob_nbytes for m in relayed)} B; "
          f"region B staleness max {max((o.version - o.sample_version for o in b_outcomes), default=None)}, "
          f"dropped {acc['dropped']}")
    # one copy of every relayed version crossed, at most one more (cut mid-transfer) and the run's small
    # messages; a copy per engine would be twice the relayed bytes
    largest = max(m.blob_nbytes for m in relayed)
    # with more than 1.2 versions' worth relayed, the bound below is under two copies (one per engine)
    assert relayed_bytes > 1.2 * largest, relayed
    assert relayed_bytes <= proxy.down < 1.1 * relayed_bytes + largest, (proxy.down, relayed_bytes)
    # the relay's own count (its heartbeat, read before the last versions): each version it copied, once
    assert relay["weightsync/upstream_failures"] >= 1 and relay["weightsync/relayed_versions"] >= 3, relay
    assert relay["weightsync/upstream_bytes"] <= relayed_bytes, (relay, relayed_bytes)
    # region B's engines fell three versions behind over the cut (its store held nothing newer, above); what
    # they generated then is filtered as usual: none trained on was more than max_staleness behind the step's
    # starting version (a trained outcome's version is the step's); the too-old ones were dropped (whether B
    # held a ticket at the cut is up to timing: the staleness and drops are printed above)
    assert b_outcomes, "no trajectory of region B's engines was recorded"
    assert all(o.version - 1 - o.sample_version <= trainer["max_staleness"] for o in b_outcomes
               if o.outcome == "trained"), b_outcomes
    assert acc["lost"] == 0 and acc["outcomes_without_trajectory"] == 0 and acc["trained"] > 0, acc
    assert acc["published"] == acc["trained"] + acc["dropped"] + acc["eval"] + acc["pending"] - acc["multiple_outcomes"]


async def test_version_listing_and_watches_leave_no_consumer_behind(nats_url):
    """Retention lists a scope's versions after every version and relays re-subscribe their watches: each
    time a consumer is made, and it must be deleted (the server keeps a stopped watch's consumer, and a long
    run would pile them up until JetStream refuses new ones)."""
    nc = await nats.connect(nats_url)
    try:
        index = VersionIndex(nc, RUN, "main")
        await index.ensure()
        for _ in range(20):
            await index.versions()
            watch = aiter(index.watch(include_current=True))
            nxt = asyncio.ensure_future(anext(watch))
            await asyncio.wait({nxt}, timeout=0.05)  # nothing announced: the watch is open, then dropped
            nxt.cancel()
            await asyncio.wait({nxt})
            await watch.aclose()
        info = await nc.jetstream().stream_info(f"KV_{index.bucket}")
        assert info.state.consumer_count == 0, info.state
    finally:
        await nc.close()
