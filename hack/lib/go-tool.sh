# Sourced by the scripts that build one Go tool into the cache. go_tool_begin TOOL DIR sets OUT
# (<cache>/tools/DIR), BIN ($OUT/bin/TOOL) and work ($OUT/src); when BIN is already built it prints it and
# exits the script; otherwise it takes the build lock (another process may be building the same tool, and
# then BIN is printed once it is done, with a heartbeat while it waits) and sets up Go to build from the
# module proxy.

# shellcheck source=hack/lib/progress.sh
source "$(dirname "${BASH_SOURCE[0]}")/progress.sh"

go_tool_begin() {
  local tool="$1" dir="$2"
  OUT="${DYNAMIG_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dynamig}/tools/$dir"
  BIN="$OUT/bin/$tool"
  work="$OUT/src"
  if [ -x "$BIN" ]; then echo "$BIN"; exit 0; fi
  command -v go >/dev/null || { echo "go is required to build $tool" >&2; exit 1; }
  export GOTOOLCHAIN=local GOFLAGS=-mod=mod CGO_ENABLED=0
  mkdir -p "$work" "$OUT/bin"
  if command -v flock >/dev/null; then
    exec 9>"$OUT/.lock"
    wait_for_lock 9 "$tool in $OUT"
    if [ -x "$BIN" ]; then echo "$BIN"; exit 0; fi
  fi
}
