#!/usr/bin/env bash
# Builds the helm v3 binary from its Go module at a pinned release, for rendering and linting the chart.
# Output is cached per version: a second run builds nothing.
#   usage: hack/build-helm.sh            -> prints the path of the helm binary on stdout
# Set DYNAMIG_HELM to an existing helm binary to skip the build.
set -euo pipefail

if [ -n "${DYNAMIG_HELM:-}" ]; then
  [ -x "$DYNAMIG_HELM" ] || { echo "DYNAMIG_HELM=$DYNAMIG_HELM is not executable" >&2; exit 1; }
  echo "$DYNAMIG_HELM"; exit 0
fi

HELM_VERSION="${DYNAMIG_HELM_VERSION:-v3.22.0}"
CACHE_ROOT="${DYNAMIG_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dynamig}"
OUT="$CACHE_ROOT/tools/helm-${HELM_VERSION}"
BIN="$OUT/bin/helm"

if [ -x "$BIN" ]; then echo "$BIN"; exit 0; fi

log() { echo "[build-helm] $*" >&2; }
# shellcheck source=hack/lib/progress.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/progress.sh"
command -v go >/dev/null || { echo "go is required to build helm (or set DYNAMIG_HELM to a helm binary)" >&2; exit 1; }

export GOTOOLCHAIN=local GOFLAGS=-mod=mod CGO_ENABLED=0
work="$OUT/src"
mkdir -p "$work" "$OUT/bin"
trap step_abort EXIT
step_begin "building helm $HELM_VERSION (once; cached in $OUT)"

# A wrapper module that requires helm at the pinned release; helm's own go.mod fixes every dependency.
step_begin "resolving helm.sh/helm/v3 $HELM_VERSION and its dependencies (go mod download, go mod tidy)"
helm_gomod=$(cd "$work" && go mod download -json "helm.sh/helm/v3@$HELM_VERSION" \
  | sed -n 's/^\s*"GoMod": "\(.*\)",\?$/\1/p')
go_directive=$(sed -n 's/^go \([0-9.]*\)$/\1/p' "$helm_gomod" | head -n1)
cat > "$work/go.mod" <<GOMOD
module dynamig.io/tools/helm

go ${go_directive:-1.24.0}

require helm.sh/helm/v3 $HELM_VERSION
GOMOD
cat > "$work/tools.go" <<'GO'
//go:build tools

package tools

import _ "helm.sh/helm/v3/cmd/helm"
GO

# helm's Makefile stamps its version and the Kubernetes version its client libraries speak; do the same.
k8s_minor=$(sed -n 's/^\s*k8s\.io\/client-go v0\.\([0-9]*\)\..*$/\1/p' "$helm_gomod" | head -n1)
ldflags="-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"
if [ -n "$k8s_minor" ]; then
  for pkg in helm.sh/helm/v3/pkg/chartutil helm.sh/helm/v3/pkg/lint/rules; do
    ldflags+=" -X $pkg.k8sVersionMajor=1 -X $pkg.k8sVersionMinor=$k8s_minor"
  done
fi

(cd "$work" && go mod tidy >&2)
step_end
step_begin "go build helm.sh/helm/v3/cmd/helm $HELM_VERSION"
(cd "$work" && go build -trimpath -ldflags="$ldflags" -o "$BIN.tmp" helm.sh/helm/v3/cmd/helm >&2)
mv "$BIN.tmp" "$BIN"
step_end
step_end
log "done: $("$BIN" version --short 2>/dev/null || echo "$BIN")"
echo "$BIN"
