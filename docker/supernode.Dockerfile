# syntax=docker/dockerfile:1
# A Flower SuperNode running fedguard's ClientApp (fedguard.client_app:app) on one data partition.
#
# Build from the repository root of a clean checkout of the commit to deploy:
#   docker build -f docker/supernode.Dockerfile --build-arg FEDGUARD_REF=$(git rev-parse HEAD) -t fedguard-supernode .
# The same image serves every SuperNode: which partition it trains on, which key it
# authenticates with and which SuperLink it joins are all given at `docker run` time.

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

# Clients train on CPU unless told otherwise; a CPU wheel index (for example PyTorch's CPU index)
# in TORCH_INDEX_URL keeps the multi-gigabyte CUDA libraries out of the image. torch/torchvision
# are pinned to the versions pyproject.toml pins, so the project install below keeps them.
ARG TORCH_INDEX_URL=""
WORKDIR /opt/fedguard/src
COPY pyproject.toml README.md ./
COPY fedguard ./fedguard
COPY clients ./clients
COPY strategies ./strategies
COPY attackers ./attackers
RUN if [ -n "${TORCH_INDEX_URL}" ]; then \
        pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" torch==2.14.1 torchvision==0.29.1; \
    fi \
 && pip install --no-cache-dir . \
 && flower-supernode --version

RUN groupadd --system --gid 10001 fedguard \
 && useradd --system --uid 10001 --gid fedguard --create-home --home-dir /home/fedguard fedguard \
 && mkdir -p /data /runs /certs /keys \
 && chown fedguard:fedguard /runs
USER 10001:10001
WORKDIR /home/fedguard

# /data: this node's data partition (read-only). /runs: the run folders; the ground truth of a
# captured upload is written to the vault folder the server names, under /runs/<run>/vault, so
# /runs must be the same host folder the serverapp container writes to (see compose.yaml).
VOLUME ["/runs"]

# Runtime dependency installation stays off: flower-supernode only installs an app's
# dependencies with --allow-runtime-dependency-installation, which is never passed.
# The ClientApp runs in a subprocess of this container (Flower's default isolation).
# Per-node arguments follow at run time:
#   --superlink HOST:PORT --root-certificates /certs/ca.crt
#   --auth-supernode-private-key /keys/supernode.key
#   --node-config "partition-id=I num-partitions=N"
ENTRYPOINT ["flower-supernode"]
