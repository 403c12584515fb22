#!/usr/bin/env bash
# Build the Docker image from a clean clone of this repository and check it end to end (make docker-check).
#
# On a Debian machine with Debian's packages and PyPI (no container registry needed):
#   1. installs what is missing (docker.io, mmdebstrap, docker-compose) and starts dockerd if none runs (and stops
#      what it started at the end);
#   2. clones HEAD into a work folder (uncommitted changes are not in the image: commit first);
#   3. makes the local base image (mmdebstrap: bookworm + python3, and the host's CA bundle so pip in the build
#      verifies TLS as the host's does) unless it exists;
#   4. builds the image with --network host, torch from the CPU wheel that the host's pip finds, served to the build
#      on 127.0.0.1;
#   5. installs the clone bare (make install: its .venv, kernels compiled -march=native) as the reference;
#   6. runs scripts/docker_check.py: health, "Paris", the kernel variant in the startup line, throughput against the
#      bare install (interleaved rounds, float32 and int4), non-root, docker stop draining a stream, a mounted
#      checkpoint at -tp 2, and two compose "nodes" under torchrun at -pp 2 against a single server.
#
# Too slow for `make test` (~15 min on 2 cores): run it before every change to the Dockerfile, the kernels or the
# packaging. Variables: WORK (work folder, default a new one under /tmp; kept), IMAGE (default tpserve:check),
# ROUNDS (throughput rounds, default 7), PORT (first of the ports it uses, default 18600), KEEP_IMAGE=0 removes the
# image at the end. Output: $WORK/docker_check.json and the lines printed here.
set -euo pipefail

REPO=$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)
WORK=${WORK:-$(mktemp -d /tmp/tpserve-docker-check.XXXXXX)}
mkdir -p "$WORK"
IMAGE=${IMAGE:-tpserve:check}
ROUNDS=${ROUNDS:-7}
PORT=${PORT:-18600}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
BASE=local/bookworm-python:ca
STARTED_DOCKERD=""
WHEEL_SERVER=""

log() { printf '[docker-check %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

cleanup() {
    [ -n "$WHEEL_SERVER" ] && kill "$WHEEL_SERVER" 2>/dev/null || true
    if [ "${KEEP_IMAGE:-1}" = "0" ]; then docker image rm -f "$IMAGE" >/dev/null 2>&1 || true; fi
    if [ -n "$STARTED_DOCKERD" ]; then
        log "stopping the dockerd this script started (pid $STARTED_DOCKERD)"
        kill "$STARTED_DOCKERD" 2>/dev/null || true
        wait "$STARTED_DOCKERD" 2>/dev/null || true
    fi
}
trap cleanup EXIT

# ---- 1. packages and the engine
need=()
command -v dockerd >/dev/null || need+=(docker.io)
command -v mmdebstrap >/dev/null || need+=(mmdebstrap)
if ! docker compose version >/dev/null 2>&1 && ! command -v docker-compose >/dev/null; then need+=(docker-compose); fi
if [ ${#need[@]} -gt 0 ]; then
    log "installing ${need[*]}"
    [ "$(id -u)" = 0 ] || { echo "docker_check: run as root or install ${need[*]} first" >&2; exit 2; }
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi
if ! docker info >/dev/null 2>&1; then
    log "starting dockerd (log: $WORK/dockerd.log)"
    dockerd >"$WORK/dockerd.log" 2>&1 &
    STARTED_DOCKERD=$!
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
    docker info >/dev/null 2>&1 || { echo "docker_check: dockerd did not start; see $WORK/dockerd.log" >&2; exit 1; }
fi

# ---- 2. a clean clone
if [ -n "$(git -C "$REPO" status --porcelain --untracked-files=no)" ]; then
    log "warning: uncommitted changes in $REPO are not in the clone (HEAD $(git -C "$REPO" rev-parse --short HEAD))"
fi
rm -rf "$WORK/src"
git clone --quiet --no-hardlinks "$REPO" "$WORK/src"
log "clone of $(git -C "$WORK/src" rev-parse --short HEAD) in $WORK/src"

# ---- 3. the base image: Debian bookworm with python3, and the host's CA bundle
if ! docker image inspect "$BASE" >/dev/null 2>&1; then
    if ! docker image inspect local/bookworm-python:3.11 >/dev/null 2>&1; then
        log "making local/bookworm-python:3.11 with mmdebstrap"
        mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,ca-certificates bookworm - \
            | docker import - local/bookworm-python:3.11 >/dev/null
    fi
    mkdir -p "$WORK/basectx"
    cp /etc/ssl/certs/ca-certificates.crt "$WORK/basectx/"
    printf '%s\n' 'FROM local/bookworm-python:3.11' \
        'COPY ca-certificates.crt /etc/ssl/certs/ca-certificates.crt' \
        'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt' \
        >"$WORK/basectx/Dockerfile"
    docker build -q -t "$BASE" "$WORK/basectx" >/dev/null
fi

# ---- 4. the image, torch from the wheel the host's pip finds (pytorch.org is not reachable; PyPI's torch is CUDA)
mkdir -p "$WORK/wheels"
python3 -m pip download --quiet "torch==$TORCH_VERSION" --no-deps -d "$WORK/wheels"
WHEEL_PORT=$((PORT + 99))
python3 -m http.server --bind 127.0.0.1 --directory "$WORK/wheels" "$WHEEL_PORT" >/dev/null 2>&1 &
WHEEL_SERVER=$!
log "building $IMAGE (log: $WORK/build.log)"
t0=$(date +%s)
if ! docker build --network host --build-arg BASE_IMAGE="$BASE" --build-arg TORCH_VERSION="$TORCH_VERSION" \
        --build-arg TORCH_FIND_LINKS="http://127.0.0.1:$WHEEL_PORT/" -t "$IMAGE" "$WORK/src" >"$WORK/build.log" 2>&1; then
    tail -30 "$WORK/build.log"
    echo "docker_check: the image did not build; see $WORK/build.log" >&2
    exit 1
fi
BUILD_SECONDS=$(($(date +%s) - t0))
kill "$WHEEL_SERVER" 2>/dev/null || true
WHEEL_SERVER=""
log "built in ${BUILD_SECONDS} s: $(docker image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.2f GB", $1/1e9}')"

# ---- 5. the bare install of the same commit
log "bare install: make install in the clone (log: $WORK/bare.log)"
make -C "$WORK/src" install >"$WORK/bare.log" 2>&1 || { tail -20 "$WORK/bare.log"; exit 1; }

# ---- 6. the checks
COMPOSE="docker compose"
docker compose version >/dev/null 2>&1 || COMPOSE=docker-compose
"$WORK/src/.venv/bin/python" "$WORK/src/scripts/docker_check.py" --image "$IMAGE" --work "$WORK" \
    --bare "$WORK/src/.venv/bin" --rounds "$ROUNDS" --port "$PORT" --compose "$COMPOSE" \
    --compose-file "$WORK/src/docker-compose.nodes.yml" --build-seconds "$BUILD_SECONDS"
