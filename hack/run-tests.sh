#!/usr/bin/env bash
# The test run of `make test`, after its set-up: the whole suite against the primary Kubernetes version,
# then the tests marked `matrix` against each other target. The tools only some tests need (promtool,
# syft, the registry, cosign, Kueue, the hold scheduler) and the other targets' control planes are built
# beside the first part, at the lowest CPU priority (nice 19: the tests, mostly waiting on their control
# plane, lose next to nothing), instead of before it, in the order the tests come to them. A test that
# needs a tool still being built waits for it (each build script holds a lock; the waiting test's pytest
# idles, so the build gets the CPU), as it would have waited before the run. A cached build is a no-op.
# Their build log: <cache>/background-builds.log.
#   usage: hack/run-tests.sh PYTEST TARGET...     (TARGET: v1.36.3, v1.35.4+alpha, ...)
set -uo pipefail

pytest="${1:?usage: hack/run-tests.sh PYTEST TARGET...}"; shift
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache="${DYNAMIG_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dynamig}"
mkdir -p "$cache"
log="$cache/background-builds.log"

versions=()
for t in "$@"; do
  v="${t%%+*}"
  [[ " ${versions[*]} " == *" $v "* ]] || versions+=("$v")
done
(
  for tool in build-promtool.sh "build-oci-tool.sh syft" "build-oci-tool.sh registry" \
      "build-oci-tool.sh cosign" build-kueue.sh build-hold-scheduler.sh; do
    # shellcheck disable=SC2086  # a script and its argument
    nice -n 19 bash "$root/hack/"$tool >/dev/null || exit 1
  done
  for v in "${versions[@]}"; do
    DYNAMIG_K8S_VERSION="$v" nice -n 19 bash "$root/hack/build-control-plane.sh" >/dev/null || exit 1
  done
) > "$log" 2>&1 &
builds=$!

# the slowest tests are named at the end: where a run's time goes
"$pytest" -q -p no:cacheprovider --durations=25
rc=$?
if ! wait "$builds"; then
  echo "a build beside the tests failed (the tools, or the control planes of ${versions[*]}); the end of $log:" >&2
  tail -n 40 "$log" >&2
  exit 1
fi
[ "$rc" -eq 0 ] || exit "$rc"
for t in "$@"; do
  echo "== Kubernetes $t: the tests marked matrix"
  "$pytest" -q -p no:cacheprovider -m matrix --k8s="$t" || exit 1
done
