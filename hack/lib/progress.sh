# Sourced by the build scripts (and through hack/step.sh by the Makefile's set-up recipe): line-oriented
# progress on stderr, so a first set-up that builds for many minutes says what it is doing, and a CI log
# without a terminal reads the same. Every line goes to stderr: the scripts print their result on stdout.
#   step_begin NAME        "==> NAME" and starts its clock (steps nest)
#   step_end               "==> NAME ... done in 312s" for the innermost open step
#   step_abort             first in an EXIT trap: "==> NAME ... failed after 12s (exit 1)" for every open step
#                          when the script fails; returns 0 (under set -e a failing trap command would stop
#                          the trap and change the script's exit status)
#   step NAME CMD...       CMD between step_begin and step_end; a failure gets the failed line and CMD's status
#   wait_for_lock FD WHAT  an exclusive flock on FD (already open on the lock file); while another process
#                          holds it, a heartbeat line every DYNAMIG_LOCK_HEARTBEAT_S seconds (default 20, a
#                          fraction is fine) saying what it waits for and for how long, then how long it took

_step_names=()
_step_starts=()

# Microseconds since the epoch (bash 5's EPOCHREALTIME; whole seconds on an older bash).
_progress_now_us() {
  if [ -n "${EPOCHREALTIME:-}" ]; then echo "${EPOCHREALTIME//[!0-9]/}"; else echo "$(( $(date +%s) * 1000000 ))"; fi
}

# Whole seconds since a _progress_now_us value.
_progress_since() { echo "$(( ($(_progress_now_us) - $1) / 1000000 ))"; }

# Closes the innermost open step with "done" or, given an exit status, "failed".
_step_close() {
  local i=$(( ${#_step_names[@]} - 1 )) took
  [ "$i" -ge 0 ] || return 0
  took="$(_progress_since "${_step_starts[$i]}")s"
  if [ $# -eq 0 ]; then
    echo "==> ${_step_names[$i]} ... done in $took" >&2
  else
    echo "==> ${_step_names[$i]} ... failed after $took (exit $1)" >&2
  fi
  unset "_step_names[$i]" "_step_starts[$i]"
}

step_begin() {
  _step_names+=("$1")
  _step_starts+=("$(_progress_now_us)")
  echo "==> $1" >&2
}

step_end() { _step_close; }

step_abort() {
  local rc=$?
  if [ "$rc" -ne 0 ]; then
    while [ ${#_step_names[@]} -gt 0 ]; do _step_close "$rc"; done
  fi
  return 0
}

step() {
  local name="$1" rc=0
  shift
  step_begin "$name"
  "$@" || rc=$?
  if [ "$rc" -ne 0 ]; then _step_close "$rc"; return "$rc"; fi
  _step_close
}

# Returns once FD holds the lock, or at once when flock cannot lock at all (the caller then goes on without
# the lock, as it always did). -E 75 tells "another process holds it" from an error.
wait_for_lock() {
  local fd="$1" what="$2" every="${DYNAMIG_LOCK_HEARTBEAT_S:-20}" start rc=0
  flock -n -E 75 "$fd" || rc=$?
  [ "$rc" -eq 75 ] || return 0
  start=$(_progress_now_us)
  echo "==> waiting for $what: another process holds its build lock" >&2
  while true; do
    rc=0
    flock -w "$every" -E 75 "$fd" || rc=$?
    [ "$rc" -eq 75 ] || break
    echo "==> still waiting for $what (another process is building it): $(_progress_since "$start")s" >&2
  done
  echo "==> waited $(_progress_since "$start")s for $what" >&2
}
