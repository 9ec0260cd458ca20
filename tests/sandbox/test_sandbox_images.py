"""Images: an OCI image layout (or its archive) unpacked locally, layer by layer with whiteouts, cached,
and used as ``base = NAME``; unsafe layers are refused (real bwrap backend, as root)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile

import pytest
from sbx_helpers import RUN, make_config, sh

from proto import sandbox as api
from services.sandbox.backend import BackendUnavailable
from services.sandbox.bwrap import BwrapBackend
from services.sandbox.images import resolve_image


def _layer(entries: list[tuple[str, str | bytes | None]], gz: bool) -> bytes:
    """A layer tar: (name, bytes) a file, (name, None) a directory, (name, "->target") a symlink."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz" if gz else "w") as tar:
        for name, data in entries:
            info = tarfile.TarInfo(name)
            if data is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            elif isinstance(data, str):
                info.type, info.linkname = tarfile.SYMTYPE, data[2:]
                tar.addfile(info)
            else:
                info.size, info.mode = len(data), 0o644
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def write_oci(layout: str, layers: list[tuple[bytes, bool]]) -> str:
    """An OCI image layout with ``layers`` (bytes, gzipped); returns the manifest digest."""
    blobs = os.path.join(layout, "blobs", "sha256")
    os.makedirs(blobs)

    def put(data: bytes) -> str:
        digest = hashlib.sha256(data).hexdigest()
        with open(os.path.join(blobs, digest), "wb") as f:
            f.write(data)
        return f"sha256:{digest}"

    config = json.dumps({"architecture": "amd64", "os": "linux", "rootfs": {"type": "layers"}}).encode()
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": put(config),
                   "size": len(config)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar" + ("+gzip" if gz else ""),
                    "digest": put(data), "size": len(data)} for data, gz in layers],
    }).encode()
    digest = put(manifest)
    with open(os.path.join(layout, "index.json"), "w") as f:
        json.dump({"schemaVersion": 2, "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json",
                                                      "digest": digest, "size": len(manifest)}]}, f)
    with open(os.path.join(layout, "oci-layout"), "w") as f:
        f.write('{"imageLayoutVersion": "1.0.0"}')
    return digest


def two_layers() -> list[tuple[bytes, bool]]:
    base = [("usr", None), ("etc", None), ("etc/image-marker", b"from-oci\n"), ("etc/old", b"gone\n"),
            ("opt", None), ("opt/a", b"a"), ("opt/b", b"b"), ("bin", "->usr/bin"), ("lib", "->usr/lib")]
    if os.path.isdir("/usr/lib64"):
        base.append(("lib64", "->usr/lib64"))
    top = [("etc/.wh.old", b""), ("opt/.wh..wh..opq", b""), ("opt/c", b"c"), ("etc/added", b"top\n")]
    return [(_layer(base, gz=True), True), (_layer(top, gz=False), False)]


def test_an_oci_layout_is_unpacked_with_its_whiteouts_and_cached(tmp_path):
    layout = str(tmp_path / "img")
    digest = write_oci(layout, two_layers())
    cache = str(tmp_path / "cache")
    root = resolve_image("img", layout, cache)
    assert root == os.path.join(cache, digest.replace(":", "-"), "rootfs")
    assert open(os.path.join(root, "etc", "image-marker")).read() == "from-oci\n"
    assert open(os.path.join(root, "etc", "added")).read() == "top\n"
    assert not os.path.lexists(os.path.join(root, "etc", "old"))  # whited out by the top layer
    assert sorted(os.listdir(os.path.join(root, "opt"))) == ["c"]  # made opaque, then c added
    assert os.readlink(os.path.join(root, "bin")) == "usr/bin"
    stamp = os.stat(root).st_mtime_ns
    assert resolve_image("img", layout, cache) == root and os.stat(root).st_mtime_ns == stamp  # cached
    # the same image as an OCI archive (podman save --format oci-archive)
    archive = str(tmp_path / "img.tar")
    with tarfile.open(archive, "w") as tar:
        tar.add(layout, arcname=".")
    assert resolve_image("img", archive, cache) == root


def test_a_layer_reaching_outside_the_root_is_refused(tmp_path):
    layout = str(tmp_path / "evil")
    write_oci(layout, [(_layer([("etc", None), ("../../escaped", b"x")], gz=False), False)])
    with pytest.raises(BackendUnavailable, match="refused"):
        resolve_image("evil", layout, str(tmp_path / "cache"))
    assert not (tmp_path / "escaped").exists() and not os.path.exists(tmp_path / "cache" / "escaped")


async def test_base_from_an_oci_image_runs_and_forks(state_root, events):
    layout = os.path.join(state_root, "img")
    write_oci(layout, two_layers())
    b = BwrapBackend(make_config(state_root + "/root", images={"oci": layout}), events)
    # the image has no programs of its own: bind the host's /usr into its unpacked root for the test
    root = resolve_image("oci", layout, os.path.join(state_root, "root", ".images"))
    usr = os.path.join(root, "usr")
    if os.system(f"mount --bind /usr {usr}") != 0:
        pytest.fail("cannot bind-mount /usr: the sandbox tests run as root (as the sandbox service does)")
    try:
        try:
            await b.start()
        except BackendUnavailable as e:
            pytest.fail(f"bwrap backend unavailable: {e} (./rlbus installs bubblewrap)")
        try:
            sid = (await b.create(api.CreateRequest(run_id=RUN, base="oci"))).sandbox_id
            r = await sh(b, sid, "cat /etc/image-marker /etc/added; ls /opt; echo w > f")
            assert r.stdout == b"from-oci\ntop\nc\n", r.stderr
            fork = await b.fork(api.ForkRequest(run_id=RUN, source=api.FromSandbox(sandbox_id=sid)))
            assert (await sh(b, fork.sandbox_id, "cat f /etc/image-marker")).stdout == b"w\nfrom-oci\n"
        finally:
            await b.close()
    finally:
        os.system(f"umount {usr}")
