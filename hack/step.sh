#!/usr/bin/env bash
# Runs one command as a named set-up step (hack/lib/progress.sh) for the Makefile, whose recipes run in sh:
# "==> NAME" on stderr, then "==> NAME ... done in 12s", or "... failed after 12s (exit 1)" and its status.
#   usage: hack/step.sh NAME CMD [ARG...]
set -euo pipefail

# shellcheck source=hack/lib/progress.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/progress.sh"
step "$@"
