"""Summary of a lagging-scheduler soak: the JSON lines ``DYNAMIG_LAG_REPORT`` collected, one per run.

    python e2e/lag_soak_summary.py lag-soak.jsonl

Prints runs per case and variant, then the safety figures over all of them: pods left bound to a device never
prepared, instances destroyed while a claim allocated them, and how long a pod whose first prepare was refused
waited for its device. Exits 1 when any run was unsafe.
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path


def main(path: str) -> int:
    runs = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    if not runs:
        print(f"{path}: no runs")
        return 1
    per_case: collections.Counter[str] = collections.Counter()
    per_variant: collections.Counter[str] = collections.Counter()
    outcomes: collections.Counter[str] = collections.Counter()
    stuck, lost, waits = [], [], []
    for run in runs:
        variant = f"{run['inventory']} create {run['create_s']:g}s quarantine {run['quarantine_s']:g}s"
        per_case[run["case"]] += 1
        per_variant[variant] += 1
        for pod, outcome in run["outcome"].items():
            outcomes[outcome.split()[0].rstrip(":")] += 1
            if outcome.startswith("stuck"):
                stuck.append((run["case"], variant, pod, outcome))
        lost += [(run["case"], variant, d) for d in run["destroyed_while_allocated"]]
        waits += [s for s in run["served_after_s"].values() if s > 0]
    print(f"{len(runs)} runs")
    for name, counter in (("case", per_case), ("variant", per_variant), ("pod outcome", outcomes)):
        print(f"  by {name}: " + ", ".join(f"{k} {v}" for k, v in sorted(counter.items())))
    print(f"  pods bound to a device never prepared: {len(stuck)}")
    print(f"  instances destroyed while a claim allocated them: {len(lost)}")
    if waits:
        waits.sort()
        print(f"  refused first prepares later served: {len(waits)}, max {waits[-1]:.1f}s")
    else:
        print("  refused first prepares later served: 0")
    for bad in stuck + lost:
        print(f"  UNSAFE {bad}")
    return 1 if stuck or lost else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
