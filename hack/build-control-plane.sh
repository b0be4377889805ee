#!/usr/bin/env bash
# Builds the test control plane (kube-apiserver, kube-scheduler, kube-controller-manager, kubectl, etcd)
# from their Go modules at pinned versions. Output is cached per version: a second run builds nothing.
#   usage: hack/build-control-plane.sh            -> prints the bin directory on stdout (logs go to stderr)
# Safe to run from several processes at once: one builds (under a lock), the others wait and reuse it.
set -euo pipefail

# shellcheck source=hack/lib/k8s-module.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/k8s-module.sh"
# shellcheck source=hack/lib/progress.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/progress.sh"
K8S_VERSION="${DYNAMIG_K8S_VERSION:-$K8S_PRIMARY_VERSION}"

ETCD_VERSION="${DYNAMIG_ETCD_VERSION:-v3.6.8}"
CACHE_ROOT="${DYNAMIG_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dynamig}"
OUT="$CACHE_ROOT/control-plane/k8s-${K8S_VERSION}-etcd-${ETCD_VERSION}"
BIN="$OUT/bin"
TOOLS=(kube-apiserver kube-scheduler kube-controller-manager kubectl etcd)
K8S_TOOLS=(kube-apiserver kube-scheduler kube-controller-manager kubectl)
# Bump when the way the binaries are built changes: binaries stamped with an older recipe are rebuilt.
RECIPE="2 (version ldflags)"

export GOTOOLCHAIN=local GOFLAGS=-mod=mod CGO_ENABLED=0

have_all() {
  [ "$(cat "$BIN/.recipe" 2>/dev/null)" = "$RECIPE" ] || return 1
  for t in "${TOOLS[@]}"; do [ -x "$BIN/$t" ] || return 1; done
}
if have_all; then echo "$BIN"; exit 0; fi

log() { echo "[build-control-plane] $*" >&2; }
command -v go >/dev/null || { echo "go is required to build the control plane (or set KUBEBUILDER_ASSETS)" >&2; exit 1; }
mkdir -p "$BIN"
if command -v flock >/dev/null; then
  exec 9>"$OUT/.lock"
  wait_for_lock 9 "the control plane (Kubernetes $K8S_VERSION, etcd $ETCD_VERSION) in $OUT"
  if have_all; then echo "$BIN"; exit 0; fi  # another process built it while we waited
fi
work="$OUT/src"; mkdir -p "$work/k8s" "$work/etcd"
stage="$OUT/stage.$$"; rm -rf "$stage"; mkdir -p "$stage"
trap 'step_abort; rm -rf "$stage"' EXIT
step_begin "building the control plane: Kubernetes $K8S_VERSION, etcd $ETCD_VERSION (once; cached in $OUT)"
# Binaries are built into $stage and renamed into $BIN, so running processes and readers never see a
# half-written file.
install_built() { for f in "$stage"/*; do mv -f "$f" "$BIN/"; done; }

# --- Kubernetes: wrapper module with a replace directive per staging module -------------------------
have_k8s() {
  [ "$(cat "$BIN/.recipe" 2>/dev/null)" = "$RECIPE" ] || return 1
  for t in "${K8S_TOOLS[@]}"; do [ -x "$BIN/$t" ] || return 1; done
}
if ! have_k8s; then
  step_begin "resolving k8s.io/kubernetes $K8S_VERSION and its dependencies (go mod download, go mod tidy)"
  ldflags=$(k8s_wrapper_module "$work/k8s" "$K8S_VERSION")
  cat > "$work/k8s/tools.go" <<'GO'
//go:build tools

package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubectl"
)
GO
  (cd "$work/k8s" && go mod tidy >&2)
  step_end
  step_begin "go build kube-apiserver kube-scheduler kube-controller-manager kubectl $K8S_VERSION"
  (cd "$work/k8s" && go build -trimpath -ldflags="$ldflags" -o "$stage/" \
     k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-scheduler \
     k8s.io/kubernetes/cmd/kube-controller-manager k8s.io/kubernetes/cmd/kubectl >&2)
  install_built
  step_end
fi

# --- etcd -------------------------------------------------------------------------------------------
if ! [ -x "$BIN/etcd" ]; then
  step_begin "building etcd $ETCD_VERSION (go mod tidy, go build)"
  cat > "$work/etcd/go.mod" <<GOMOD
module dynamig.io/etcd

go 1.26.0

require go.etcd.io/etcd/server/v3 $ETCD_VERSION
GOMOD
  cat > "$work/etcd/tools.go" <<'GO'
//go:build tools

package tools

import _ "go.etcd.io/etcd/server/v3"
GO
  (cd "$work/etcd" && go mod tidy >&2 && go build -trimpath -ldflags='-s -w' -o "$stage/etcd" go.etcd.io/etcd/server/v3 >&2)
  install_built
  step_end
fi

echo "$RECIPE" > "$BIN/.recipe"
have_all || { echo "control-plane build incomplete in $BIN" >&2; exit 1; }
step_end
log "done: $BIN"
echo "$BIN"
