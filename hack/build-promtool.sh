#!/usr/bin/env bash
# Builds promtool from github.com/prometheus/prometheus at a pinned version, cached: the tests evaluate the
# alert rules and the PromQL join of dynamig's series with DCGM's with Prometheus' own engine
# (`promtool check rules`, `promtool test rules`).
#   usage: hack/build-promtool.sh        -> prints the path of the binary on stdout (logs go to stderr)
set -euo pipefail

PROMETHEUS_VERSION="${DYNAMIG_PROMETHEUS_VERSION:-v0.316.0}"
log() { echo "[build-promtool] $*" >&2; }
# shellcheck source=hack/lib/go-tool.sh
source "$(dirname "$0")/lib/go-tool.sh"
go_tool_begin promtool "promtool-${PROMETHEUS_VERSION}"
trap step_abort EXIT
step_begin "building promtool $PROMETHEUS_VERSION (once; cached in $OUT)"
printf 'module dynamig.io/tools/promtool\n\ngo 1.26.0\n\nrequire github.com/prometheus/prometheus %s\n' "$PROMETHEUS_VERSION" > "$work/go.mod"
printf '//go:build tools\n\npackage tools\n\nimport _ "github.com/prometheus/prometheus/cmd/promtool"\n' > "$work/tools.go"
step_begin "go mod tidy (github.com/prometheus/prometheus $PROMETHEUS_VERSION)"
(cd "$work" && go mod tidy >&2)
step_end
step_begin "go build promtool $PROMETHEUS_VERSION"
# remove_all_sd: Prometheus' own tag that leaves out every service-discovery plugin (cloud SDKs); the rule
# checks and tests need none, and the build takes less than half the CPU time (227 s against 501 s here).
(cd "$work" && go build -trimpath -tags netgo,remove_all_sd -ldflags='-s -w' -o "$BIN.tmp" \
  github.com/prometheus/prometheus/cmd/promtool >&2)
mv "$BIN.tmp" "$BIN"
step_end
step_end
log "done: $BIN"
echo "$BIN"
