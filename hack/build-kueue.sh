#!/usr/bin/env bash
# Builds Kueue's controller manager from its Go module at a pinned release, for the tests that run dynamig
# under Kueue quotas, and keeps the release's CRDs and webhook manifests beside it (they ship in the module).
# Output is cached per version: a second run builds nothing.
#   usage: hack/build-kueue.sh           -> prints the directory holding bin/kueue and config/ on stdout
# Set DYNAMIG_KUEUE to such a directory to skip the build.
set -euo pipefail

if [ -n "${DYNAMIG_KUEUE:-}" ]; then
  [ -x "$DYNAMIG_KUEUE/bin/kueue" ] || { echo "DYNAMIG_KUEUE=$DYNAMIG_KUEUE has no executable bin/kueue" >&2; exit 1; }
  echo "$DYNAMIG_KUEUE"; exit 0
fi

# The newest release the Go module proxy serves (Kueue's own go.mod fixes every dependency).
KUEUE_VERSION="${DYNAMIG_KUEUE_VERSION:-v0.17.0}"
CACHE_ROOT="${DYNAMIG_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dynamig}"
OUT="$CACHE_ROOT/tools/kueue-${KUEUE_VERSION}"
BIN="$OUT/bin/kueue"

if [ -x "$BIN" ] && [ -d "$OUT/config/crd" ]; then echo "$OUT"; exit 0; fi

log() { echo "[build-kueue] $*" >&2; }
# shellcheck source=hack/lib/progress.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/progress.sh"
command -v go >/dev/null || { echo "go is required to build Kueue (or set DYNAMIG_KUEUE)" >&2; exit 1; }

export GOTOOLCHAIN=local GOFLAGS=-mod=mod CGO_ENABLED=0
work="$OUT/src"
mkdir -p "$work" "$OUT/bin"
# make test builds it beside the tests while a test may ask for it: one builds, the other waits and reuses it.
if command -v flock >/dev/null; then
  exec 9>"$OUT/.lock"
  wait_for_lock 9 "Kueue $KUEUE_VERSION in $OUT"
  if [ -x "$BIN" ] && [ -d "$OUT/config/crd" ]; then echo "$OUT"; exit 0; fi
fi
trap step_abort EXIT
step_begin "building Kueue $KUEUE_VERSION (once; cached in $OUT)"

step_begin "resolving sigs.k8s.io/kueue $KUEUE_VERSION and its dependencies (go mod download, go mod tidy)"
info=$(cd "$work" && go mod download -json "sigs.k8s.io/kueue@$KUEUE_VERSION")
kueue_gomod=$(sed -n 's/^\s*"GoMod": "\(.*\)",\?$/\1/p' <<<"$info")
kueue_dir=$(sed -n 's/^\s*"Dir": "\(.*\)",\?$/\1/p' <<<"$info")
go_directive=$(sed -n 's/^go \([0-9.]*\)$/\1/p' "$kueue_gomod" | head -n1)
cat > "$work/go.mod" <<GOMOD
module dynamig.io/tools/kueue

go ${go_directive:-1.25.0}

require sigs.k8s.io/kueue $KUEUE_VERSION
GOMOD
cat > "$work/tools.go" <<'GO'
//go:build tools

package tools

import _ "sigs.k8s.io/kueue/cmd/kueue"
GO
(cd "$work" && go mod tidy >&2)
step_end

step_begin "go build sigs.k8s.io/kueue/cmd/kueue $KUEUE_VERSION"
# Kueue's Makefile stamps its version the same way.
ldflags="-s -w -X sigs.k8s.io/kueue/pkg/version.GitVersion=$KUEUE_VERSION"
(cd "$work" && go build -trimpath -ldflags="$ldflags" -o "$BIN.tmp" sigs.k8s.io/kueue/cmd/kueue >&2)
mv "$BIN.tmp" "$BIN"
step_end

# The release's CRDs and webhook manifests, as its kustomize bases hold them.
rm -rf "$OUT/config"
mkdir -p "$OUT/config/crd"
cp "$kueue_dir"/config/components/crd/bases/*.yaml "$OUT/config/crd/"
cp "$kueue_dir"/config/components/webhook/manifests.yaml "$OUT/config/webhooks.yaml"
chmod -R u+w "$OUT/config"
step_end
log "done: $BIN"
echo "$OUT"
