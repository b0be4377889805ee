#!/usr/bin/env bash
# The test run of `make test` after the virtual environment: lint and type checks, the unit tests, the whole
# suite against the primary Kubernetes version, then the tests marked `matrix` against each other target.
#
# Where the time goes on a cold machine is building Go programs; the tests mostly wait on a control plane.
# So the builds run beside the tests instead of before them:
#   - the set-up (the primary control plane, the real node, helm, cdi-validate) at normal priority, beside
#     the lint, type checks and unit tests, which need none of it;
#   - the tools only some tests need (promtool, syft, the registry, cosign, Kueue, the hold scheduler) and
#     the other targets' control planes at the lowest CPU priority (nice 19) beside the rest of the suite,
#     in the order the tests come to them: those tests, mostly waiting on their control plane, lose next to
#     nothing.
# A test that needs something still being built waits for it (each build script holds a lock; the waiting
# test's pytest idles, so the build gets the CPU), as it would have waited before the run. A cached build is
# a no-op. The build logs: <cache>/setup-builds.log and <cache>/background-builds.log.
# The matrix targets run at once, each against its own control plane (they wait on the API server, not the
# CPU), each to its own log, printed in order.
#   usage: hack/run-tests.sh PYTEST TARGET...     (TARGET: v1.36.3, v1.35.4+alpha, ...)
set -uo pipefail

pytest="${1:?usage: hack/run-tests.sh PYTEST TARGET...}"; shift
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache="${DYNAMIG_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dynamig}"
mkdir -p "$cache"
setup_log="$cache/setup-builds.log"
log="$cache/background-builds.log"
pytest_args=(-q -p no:cacheprovider)

# A failed step leaves no build running behind it.
trap 'kill $(jobs -p) 2>/dev/null' EXIT

# $1: what was built; $2: its log. Prints the log's end on stderr and fails.
build_failed() {
  echo "$1 failed to build; the end of $2:" >&2
  tail -n 40 "$2" >&2
  exit 1
}

(
  for script in build-control-plane.sh build-node.sh build-helm.sh build-cdi-validate.sh; do
    bash "$root/hack/$script" >/dev/null || exit 1
  done
) > "$setup_log" 2>&1 &
setup=$!

"${MAKE:-make}" --no-print-directory -C "$root" lint typecheck imports || exit 1
echo "== the unit tests"
"$pytest" "${pytest_args[@]}" "$root/tests/unit" || exit 1

wait "$setup" || build_failed "the set-up (the control plane, the real node, helm or cdi-validate)" "$setup_log"
cat "$setup_log"

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
echo "== the control-plane, real-node and end-to-end tests (Kubernetes primary)"
"$pytest" "${pytest_args[@]}" --durations=25 --ignore="$root/tests/unit"
rc=$?
wait "$builds" || build_failed "a tool or another target's control plane (${versions[*]})" "$log"
[ "$rc" -eq 0 ] || exit "$rc"

targets=("$@")
pids=()
for t in "${targets[@]}"; do
  "$pytest" "${pytest_args[@]}" -m matrix --k8s="$t" > "$cache/matrix-$t.log" 2>&1 &
  pids+=($!)
done
failed=0
for i in "${!pids[@]}"; do
  t="${targets[$i]}"
  wait "${pids[$i]}"; status=$?
  echo "== Kubernetes $t: the tests marked matrix (exit code $status)"
  cat "$cache/matrix-$t.log"
  [ "$status" -eq 0 ] || failed=1
done
exit "$failed"
