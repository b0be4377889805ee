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
printf 'module dynamig.io/tools/promtool\n\ngo 1.26.0\n\nrequire github.com/prometheus/prometheus %s\n' "$PROMETHEUS_VERSION" > "$work/go.mod"
printf '//go:build tools\n\npackage tools\n\nimport _ "github.com/prometheus/prometheus/cmd/promtool"\n' > "$work/tools.go"
start=$(date +%s)
(cd "$work" && log "go mod tidy (prometheus $PROMETHEUS_VERSION)" && go mod tidy >&2 \
   && log "go build promtool" \
   && go build -trimpath -tags netgo -ldflags='-s -w' -o "$BIN.tmp" github.com/prometheus/prometheus/cmd/promtool >&2)
mv "$BIN.tmp" "$BIN"
log "done in $(( $(date +%s) - start ))s: $BIN"
echo "$BIN"
