# Two commands for a newcomer:  `make demo`  and  `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROTO_DIR := operator/dynamig/agent/plugin/proto
GEN_DIR := operator/dynamig/agent/plugin/_generated

.PHONY: setup demo test lint typecheck imports controlplane node helm holdscheduler cdivalidate promtool proto bench clean lock release

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

proto: $(STAMP)
	@if [ -d $(PROTO_DIR) ]; then $(BIN)/python -m dynamig.agent.plugin.build_protos; fi

controlplane:
	@bash hack/build-control-plane.sh >/dev/null

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

test: setup node helm cdivalidate promtool holdscheduler lint typecheck imports
	$(BIN)/pytest -q -p no:cacheprovider

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

# Chart package, single install manifest, image build context, SBOM and checksums into dist/release/, from a
# clean tree (ALLOW_DIRTY=1 builds from a dirty one, its revision marked -dirty).
release: $(STAMP) helm
	@bash hack/release.sh

clean:
	rm -rf $(VENV) $(GEN_DIR) .mypy_cache .ruff_cache
