# Two commands for a newcomer:  `make demo`  and  `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROTO_DIR := operator/dynamig/agent/plugin/proto
GEN_DIR := operator/dynamig/agent/plugin/_generated

.PHONY: setup demo test lint typecheck imports controlplane matrixplanes node helm holdscheduler cdivalidate promtool kueue ocitools proto bench clean lock release publish image

# The Kubernetes targets besides the primary one (hack/lib/k8s-module.sh) that `make test` runs the tests
# marked `matrix` against (dynamig.devcluster.versions.MATRIX names them all).
MATRIX_TARGETS := v1.36.3 v1.35.4+alpha v1.35.4

# pip prints a line per package it collects or installs; its progress bars are off (a CI log has no terminal).
PIP_INSTALL := $(BIN)/pip install --progress-bar off
$(STAMP): pyproject.toml setup.py
	@bash hack/step.sh "creating the virtual environment $(VENV)" $(PY) -m venv $(VENV)
	@bash hack/step.sh "upgrading pip in $(VENV)" $(PIP_INSTALL) --upgrade pip
	@bash hack/step.sh "installing dynamig and its dev tools into $(VENV) (pip install -e '.[dev]')" \
	  $(PIP_INSTALL) -e '.[dev]'
	@touch $(STAMP)

# The stubs are checked once per change of the venv or the .proto files (not again by each target after it).
PROTO_STAMP := $(VENV)/.protos
proto: $(PROTO_STAMP)
$(PROTO_STAMP): $(STAMP) $(wildcard $(PROTO_DIR)/*.proto) $(if $(wildcard $(GEN_DIR)),,FORCE)
	@if [ -d $(PROTO_DIR) ]; then $(BIN)/python -m dynamig.agent.plugin.build_protos; fi
	@touch $@

controlplane:
	@bash hack/build-control-plane.sh >/dev/null

# The control planes of the other targets: one per version (1.35.4 serves both of its targets).
matrixplanes:
	@for v in $(sort $(foreach t,$(MATRIX_TARGETS),$(firstword $(subst +, ,$(t))))); do \
	  DYNAMIG_K8S_VERSION=$$v bash hack/build-control-plane.sh >/dev/null || exit 1; done

# The real test node: kubelet, containerd, runc, and the pause and busybox programs its images hold.
node:
	@bash hack/build-node.sh >/dev/null

helm:
	@bash hack/build-helm.sh >/dev/null

# kube-scheduler with a Permit plugin that holds labelled pods: the binding-race tests' slow binding cycle.
holdscheduler: controlplane
	@bash hack/build-hold-scheduler.sh >/dev/null

cdivalidate:
	@bash hack/build-cdi-validate.sh >/dev/null

# Kueue's controller manager and its release's CRDs: the tests that put dynamig's slices under Kueue quotas.
kueue:
	@bash hack/build-kueue.sh >/dev/null

# The local OCI registry (CNCF distribution), cosign and syft: the release is published, signed, verified
# and pulled from a registry in the tests, and its SBOM is syft's.
ocitools:
	@for t in registry cosign syft; do bash hack/build-oci-tool.sh $$t >/dev/null || exit 1; done

# Prometheus' promtool: the tests evaluate the alert rules and the DCGM join with Prometheus' own engine.
promtool:
	@bash hack/build-promtool.sh >/dev/null

setup: $(STAMP) proto controlplane

demo: setup
	$(BIN)/dynamig demo

lint: $(STAMP)
	$(BIN)/ruff check --no-cache operator tests e2e bench
	$(BIN)/ruff format --check --no-cache operator tests e2e bench
	$(BIN)/hadolint Dockerfile

typecheck: $(STAMP) proto
	$(BIN)/mypy

imports: $(STAMP)
	$(BIN)/lint-imports

# Everything the tests need is built beside them rather than before them (hack/run-tests.sh): the control
# plane, node, helm and cdivalidate beside lint, typecheck, imports and the unit tests; promtool, ocitools,
# kueue, holdscheduler and matrixplanes beside the rest, at the lowest CPU priority.
test: $(STAMP) proto
	@MAKE="$(MAKE)" bash hack/run-tests.sh $(BIN)/pytest $(MATRIX_TARGETS)

bench: setup
	$(BIN)/python bench/planner_bench.py
	$(BIN)/python bench/plan_input_bench.py

# Hash-pinned lock files the image installs with --require-hashes: the runtime dependencies of pyproject.toml
# (no extras) and the build stage's tools. Keeps the current pins where they still fit; UPGRADE=1 takes the
# newest versions the ranges allow.
LOCK_FLAGS := --universal --python-version 3.11 --generate-hashes --custom-compile-command "make lock" $(if $(UPGRADE),--upgrade)
lock: $(STAMP)
	$(BIN)/uv pip compile --quiet $(LOCK_FLAGS) pyproject.toml -o requirements/runtime.lock
	$(BIN)/uv pip compile --quiet $(LOCK_FLAGS) requirements/build.in -c requirements/runtime.lock -o requirements/build.lock

# Chart package, single install manifest, image build context, the image (OCI archive), SBOM and checksums
# into dist/release/, from a clean tree (ALLOW_DIRTY=1 builds from a dirty one, its revision marked -dirty).
release: $(STAMP) helm
	@bash hack/release.sh

# What `make release` wrote, pushed to an OCI registry (DEST=host[:port]/path) and, with COSIGN_KEY, signed,
# its SBOM attached as a signed attestation (hack/publish.sh; docs/install.md: mirroring a release).
publish:
	@test -n "$(DEST)" || { echo "make publish DEST=<registry>/<path> [COSIGN_KEY=cosign.key]" >&2; exit 2; }
	@bash hack/publish.sh "$(DEST)"

# The image from the Dockerfile without a Docker engine (buildah, on a Python base built from Debian packages;
# needs root): dist/dynamig-image-<version>.oci.tar, its manifest digest in .digest beside it. Rebuilt only
# when its inputs change (cached under ~/.cache/dynamig/image).
image:
	@bash hack/build-image.sh --out dist >/dev/null

clean:
	rm -rf $(VENV) $(GEN_DIR) .mypy_cache .ruff_cache

FORCE:
