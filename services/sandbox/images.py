"""Images for ``base = NAME``: a root filesystem directory, or an OCI image unpacked locally (no registry).

``[services.sandbox] images = { NAME = PATH }`` where PATH is

* a directory holding a root filesystem (used as it is);
* an OCI image layout directory (``oci-layout``, ``index.json``, ``blobs/``), e.g. from
  ``podman save --format oci-dir`` or ``skopeo copy ... oci:DIR``;
* a tar archive of one (``podman save --format oci-archive``), plain or gzip-compressed.

An OCI image is unpacked once into ``<root_dir>/.images/<manifest digest>/rootfs`` (cached across
restarts; the digest names exactly what was unpacked): its layers are applied in order, with the OCI
whiteouts (``.wh.NAME`` removes NAME from the layers below, ``.wh..wh..opq`` empties the directory) and
tar's own safety filter (no absolute paths, nothing outside the root, no device nodes). The result is one
read-only root shared by every sandbox of that base (and so by their forks, which stay O(1): only their
writable layers are their own).

:func:`build_debian` makes such a root filesystem from Debian packages with ``mmdebstrap`` (a small Python
image for the coding example): ``python -m services.sandbox.images build-debian DEST``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile

from services.sandbox.backend import BackendUnavailable

log = logging.getLogger("rlbus.sandbox.images")

WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"
LAYER_TYPES = ("tar", "tar+gzip")


def is_oci_layout(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "oci-layout")) and os.path.isfile(os.path.join(path, "index.json"))


def _blob(layout: str, digest: str) -> str:
    algo, _, hexd = digest.partition(":")
    if algo != "sha256" or not hexd.isalnum():
        raise BackendUnavailable(f"OCI image {layout}: unsupported digest {digest!r}")
    return os.path.join(layout, "blobs", algo, hexd)


def _manifest(layout: str) -> tuple[str, dict]:
    """The (first) image manifest of an OCI layout and its digest, following one level of image index."""
    with open(os.path.join(layout, "index.json")) as f:
        index = json.load(f)
    for _ in range(2):
        manifests = index.get("manifests") or []
        if not manifests:
            raise BackendUnavailable(f"OCI image {layout}: index.json lists no manifest")
        desc = manifests[0]
        with open(_blob(layout, desc["digest"])) as f:
            doc = json.load(f)
        if "layers" in doc:
            return desc["digest"], doc
        index = doc  # an image index: take its first manifest
    raise BackendUnavailable(f"OCI image {layout}: no image manifest found")


def _apply_whiteouts(rootfs: str, members: list[tarfile.TarInfo]) -> list[tarfile.TarInfo]:
    """Apply a layer's whiteouts to what the layers below left; returns the members to extract."""
    keep = []
    for m in members:
        head, name = os.path.split(m.name.lstrip("./").rstrip("/"))
        if name == OPAQUE:
            target = os.path.join(rootfs, head)
            if os.path.isdir(target) and not os.path.islink(target):
                for entry in os.listdir(target):
                    _remove(os.path.join(target, entry))
        elif name.startswith(WHITEOUT):
            _remove(os.path.join(rootfs, head, name[len(WHITEOUT):]))
        else:
            keep.append(m)
    return keep


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


def _layer_filter(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo | None:
    """tar's filter (no absolute paths, nothing outside ``dest``), device nodes skipped (/dev is bwrap's)."""
    if member.ischr() or member.isblk() or member.isfifo():
        return None
    return tarfile.tar_filter(member, dest)


def unpack_oci(layout: str, cache_dir: str) -> str:
    """The root filesystem of the OCI image at ``layout`` (unpacked into ``cache_dir`` once); its path."""
    digest, manifest = _manifest(layout)
    target = os.path.join(cache_dir, digest.replace(":", "-"))
    rootfs = os.path.join(target, "rootfs")
    if os.path.isdir(rootfs):
        return rootfs
    os.makedirs(cache_dir, mode=0o755, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".unpack-", dir=cache_dir)
    try:
        work = os.path.join(tmp, "rootfs")
        os.mkdir(work, 0o755)
        for layer in manifest["layers"]:
            media = layer.get("mediaType", "")
            if not media.endswith(LAYER_TYPES):
                raise BackendUnavailable(f"OCI image {layout}: layer type {media!r} is not supported "
                                         "(tar or tar+gzip)")
            path = _blob(layout, layer["digest"])
            with open(path, "rb") as raw:
                if hashlib.file_digest(raw, "sha256").hexdigest() != layer["digest"].split(":", 1)[1]:
                    raise BackendUnavailable(f"OCI image {layout}: layer {layer['digest']} does not match its digest")
            with tarfile.open(path, "r:*") as tar:
                # whiteouts first (they hide what the layers below left), then this layer's own files
                keep = _apply_whiteouts(work, tar.getmembers())
                try:
                    tar.extractall(work, members=keep, numeric_owner=True, filter=_layer_filter)
                except tarfile.FilterError as e:
                    raise BackendUnavailable(f"OCI image {layout}: layer {layer['digest']} refused: {e}") from None
        os.chmod(work, 0o755)
        os.chmod(tmp, 0o755)  # mkdtemp made it 0700: the sandbox user (bwrap binds as it) must reach the root
        os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("unpacked OCI image %s (%s, %d layers) into %s", layout, digest, len(manifest["layers"]), rootfs)
    return rootfs


def resolve_image(name: str, path: str, cache_dir: str) -> str:
    """A root filesystem directory for image ``name`` configured as ``path`` (see the module docstring)."""
    if os.path.isdir(path):
        return unpack_oci(path, cache_dir) if is_oci_layout(path) else path
    if os.path.isfile(path) and tarfile.is_tarfile(path):
        os.makedirs(cache_dir, mode=0o755, exist_ok=True)
        with open(path, "rb") as f:
            key = hashlib.file_digest(f, "sha256").hexdigest()
        layout = os.path.join(cache_dir, f"archive-{key}")
        if not is_oci_layout(layout):
            tmp = tempfile.mkdtemp(prefix=".archive-", dir=cache_dir)
            with tarfile.open(path) as tar:
                tar.extractall(tmp, filter="data")
            if not is_oci_layout(tmp):
                shutil.rmtree(tmp, ignore_errors=True)
                raise BackendUnavailable(f"image {name!r}: {path} is a tar archive but not of an OCI image layout")
            shutil.rmtree(layout, ignore_errors=True)
            os.rename(tmp, layout)
        return unpack_oci(layout, cache_dir)
    raise BackendUnavailable(f"image {name!r}: {path} is neither a directory (a root filesystem or an OCI layout) "
                             "nor an OCI archive")


def build_debian(dest: str, suite: str = "bookworm", packages: tuple[str, ...] = ("python3",),
                 mirror: str = "") -> str:
    """A root filesystem of Debian ``suite`` with ``packages`` at ``dest`` (built once: an existing one is
    kept), made by ``mmdebstrap`` (``apt-get install mmdebstrap``); returns ``dest``."""
    if os.path.isfile(os.path.join(dest, "etc", "os-release")):
        return dest
    if shutil.which("mmdebstrap") is None:
        raise BackendUnavailable("mmdebstrap is not installed: apt-get update && apt-get install -y mmdebstrap")
    dest = os.path.abspath(dest)
    os.makedirs(os.path.dirname(dest), mode=0o755, exist_ok=True)
    tmp = dest + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    cmd = ["mmdebstrap", "--variant=minbase", f"--include={','.join(packages)}", suite, tmp]
    if mirror:
        cmd.append(mirror)
    code = subprocess.run(cmd).returncode
    if code != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise BackendUnavailable(f"mmdebstrap exited with {code} building {dest} (its output is above)")
    os.chmod(tmp, 0o755)
    os.rename(tmp, dest)
    return dest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m services.sandbox.images", description="sandbox images")
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build-debian", help="a Debian root filesystem with Python (mmdebstrap), cached at DEST")
    b.add_argument("dest")
    b.add_argument("--suite", default="bookworm")
    b.add_argument("--packages", default="python3", help="comma-separated Debian packages")
    b.add_argument("--mirror", default="")
    args = ap.parse_args(argv)
    try:
        path = build_debian(args.dest, args.suite, tuple(p for p in args.packages.split(",") if p), args.mirror)
    except BackendUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"image root filesystem at {path}; use it with [services.sandbox] images = {{ python = \"{path}\" }}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
