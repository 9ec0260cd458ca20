"""Retention: keep the last few anchors and the deltas that lead from them; delete the rest.

A version is kept when it is at or after the oldest kept anchor, or when it is
needed to rebuild the latest announced version (its anchor and the deltas in
between) or a protected version. Manifests are deleted before their chunks,
so no reader starts on a version that is going away. Chunks in the store
that no manifest mentions (a publisher that crashed mid-upload) and that are
older than the oldest kept version are deleted as well.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

from proto.weights import WeightManifest
from services.lib.weights.index import VersionIndex
from services.lib.weights.store import BlobStore

log = logging.getLogger("rlbus.weightsync.retention")

_VERSION_DIR = re.compile(r"^[^/]+/v(\d+)/")


class ManifestCache:
    """Manifests are immutable once written: fetch each from KV once."""

    def __init__(self, index: VersionIndex) -> None:
        self.index = index
        self._by_version: dict[int, WeightManifest] = {}

    async def get(self, version: int) -> WeightManifest | None:
        m = self._by_version.get(version)
        if m is None:
            m = await self.index.manifest(version)
            if m is not None:
                self._by_version[version] = m
        return m

    def forget(self, version: int) -> None:
        self._by_version.pop(version, None)


def versions_to_keep(
    manifests: dict[int, WeightManifest], keep_anchors: int, needed: Iterable[int] = ()
) -> set[int]:
    """The versions retention keeps (pure function; see the module docstring)."""
    if keep_anchors < 1:
        raise ValueError("keep_anchors must be at least 1")
    versions = sorted(manifests)
    anchors = [v for v in versions if manifests[v].kind == "full"]
    floor = anchors[-keep_anchors] if len(anchors) >= keep_anchors else (versions[0] if versions else 0)
    keep = {v for v in versions if v >= floor}
    for v in needed:
        m = manifests.get(v)
        # walk the chain of a needed version back to its anchor
        while m is not None:
            keep.add(m.version)
            if m.kind == "full" or m.base_version is None:
                break
            m = manifests.get(m.base_version)
    return keep


async def collect_garbage(
    index: VersionIndex,
    store: BlobStore,
    keep_anchors: int,
    cache: ManifestCache | None = None,
    protect: Iterable[int] = (),
) -> list[int]:
    """Delete versions retention does not keep; returns the deleted versions."""
    cache = cache or ManifestCache(index)
    manifests: dict[int, WeightManifest] = {}
    for v in await index.versions():
        m = await cache.get(v)
        if m is not None:
            manifests[v] = m
    if not manifests:
        return []
    latest = await index.latest()
    needed = list(protect) + ([latest.policy_version] if latest is not None else [])
    keep = versions_to_keep(manifests, keep_anchors, needed)
    doomed = sorted(v for v in manifests if v not in keep)
    for v in doomed:
        await index.delete_manifest(v)
        for c in manifests[v].chunks:
            await store.delete(c.name)
        cache.forget(v)
    # orphans: chunks of versions with no manifest, older than everything kept
    oldest_kept = min(keep) if keep else 0
    for name in await store.list(f"{index.run_id}/"):
        match = _VERSION_DIR.match(name)
        if match and int(match.group(1)) < oldest_kept and int(match.group(1)) not in manifests:
            await store.delete(name)
    if doomed:
        log.info("retention for run %s scope %s deleted versions %s", index.run_id, index.scope, doomed)
    return doomed
