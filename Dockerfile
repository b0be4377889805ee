# dynamig: one image for the operator (runs as an unprivileged user) and the node agent (the DaemonSet runs
# it as root and privileged, which NVML needs to create and destroy MIG instances; see the Helm chart).
#   docker build -t dynamig/dynamig:0.1.0 .
# `make release` writes a build context whose DYNAMIG_VERSION and DYNAMIG_REVISION defaults are filled in.
#
# Base image pinned by the digest of its multi-platform index, as docker-library/repo-info recorded it for
# python:3.11.16-slim-bookworm (repos/python/remote/3.11.16-slim-bookworm.md, commit 422f3cfe488d, built
# 2026-09-01). Bump tag and digest together; the image is always pulled by digest.
# `make image` (hack/build-image.sh) builds this file without a Docker engine, on a base of its own made from
# Debian packages, named through these two args: PYTHON_BASE=localhost/dynamig-python-base:<key> and its
# PYTHON_DIGEST; the labels below then name that base.
ARG PYTHON_BASE=python:3.11.16-slim-bookworm
ARG PYTHON_DIGEST=sha256:c425d915a89a6dcd3183b1797ad9bd8878caff5a417f6371c8df93c8ea8b727f

# --- build: generate the kubelet gRPC stubs, build the wheel, install it into a virtual environment ---------
FROM ${PYTHON_BASE}@${PYTHON_DIGEST} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
# Every Python package comes from a hash-pinned lock (make lock): the build tools, then the runtime set.
COPY requirements/build.lock requirements/runtime.lock ./requirements/
RUN python -m venv /opt/tools \
 && /opt/tools/bin/pip install --no-cache-dir --require-hashes --only-binary=:all: -r requirements/build.lock \
 && python -m venv /opt/dynamig \
 && /opt/dynamig/bin/pip install --no-cache-dir --require-hashes --only-binary=:all: -r requirements/runtime.lock
COPY pyproject.toml README.md ./
COPY operator ./operator
# The stub generator imports nothing from the package, so it runs as a plain script before the package
# (and its dependencies) exist; then the wheel carries the generated modules. The wheel goes in without
# dependencies (the lock installed them) and `pip check` proves the lock satisfies its requirements.
RUN rm -rf operator/dynamig/agent/plugin/_generated \
 && /opt/tools/bin/python operator/dynamig/agent/plugin/build_protos.py \
 && /opt/tools/bin/pip wheel --no-cache-dir --no-deps --no-build-isolation --wheel-dir /dist . \
 && /opt/dynamig/bin/pip install --no-cache-dir --no-deps /dist/dynamig-*.whl \
 && /opt/dynamig/bin/pip check \
 && /opt/dynamig/bin/dynamig --help >/dev/null

# --- runtime -----------------------------------------------------------------------------------------------
FROM ${PYTHON_BASE}@${PYTHON_DIGEST}
ARG PYTHON_BASE
ARG PYTHON_DIGEST
ARG DYNAMIG_VERSION=dev
ARG DYNAMIG_REVISION=unknown
LABEL org.opencontainers.image.title="dynamig" \
      org.opencontainers.image.description="Re-cuts NVIDIA MIG GPUs while the cluster runs, driven by DRA demand" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="${DYNAMIG_VERSION}" \
      org.opencontainers.image.revision="${DYNAMIG_REVISION}" \
      org.opencontainers.image.base.name="${PYTHON_BASE}" \
      org.opencontainers.image.base.digest="${PYTHON_DIGEST}"
ENV PATH=/opt/dynamig/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
COPY --from=build /opt/dynamig /opt/dynamig
# 65532 is the conventional "nonroot" id; the operator keeps it, the agent's pod sets runAsUser: 0.
USER 65532:65532
ENTRYPOINT ["dynamig"]
CMD ["--help"]
