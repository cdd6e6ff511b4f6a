# syntax=docker/dockerfile:1
# A Flower SuperNode running fedguard's ClientApp (fedguard.client_app:app) on one data partition.
#
# Build from the repository root of a clean checkout of the commit to deploy:
#   docker build -f docker/supernode.Dockerfile --build-arg FEDGUARD_REF=$(git rev-parse HEAD) -t fedguard-supernode .
# The same image serves every SuperNode: which key it authenticates with, which SuperLink it
# joins and whether it keeps ground truth are all given at `docker run` time; the server assigns
# it its partition.

ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm
FROM ${PYTHON_IMAGE}

ARG FEDGUARD_REF=unknown
LABEL org.opencontainers.image.title="fedguard-supernode" \
      org.opencontainers.image.revision="${FEDGUARD_REF}"

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    FLWR_TELEMETRY_ENABLED=0 \
    # Datasets that are not packaged are read from the /data volume (set data.root=/data in the
    # run config); unpacked system datasets are cached here, not in the read-only /data.
    FEDGUARD_CACHE=/home/fedguard/.cache/fedguard

# Clients train on CPU unless told otherwise, so torch/torchvision come from PyTorch's CPU-only
# wheel index by default, which keeps the multi-gigabyte CUDA libraries out of the image
# (TORCH_INDEX_URL=https://pypi.org/simple takes PyPI's CUDA build instead, for GPU clients).
# They are installed first and alone; the project install that follows uses PyPI, but pip keeps
# an installed distribution that satisfies a requirement (no --upgrade: its only-if-needed
# strategy), and 2.14.1+cpu satisfies pyproject.toml's torch==2.14.1 because a specifier without
# a local label ignores the candidate's (+cpu, PEP 440). The check after it fails the build if
# the project install replaced the torch build taken from TORCH_INDEX_URL all the same.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
WORKDIR /opt/fedguard/src
COPY pyproject.toml README.md ./
COPY fedguard ./fedguard
COPY clients ./clients
COPY strategies ./strategies
COPY attackers ./attackers
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" torch==2.14.1 torchvision==0.29.1 \
 && python -c "import torch; print(torch.__version__, torch.version.cuda)" > /tmp/torch-build \
 && pip install --no-cache-dir . \
 && python -c "import torch; assert open('/tmp/torch-build').read().split() == [torch.__version__, str(torch.version.cuda)], 'the project install replaced torch'" \
 && rm /tmp/torch-build \
 && flower-supernode --version

RUN groupadd --system --gid 10001 fedguard \
 && useradd --system --uid 10001 --gid fedguard --create-home --home-dir /home/fedguard fedguard \
 && mkdir -p /data /vault /certs /keys \
 && chown fedguard:fedguard /vault
USER 10001:10001
WORKDIR /home/fedguard

# /data: the data set (read-only). /vault: where this node keeps the ground truth of its captured
# uploads, only when its node config says so (vault-dir="/vault") and a host folder is mounted
# there; no folder the server names is ever written to.

# Runtime dependency installation stays off: flower-supernode only installs an app's
# dependencies with --allow-runtime-dependency-installation, which is never passed.
# The ClientApp runs in a subprocess of this container (Flower's default isolation).
# Per-node arguments follow at run time:
#   --superlink HOST:PORT --root-certificates /certs/ca.crt
#   --auth-supernode-private-key /keys/supernode.key
#   --node-config "partition-id=I num-partitions=N"   (and vault-dir="/vault" to keep ground truth)
ENTRYPOINT ["flower-supernode"]
