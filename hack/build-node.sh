#!/usr/bin/env bash
# Builds what a real test node runs beside the control plane, cached per version: a second run builds nothing.
#   kubelet                  from k8s.io/kubernetes (the same pinned version as the control plane)
#   containerd, containerd-shim-runc-v2, ctr   from github.com/containerd/containerd/v2 (2.x: CDI support)
#   runc                     Debian's package, unpacked into the cache (not installed on the system)
#   busybox                  Debian's busybox-static, the one program the test image holds
#   pause                    the sandbox's init, compiled from Kubernetes' own build/pause/linux/pause.c
#   usage: hack/build-node.sh      -> prints the bin directory on stdout (logs go to stderr)
set -euo pipefail

# shellcheck source=hack/lib/k8s-module.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/k8s-module.sh"
# shellcheck source=hack/lib/progress.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/progress.sh"
K8S_VERSION="${DYNAMIG_K8S_VERSION:-$K8S_PRIMARY_VERSION}"

CONTAINERD_VERSION="${DYNAMIG_CONTAINERD_VERSION:-v2.4.2}"
CACHE_ROOT="${DYNAMIG_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dynamig}"
OUT="$CACHE_ROOT/node/k8s-${K8S_VERSION}-containerd-${CONTAINERD_VERSION}"
BIN="$OUT/bin"
TOOLS=(kubelet containerd containerd-shim-runc-v2 ctr runc busybox pause)
# Bump when the way the binaries are built changes: binaries stamped with an older recipe are rebuilt.
RECIPE=1

export GOTOOLCHAIN=local GOFLAGS=-mod=mod CGO_ENABLED=0

have() { [ "$(cat "$BIN/.recipe" 2>/dev/null)" = "$RECIPE" ] && [ -x "$BIN/$1" ]; }
have_all() { for t in "${TOOLS[@]}"; do have "$t" || return 1; done; }
if have_all; then echo "$BIN"; exit 0; fi

log() { echo "[build-node] $*" >&2; }
for cmd in go gcc apt-get dpkg-deb; do
  command -v "$cmd" >/dev/null || { echo "build-node: $cmd is required" >&2; exit 1; }
done
mkdir -p "$BIN"
if command -v flock >/dev/null; then
  exec 9>"$OUT/.lock"
  wait_for_lock 9 "the node's binaries (Kubernetes $K8S_VERSION, containerd $CONTAINERD_VERSION) in $OUT"
  if have_all; then echo "$BIN"; exit 0; fi  # another process built it while we waited
fi
# Binaries of an older recipe are rebuilt; an interrupted build (no stamp yet) keeps what it finished.
if [ -f "$BIN/.recipe" ] && [ "$(cat "$BIN/.recipe")" != "$RECIPE" ]; then rm -f "$BIN"/* "$BIN/.recipe"; fi
work="$OUT/src"; mkdir -p "$work"
stage="$OUT/stage.$$"; rm -rf "$stage"; mkdir -p "$stage"
trap 'step_abort; rm -rf "$stage"' EXIT
step_begin "building the node: kubelet $K8S_VERSION, containerd $CONTAINERD_VERSION, runc, busybox, pause (once; cached in $OUT)"
install_built() { for f in "$stage"/*; do mv -f "$f" "$BIN/"; done; }

if ! [ -x "$BIN/kubelet" ]; then
  step_begin "building kubelet $K8S_VERSION (go mod tidy, go build)"
  ldflags=$(k8s_wrapper_module "$work/k8s" "$K8S_VERSION")
  printf '//go:build tools\n\npackage tools\n\nimport _ "k8s.io/kubernetes/cmd/kubelet"\n' > "$work/k8s/tools.go"
  (cd "$work/k8s" && go mod tidy >&2 && go build -trimpath -ldflags="$ldflags" -o "$stage/" k8s.io/kubernetes/cmd/kubelet >&2)
  install_built
  step_end
fi

if ! [ -x "$BIN/containerd" ] || ! [ -x "$BIN/containerd-shim-runc-v2" ] || ! [ -x "$BIN/ctr" ]; then
  step_begin "building containerd containerd-shim-runc-v2 ctr $CONTAINERD_VERSION (go mod tidy, go build)"
  mkdir -p "$work/containerd"
  printf 'module dynamig.io/containerd\n\ngo 1.26.0\n\nrequire github.com/containerd/containerd/v2 %s\n' "$CONTAINERD_VERSION" > "$work/containerd/go.mod"
  printf '//go:build tools\n\npackage tools\n\nimport (\n\t_ "github.com/containerd/containerd/v2/cmd/containerd"\n\t_ "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2"\n\t_ "github.com/containerd/containerd/v2/cmd/ctr"\n)\n' > "$work/containerd/tools.go"
  pkg=github.com/containerd/containerd/v2
  # no_btrfs: the btrfs snapshotter needs cgo headers; overlayfs and native are what the node uses.
  (cd "$work/containerd" && go mod tidy >&2 && go build -trimpath -tags no_btrfs \
     -ldflags="-s -w -X $pkg/version.Version=$CONTAINERD_VERSION" -o "$stage/" \
     $pkg/cmd/containerd $pkg/cmd/containerd-shim-runc-v2 $pkg/cmd/ctr >&2)
  install_built
  step_end
fi

# Debian packages are fetched with apt-get download and unpacked into the cache; nothing is installed.
debian_binary() {  # package, path inside the package, name in $BIN
  local pkgdir="$work/deb-$1"
  rm -rf "$pkgdir"; mkdir -p "$pkgdir"
  (cd "$pkgdir" && apt-get download "$1" >&2 2>&1 || { apt-get update >&2 && apt-get download "$1" >&2; })
  dpkg-deb -x "$pkgdir"/*.deb "$pkgdir/root"
  cp "$pkgdir/root/$2" "$stage/$3"
  install_built
}
if ! [ -x "$BIN/runc" ]; then
  step_begin "unpacking Debian's runc"; debian_binary runc usr/sbin/runc runc; step_end
fi
if ! [ -x "$BIN/busybox" ]; then
  step_begin "unpacking Debian's busybox-static"; debian_binary busybox-static bin/busybox busybox; step_end
fi

if ! [ -x "$BIN/pause" ]; then
  step_begin "compiling pause from k8s.io/kubernetes $K8S_VERSION build/pause/linux/pause.c"
  src=$(cd "$work/k8s" 2>/dev/null && go list -m -f '{{.Dir}}' k8s.io/kubernetes 2>/dev/null || true)
  [ -n "$src" ] || src=$(cd "$work" && go mod download -json "k8s.io/kubernetes@$K8S_VERSION" | sed -n 's/^\s*"Dir": "\(.*\)",\?$/\1/p')
  gcc -Os -static -Wall -Werror -DVERSION="$K8S_VERSION" -o "$stage/pause" "$src/build/pause/linux/pause.c"
  install_built
  step_end
fi

echo "$RECIPE" > "$BIN/.recipe"
have_all || { echo "node build incomplete in $BIN" >&2; exit 1; }
step_end
log "done: $BIN"
echo "$BIN"
