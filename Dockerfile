# syntax=docker/dockerfile:1
# The omnirelay image: every daemon (omni-serve, omni-broker, omni-gateway, omni-worker, …) on PATH,
# run as uid 10001, writing only to /cache, /tmp and /models — what the manifests of
# `omni-serve --emit kubernetes` assume (deploy/kubernetes.py; tests/deploy/test_dockerfile.py
# checks the two agree). Build and run (docs/KUBERNETES.md has the push and the manifests):
#
#   docker build -t omnirelay:0.1.0 .                                  # CPU
#   docker build --build-arg FLAVOR=cuda -t omnirelay:0.1.0-cuda .     # NVIDIA GPUs
#   docker run --rm -p 8091:8091 --shm-size 1g omnirelay:0.1.0         # the embedded default (README)
#
# Stages: base-cpu / base-cuda (the Python runtime; FLAVOR picks one) → base (system libraries, the
# user, the writable directories) → build (a virtual environment with torch and the project) →
# runtime (base plus that environment, nothing of the build).

ARG FLAVOR=cpu
ARG CPU_BASE=python:3.11-slim-bookworm
ARG CUDA_BASE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

FROM ${CPU_BASE} AS base-cpu

FROM ${CUDA_BASE} AS base-cuda
# Ubuntu 24.04's Python 3.12; gcc and the Python headers because Triton (xgrammar's GPU bitmask
# kernel) compiles its small launcher with them on first use, into ~/.triton (= /cache/.triton).
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

FROM base-${FLAVOR} AS base
# libibverbs1: Mooncake's transfer engine loads it even over TCP. The user owns only the directories
# the manifests mount writable; everything else stays root's (and read-only in a pod).
RUN apt-get update \
    && apt-get install -y --no-install-recommends libibverbs1 \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 10001 omnirelay \
    && useradd --uid 10001 --gid 10001 --home-dir /cache --no-create-home --shell /usr/sbin/nologin omnirelay \
    && mkdir -p /cache /models \
    && chown 10001:10001 /cache /models

FROM base AS build
ARG FLAVOR
# The torch wheel's index per flavor: CUDA_TORCH_INDEX_URL must match CUDA_BASE's CUDA version.
ARG CPU_TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG CUDA_TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
# pyproject.toml's optional extras to install: the network connectors and the media encoders.
# yuanrong's wheel exists for CPython 3.11 only: its extra's marker skips it in the CUDA image (3.12).
ARG EXTRAS=redis,mooncake,yuanrong,omni
RUN python3 -m venv /opt/omnirelay
ENV PATH=/opt/omnirelay/bin:$PATH
COPY . /src
# torch first, from the flavor's index, at the version pyproject.toml pins (a local version such as
# 2.13.0+cpu satisfies ==2.13.0, so the project's own install keeps it); then the project and its extras.
RUN --mount=type=cache,target=/root/.cache/pip \
    case "$FLAVOR" in \
        cpu) index="$CPU_TORCH_INDEX_URL" ;; \
        cuda) index="$CUDA_TORCH_INDEX_URL" ;; \
        *) echo "FLAVOR must be cpu or cuda, not $FLAVOR" >&2; exit 1 ;; \
    esac \
    && torch=$(python3 -c 'import re, tomllib; deps = tomllib.load(open("/src/pyproject.toml", "rb"))["project"]["dependencies"]; print(next(d for d in deps if re.match(r"torch\s*[=<>~!]", d)))') \
    && pip install --index-url "$index" "$torch" \
    && pip install "/src[$EXTRAS]" \
    && omni-serve --help >/dev/null

FROM base AS runtime
COPY --from=build /opt/omnirelay /opt/omnirelay
# The same cache locations as the manifests' env (deploy/kubernetes.py CACHE_ENV), so `docker run`
# writes where a pod may; bytecode was compiled at install time and is never written at run time.
ENV VIRTUAL_ENV=/opt/omnirelay \
    PATH=/opt/omnirelay/bin:$PATH \
    HOME=/cache \
    XDG_CACHE_HOME=/cache \
    HF_HOME=/cache/huggingface \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    OMNIRELAY_HEALTHCHECK_URL=http://127.0.0.1:8091/health
USER 10001:10001
WORKDIR /cache
VOLUME ["/cache", "/tmp", "/models"]
# 8091 gateway HTTP, 5556 gateway token socket, 5555 broker, 8081 a worker's --health-port.
EXPOSE 8091 5556 5555 8081
# Gateway (and omni-serve): /health is 200 once every role of every model has a live worker. For a
# worker give -e OMNIRELAY_HEALTHCHECK_URL=http://127.0.0.1:8081/live (omni-worker --health-port 8081);
# for a broker, which serves no HTTP, an empty value. Kubernetes ignores this: the manifests probe.
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; url = os.environ.get('OMNIRELAY_HEALTHCHECK_URL'); url and urllib.request.urlopen(url, timeout=4)"]
CMD ["omni-serve", "--host", "0.0.0.0"]
