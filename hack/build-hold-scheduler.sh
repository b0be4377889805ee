#!/usr/bin/env bash
# Builds kube-scheduler with the HoldForTest Permit plugin (hack/hold-scheduler/main.go) from the same pinned
# Kubernetes module as the control plane. Cached per version and source: a second run builds nothing.
#   usage: hack/build-hold-scheduler.sh   -> prints the binary's path on stdout (logs go to stderr)
set -euo pipefail

# shellcheck source=hack/lib/k8s-module.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/k8s-module.sh"
# shellcheck source=hack/lib/progress.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/progress.sh"
K8S_VERSION="${DYNAMIG_K8S_VERSION:-$K8S_PRIMARY_VERSION}"

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE_ROOT="${DYNAMIG_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dynamig}"
src="$root/hack/hold-scheduler/main.go"
sum=$(sha256sum "$src" | cut -c1-12)
OUT="$CACHE_ROOT/hold-scheduler/k8s-${K8S_VERSION}-${sum}"
BIN="$OUT/kube-scheduler-hold"
if [ -x "$BIN" ]; then echo "$BIN"; exit 0; fi

export GOTOOLCHAIN=local GOFLAGS=-mod=mod CGO_ENABLED=0
log() { echo "[build-hold-scheduler] $*" >&2; }
command -v go >/dev/null || { echo "go is required to build the hold scheduler" >&2; exit 1; }
mkdir -p "$OUT"
if command -v flock >/dev/null; then
  exec 9>"$OUT/.lock"
  wait_for_lock 9 "kube-scheduler with HoldForTest ($K8S_VERSION) in $OUT"
  if [ -x "$BIN" ]; then echo "$BIN"; exit 0; fi
fi
trap step_abort EXIT
step_begin "building kube-scheduler with HoldForTest $K8S_VERSION (go mod tidy, go build; once, cached in $OUT)"
work="$OUT/src"; rm -rf "$work"; mkdir -p "$work"
ldflags=$(k8s_wrapper_module "$work" "$K8S_VERSION")
cp "$src" "$work/main.go"
(cd "$work" && go mod tidy >&2 && go build -trimpath -ldflags="$ldflags" -o "$BIN.tmp" . >&2)
mv -f "$BIN.tmp" "$BIN"
step_end
log "done: $BIN"
echo "$BIN"
