# dynamig: one image for the operator (runs as an unprivileged user) and the node agent (the DaemonSet runs
# it as root and privileged, which NVML needs to create and destroy MIG instances; see the Helm chart).
#   docker build -t dynamig/dynamig:0.1.0 .
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

# --- build: generate the kubelet gRPC stubs, build the wheel, install it into a virtual environment ---------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
RUN python -m venv /opt/tools \
 && /opt/tools/bin/pip install --no-cache-dir "grpcio-tools==1.85.1" "setuptools==80.9.0" "wheel==0.45.1"
COPY pyproject.toml README.md ./
COPY operator ./operator
# The stub generator imports nothing from the package, so it runs as a plain script before the package
# (and its dependencies) exist; then the wheel carries the generated modules.
RUN rm -rf operator/dynamig/agent/plugin/_generated \
 && /opt/tools/bin/python operator/dynamig/agent/plugin/build_protos.py \
 && /opt/tools/bin/pip wheel --no-cache-dir --no-deps --no-build-isolation --wheel-dir /dist . \
 && python -m venv /opt/dynamig \
 && /opt/dynamig/bin/pip install --no-cache-dir /dist/dynamig-*.whl \
 && /opt/dynamig/bin/dynamig --help >/dev/null

# --- runtime -----------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="dynamig" \
      org.opencontainers.image.description="Re-cuts NVIDIA MIG GPUs while the cluster runs, driven by DRA demand" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PATH=/opt/dynamig/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
COPY --from=build /opt/dynamig /opt/dynamig
# 65532 is the conventional "nonroot" id; the operator keeps it, the agent's pod sets runAsUser: 0.
USER 65532:65532
ENTRYPOINT ["dynamig"]
CMD ["--help"]
