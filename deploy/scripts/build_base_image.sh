#!/bin/sh
# Build the images of deploy/ on a host that cannot pull from any registry:
#   1. a Debian bookworm base image from debootstrap (localhost/debian:bookworm),
#   2. pdserve:cpu on it (deploy/Dockerfile; torch from deploy/wheels/ when a CPU wheel is there),
#   3. a Debian Prometheus image (localhost/prometheus:bookworm).
# Needs root, debootstrap and a running Docker engine. Steps whose image exists are skipped
# (the pdserve build always runs: BuildKit makes an unchanged rebuild a cache hit).
# Then: PDSERVE_IMAGE=localhost/pdserve:cpu REDIS_IMAGE=localhost/pdserve:cpu \
#       PROMETHEUS_IMAGE=localhost/prometheus:bookworm docker compose -f deploy/docker-compose.yml up -d
set -eu
here=$(cd "$(dirname "$0")/.." && pwd)
root=$(cd "$here/.." && pwd)
docker=${DOCKER:-docker}
base=${BASE_IMAGE:-localhost/debian:bookworm}
mirror=${DEBIAN_MIRROR:-$(sed -n 's/^URIs: *\(.*\/debian\)\/*$/\1/p; s/^deb \(\[[^]]*\] \)\{0,1\}\([^ ]*\/debian\)\/* .*/\2/p' \
         /etc/apt/sources.list /etc/apt/sources.list.d/* 2>/dev/null | head -n 1)}
mirror=${mirror:-http://deb.debian.org/debian}

if ! $docker image inspect "$base" >/dev/null 2>&1; then
  rootfs=$(mktemp -d)
  trap 'rm -rf "$rootfs"' EXIT
  debootstrap --variant=minbase bookworm "$rootfs" "$mirror"
  tar -C "$rootfs" -c . | $docker import - "$base"
fi

torch_index=https://download.pytorch.org/whl/cpu
if ls "$here"/wheels/torch-*+cpu-*.whl >/dev/null 2>&1; then torch_index=; fi
DOCKER_BUILDKIT=1 $docker build -f "$here/Dockerfile" --build-arg BASE_IMAGE="$base" \
  --build-arg TORCH_INDEX_URL="$torch_index" -t "${PDSERVE_IMAGE:-localhost/pdserve:cpu}" "$root"

if ! $docker image inspect "${PROMETHEUS_IMAGE:-localhost/prometheus:bookworm}" >/dev/null 2>&1; then
  DOCKER_BUILDKIT=1 $docker build -f "$here/Dockerfile.prometheus" --build-arg BASE_IMAGE="$base" \
    -t "${PROMETHEUS_IMAGE:-localhost/prometheus:bookworm}" "$here"
fi
