# syntax=docker/dockerfile:1
# The Flower SuperLink of a fedguard deployment: the Fleet, Control and Runtime APIs, all served
# over TLS on one HTTP port (Flower 1.41 serves the three APIs on `--host`/`--port`).
#
# Build from the repository root of a clean checkout of the commit to deploy:
#   docker build -f docker/superlink.Dockerfile --build-arg FEDGUARD_REF=$(git rev-parse HEAD) -t fedguard-superlink .
# docker/superlink.Dockerfile.dockerignore keeps everything but the Python sources out of the
# build context, so no data, run output, certificate or key can end up in the image.

# A pinned tag of the official image; Python 3.11 is what pyproject.toml's requires-python allows.
ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm
FROM ${PYTHON_IMAGE}

# The commit the sources were taken from, recorded as a label so that a running image can be
# matched to the checkout `flwr run` is started from (both must be the same commit).
ARG FEDGUARD_REF=unknown
LABEL org.opencontainers.image.title="fedguard-superlink" \
      org.opencontainers.image.revision="${FEDGUARD_REF}"

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    FLWR_TELEMETRY_ENABLED=0 \
    # Flower reads this as the default of --disable-runtime-dependency-installation: an app's
    # dependencies are never installed at run time, only the image's pinned ones are used.
    FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1

# The SuperLink only needs Flower itself, but installing the project pins Flower to exactly the
# version the ServerApp and ClientApps use (flwr==1.41.0 in pyproject.toml), and pulls no GPU
# build of torch when TORCH_INDEX_URL names a CPU wheel index (see serverapp.Dockerfile).
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
 && flower-superlink --version

# A fixed, unprivileged uid/gid so that host folders mounted for state can be chowned to it.
RUN groupadd --system --gid 10001 fedguard \
 && useradd --system --uid 10001 --gid fedguard --create-home --home-dir /home/fedguard fedguard \
 && mkdir -p /state /certs \
 && chown fedguard:fedguard /state
USER 10001:10001
WORKDIR /home/fedguard

# /certs: ca.crt, server.pem, server.key (read-only volume). /state: the SuperLink's database, so
# that registered SuperNodes and runs survive a restart.
VOLUME ["/state"]
EXPOSE 8000

# TLS is on: the certificates come from the /certs volume. SuperNode authentication is on: only
# SuperNodes whose public key was registered with `flwr supernode register` may connect.
# --isolation process: the ServerApp does not run inside this container but in the serverapp
# container, whose SuperExec pulls it from the Runtime API and proves itself with the shared
# secret in /run/secrets/superexec (a Compose secret).
# --host 0.0.0.0: Flower binds 127.0.0.1 by default, which is unreachable from other containers.
ENTRYPOINT ["flower-superlink", \
            "--ssl-ca-certfile", "/certs/ca.crt", \
            "--ssl-certfile", "/certs/server.pem", \
            "--ssl-keyfile", "/certs/server.key", \
            "--enable-supernode-auth", \
            "--disable-runtime-dependency-installation", \
            "--isolation", "process", \
            "--superexec-auth-secret-file", "/run/secrets/superexec", \
            "--database", "/state/superlink.db", \
            "--host", "0.0.0.0", \
            "--port", "8000"]
