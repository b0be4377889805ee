#!/usr/bin/env bash
# Builds the test control plane (kube-apiserver, kube-scheduler, kube-controller-manager, kubectl, etcd)
# from their Go modules at pinned versions. Output is cached per version: a second run builds nothing.
#   usage: hack/build-control-plane.sh            -> prints the bin directory on stdout
set -euo pipefail

K8S_VERSION="${DYNAMIG_K8S_VERSION:-v1.36.3}"
ETCD_VERSION="${DYNAMIG_ETCD_VERSION:-v3.6.8}"
CACHE_ROOT="${DYNAMIG_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dynamig}"
OUT="$CACHE_ROOT/control-plane/k8s-${K8S_VERSION}-etcd-${ETCD_VERSION}"
BIN="$OUT/bin"
TOOLS=(kube-apiserver kube-scheduler kube-controller-manager kubectl etcd)

export GOTOOLCHAIN=local GOFLAGS=-mod=mod CGO_ENABLED=0

have_all() { for t in "${TOOLS[@]}"; do [ -x "$BIN/$t" ] || return 1; done; }
if have_all; then echo "$BIN"; exit 0; fi

command -v go >/dev/null || { echo "go is required to build the control plane (or set KUBEBUILDER_ASSETS)" >&2; exit 1; }
mkdir -p "$BIN"
work="$OUT/src"; mkdir -p "$work/k8s" "$work/etcd"

log() { echo "[build-control-plane] $*" >&2; }

# --- Kubernetes: wrapper module with a replace directive per staging module -------------------------
if ! [ -x "$BIN/kube-apiserver" ] || ! [ -x "$BIN/kubectl" ] || ! [ -x "$BIN/kube-scheduler" ] || ! [ -x "$BIN/kube-controller-manager" ]; then
  log "resolving k8s.io/kubernetes $K8S_VERSION"
  gomod=$(cd "$work/k8s" && go mod download -json "k8s.io/kubernetes@$K8S_VERSION" | sed -n 's/^\s*"GoMod": "\(.*\)",\?$/\1/p')
  staging_version="v0${K8S_VERSION#v1}"
  {
    echo "module dynamig.io/control-plane"
    echo
    echo "go 1.26.0"
    echo
    echo "require k8s.io/kubernetes $K8S_VERSION"
    echo
    grep -E '^\s+k8s\.io/[a-z0-9-]+ v0\.0\.0$' "$gomod" | awk -v v="$staging_version" '{print "replace " $1 " => " $1 " " v}'
  } > "$work/k8s/go.mod"
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
  (cd "$work/k8s" && log "go mod tidy (k8s)" && go mod tidy >&2 \
     && log "go build kube-apiserver kube-scheduler kube-controller-manager kubectl" \
     && go build -trimpath -ldflags='-s -w' -o "$BIN/" \
          k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-scheduler \
          k8s.io/kubernetes/cmd/kube-controller-manager k8s.io/kubernetes/cmd/kubectl >&2)
fi

# --- etcd -------------------------------------------------------------------------------------------
if ! [ -x "$BIN/etcd" ]; then
  log "building etcd $ETCD_VERSION"
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
  (cd "$work/etcd" && go mod tidy >&2 && go build -trimpath -ldflags='-s -w' -o "$BIN/etcd" go.etcd.io/etcd/server/v3 >&2)
fi

have_all || { echo "control-plane build incomplete in $BIN" >&2; exit 1; }
log "done: $BIN"
echo "$BIN"
