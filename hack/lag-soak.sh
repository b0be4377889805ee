#!/usr/bin/env bash
# The lagging-scheduler suite (e2e/test_lagging_scheduler.py) in rounds, each on a control plane of its own,
# round r in soak variant r mod 8 (inventory x create latency x quarantine); one JSON line per run in REPORT,
# then a summary of them all.
#   hack/lag-soak.sh ROUNDS [REPORT] [FIRST_ROUND]
set -u
rounds=${1:?rounds}
report=${2:-lag-soak.jsonl}
first=${3:-0}
cd "$(dirname "$0")/.."
for ((r = first; r < first + rounds; r++)); do
    echo "== round $r (variant $((r % 8))) $(date -u +%H:%M:%S)"
    DYNAMIG_LAG_VARIANTS=$((r % 8)) DYNAMIG_LAG_REPORT=$report \
        .venv/bin/pytest -q -p no:cacheprovider e2e/test_lagging_scheduler.py || echo "== round $r FAILED"
done
.venv/bin/python e2e/lag_soak_summary.py "$report"
