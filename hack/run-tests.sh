#!/usr/bin/env bash
# The test run of `make test`, after its set-up: the whole suite against the primary Kubernetes version,
# then the tests marked `matrix` against each other target. The other targets' control planes are only
# needed for the second part, so on a first run they are built beside the first part, at the lowest CPU
# priority (nice 19: the tests, mostly waiting on their control plane, lose next to nothing), instead of
# before it; a cached build is a no-op. Their build log: $DYNAMIG_CACHE/matrixplanes.log.
#   usage: hack/run-tests.sh PYTEST TARGET...     (TARGET: v1.36.3, v1.35.4+alpha, ...)
set -uo pipefail

pytest="${1:?usage: hack/run-tests.sh PYTEST TARGET...}"; shift
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache="${DYNAMIG_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dynamig}"
mkdir -p "$cache"
log="$cache/matrixplanes.log"

versions=()
for t in "$@"; do
  v="${t%%+*}"
  [[ " ${versions[*]} " == *" $v "* ]] || versions+=("$v")
done
(
  for v in "${versions[@]}"; do
    DYNAMIG_K8S_VERSION="$v" nice -n 19 bash "$root/hack/build-control-plane.sh" >/dev/null || exit 1
  done
) > "$log" 2>&1 &
planes=$!

"$pytest" -q -p no:cacheprovider
rc=$?
if ! wait "$planes"; then
  echo "building the control planes of ${versions[*]} failed; the end of $log:" >&2
  tail -n 40 "$log" >&2
  exit 1
fi
[ "$rc" -eq 0 ] || exit "$rc"
for t in "$@"; do
  echo "== Kubernetes $t: the tests marked matrix"
  "$pytest" -q -p no:cacheprovider -m matrix --k8s="$t" || exit 1
done
