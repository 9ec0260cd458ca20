#!/usr/bin/env bash
# Start deploy/docker-compose.yml under podman 4.3 + podman-compose, in the order compose's depends_on states
# (deploy/README.md, "Compose under podman"). Images: deploy/podman/build-images.sh. Run as root:
#
#   ENV_FILE=deploy/.env deploy/podman/up.sh                       # the services of examples/addition.toml
#   ENV_FILE=deploy/.env RLBUS_EXAMPLE=coding PROFILES=sandbox deploy/podman/up.sh          # examples/coding.toml
#   podman-compose --env-file deploy/.env -f deploy/docker-compose.yml -p rlbus down -v      # stop, remove
#     (with --profile sandbox for coding; a container added with --scale: `podman rm -f` it first)
#
# Why not one `podman-compose up -d`: with podman 4.3.1
#   * podman-compose passes depends_on as `podman create --requires=...`, and `podman start` of a service that
#     requires provision (which requires nats) fails: "generating dependency graph for container ...: container
#     <provision> depends on container <nats> not found in input list"; so the services are created with
#     --no-deps and this script does the ordering;
#   * health checks run from systemd timers, and there is no systemd here ("unable to get systemd connection to
#     add healthchecks"), so `condition: service_healthy` cannot be awaited (podman-compose ignores it below
#     podman 4.6): this script runs the nats health check itself (`podman healthcheck run`) until it passes.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
ENV_FILE="${ENV_FILE:-$ROOT/deploy/.env}"
PROJECT="${PROJECT:-rlbus}"
PODMAN_COMPOSE="${PODMAN_COMPOSE:-$(command -v podman-compose || echo "$ROOT/.venv-deploy/bin/podman-compose")}"
export RLBUS_IMAGE="${RLBUS_IMAGE:-localhost/rlbus:latest}" RLBUS_NATS_IMAGE="${RLBUS_NATS_IMAGE:-localhost/rlbus-nats:2.15.1}"
profile_args=()
files=(-f "$ROOT/deploy/docker-compose.yml")
for p in ${PROFILES:-}; do profile_args+=(--profile "$p"); done
# the sandbox needs /proc unmasked for bubblewrap (see the file)
for f in ${EXTRA_COMPOSE_FILES:-}; do files+=(-f "$f"); done   # e.g. other host ports when 4222 is taken
pc() { "$PODMAN_COMPOSE" --env-file "$ENV_FILE" "${files[@]}" -p "$PROJECT" "${profile_args[@]}" "$@"; }
services=("$@")   # default: the services of the example (the one profile, sandbox, is also its service)
[[ ${#services[@]} -gt 0 ]] || services=(trainer rollout judge weightsync ${PROFILES:+$PROFILES})

pc up -d nats
for _ in $(seq 60); do podman healthcheck run "${PROJECT}_nats_1" >/dev/null 2>&1 && break; sleep 2; done
podman healthcheck run "${PROJECT}_nats_1" >/dev/null || { echo "nats is not healthy" >&2; exit 1; }
echo "nats: healthy"
pc up -d --no-deps provision
rc="$(podman wait "${PROJECT}_provision_1")"
podman logs "${PROJECT}_provision_1" 2>&1 | tail -3
[[ "$rc" == 0 ]] || { echo "provision exited $rc" >&2; exit 1; }
pc up -d --no-deps "${services[@]}"
podman ps -a --filter "label=io.podman.compose.project=$PROJECT" --format '{{.Names}}  {{.Status}}'
