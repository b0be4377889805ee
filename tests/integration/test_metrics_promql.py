"""dynamig's metrics as Prometheus evaluates them: Prometheus' own PromQL engine and rule checker
(``promtool``, built from github.com/prometheus/prometheus by ``hack/build-promtool.sh``).

- The join the DCGM exporter cannot make for MIG devices created on the fly, as the README and the claim
  info's HELP text write it: a DCGM per-instance series written as dcgm-exporter renders it
  (internal/pkg/rendermetrics/render_metrics.go: ``gpu``, ``UUID`` of the parent GPU, ``pci_bus_id``,
  ``device=nvidia<N>``, ``modelName``, ``GPU_I_PROFILE``, ``GPU_I_ID`` and the host label, ``Hostname`` up to
  its 4.5.3-4.8.2 release and ``hostname`` after, holding the exporter pod's name without ``$NODE_NAME``),
  with the target labels a ServiceMonitor scrape adds, multiplied with the agent's
  ``dynamig_mig_instance_claim_info`` gives the pod, evaluated by ``promtool test rules`` over the series the
  agent's registry exposes; the dashboard's panel built on that join returns the pod too.
- The chart's PrometheusRule (rendered by helm) passes ``promtool check rules``, and each alert on an agent
  error counter fires on the first error, because the counters start at zero; so does the operator's alert
  on failed layout writes. The pending-too-long alert reads the oldest pending claim's age, so a claim
  pending since before the operator started fires at once.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dynamig.agent.metrics import AgentMetrics, InstanceSample
from dynamig.devcluster.binaries import BinariesNotFoundError, build_tool
from dynamig.operator.metrics import OperatorMetrics

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "manifests" / "helm" / "dynamig"
RUNBOOKS = "https://docs.example.org/dynamig/operations.md"  # where an install publishes its runbooks
GPU_UUID = "GPU-7c4f0e2a-1b3d-4e5f-8a9b-0c1d2e3f4a5b"
PENDING_CLAIM_SECONDS = 600  # the chart's default metrics.prometheusRule.pendingClaimSeconds


@pytest.fixture(scope="module")
def promtool() -> str:
    try:
        return str(build_tool("build-promtool.sh"))
    except BinariesNotFoundError as exc:
        pytest.fail(f"promtool could not be built from its Go module (make promtool): {exc}")


def _series(text: str, family: str) -> list[str]:
    """The exposition's samples of ``family`` as PromQL series selectors. Pure."""
    out = []
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == family:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                out.append(f"{s.name}{{{labels}}}")
    return out


def _dashboard_expr(title: str) -> str:
    dash = json.loads((ROOT / "dashboards" / "dynamig.json").read_text())
    (panel,) = [p for p in dash["panels"] if p["title"] == title]
    (target,) = panel["targets"]
    return str(target["expr"])


# A DCGM per-instance series as dcgm-exporter renders it for a MIG instance (rendermetrics' gpuMetricsFormat:
# gpu, UUID, pci_bus_id, device, modelName, GPU_I_PROFILE, GPU_I_ID, then the host label), with the target
# labels Prometheus adds when a ServiceMonitor scrapes the exporter's pod. Two forms of the host label: its
# releases up to 4.5.3-4.8.2 write `Hostname`, later ones `hostname`; the value is $NODE_NAME where the
# exporter's pod sets it, else the pod's own hostname, i.e. its name.
DCGM_RELEASES = {
    "4.5.3-4.8.2, no NODE_NAME": {"Hostname": "nvidia-dcgm-exporter-x7k2p"},
    "after 4.5.3-4.8.2": {"hostname": "gpu-node-a"},
}
SCRAPE_TARGET = {
    "container": "nvidia-dcgm-exporter",
    "endpoint": "gpu-metrics",
    "instance": "10.0.3.17:9400",
    "job": "nvidia-dcgm-exporter",
    "namespace": "gpu-operator",
    "pod": "nvidia-dcgm-exporter-x7k2p",
    "service": "nvidia-dcgm-exporter",
}


def _dcgm_labels(host: dict[str, str], gi: int, profile: str) -> dict[str, str]:
    return {
        "gpu": "0",
        "UUID": GPU_UUID,
        "pci_bus_id": "00000000:07:00.0",
        "device": "nvidia0",
        "modelName": "NVIDIA A100-SXM4-80GB",
        "GPU_I_PROFILE": profile,
        "GPU_I_ID": str(gi),
        **host,
        **SCRAPE_TARGET,
    }


def _selector(labels: dict[str, str]) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


def _readme_join() -> str:
    """The join the README's Metrics section shows, on one line. Pure but for reading the README."""
    section = (ROOT / "README.md").read_text().split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]
    found = re.search(r"```\n(.*?)```", section, re.S)
    assert found, "no PromQL block in the README's Metrics section"
    return " ".join(found.group(1).split())


def test_dcgm_utilisation_joins_to_the_pod_through_the_claim_info(promtool: str, tmp_path: Path) -> None:
    metrics = AgentMetrics(CollectorRegistry(), "gpu-node-a")
    metrics.snapshot(
        (
            InstanceSample(
                0,
                GPU_UUID,
                "1g.10gb",
                9,
                "MIG-aaaa",
                "gpu0-1g10gb-s6",
                "in-use",
                (("ml/infer-x", "infer-0"),),
            ),
            InstanceSample(0, GPU_UUID, "3g.40gb", 2, "MIG-bbbb", "gpu0-3g40gb-s0", "free"),
        ),
        (),
    )
    text = generate_latest(metrics.registry).decode()
    (claim_series,) = _series(text, "dynamig_mig_instance_claim_info")
    (family,) = [
        f for f in text_string_to_metric_families(text) if f.name == "dynamig_mig_instance_claim_info"
    ]
    # The join as the metric's own HELP text gives it, and as the README shows it.
    help_join = "DCGM_FI_PROF_GR_ENGINE_ACTIVE * " + family.documentation.split("<DCGM series> * ", 1)[1]
    readme_join = _readme_join()
    assert readme_join == help_join, (readme_join, help_join)
    util = "DCGM_FI_PROF_GR_ENGINE_ACTIVE"
    tests: list[dict[str, Any]] = []
    for release, host in DCGM_RELEASES.items():
        used, idle = _dcgm_labels(host, 9, "1g.10gb"), _dcgm_labels(host, 2, "3g.40gb")
        by_pod = used | {"namespace": "ml", "pod": "infer-0"}  # the claim's, not the exporter pod's
        tests.append(
            {
                "name": f"dcgm-exporter {release}",
                "interval": "1m",
                "input_series": [
                    {"series": claim_series, "values": "1x5"},
                    {"series": util + _selector(used), "values": "0.75x5"},
                    {"series": util + _selector(idle), "values": "0.5x5"},
                ],
                "promql_expr_test": [
                    {
                        "expr": readme_join,
                        "eval_time": "3m",
                        "exp_samples": [{"labels": _selector(by_pod), "value": 0.75}],
                    },
                    {
                        # The dashboard's panel, as Grafana sends it with every node selected.
                        "expr": _dashboard_expr("Graphics engine activity by pod (DCGM)").replace(
                            "$node", ".*"
                        ),
                        "eval_time": "3m",
                        "exp_samples": [
                            {
                                "labels": '{Hostname="gpu-node-a",GPU_I_PROFILE="1g.10gb",namespace="ml",'
                                'pod="infer-0"}',
                                "value": 0.75,
                            }
                        ],
                    },
                ],
            }
        )
    path = tmp_path / "join_test.yaml"
    path.write_text(
        yaml.safe_dump({"rule_files": [], "evaluation_interval": "1m", "tests": tests}, sort_keys=False)
    )
    proc = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_chart_alert_rules_pass_promtool_and_fire_on_the_first_agent_error(
    promtool: str, tmp_path: Path
) -> None:
    helm = str(build_tool("build-helm.sh"))
    rendered = subprocess.run(
        [helm, "template", "dynamig", str(CHART), "--namespace", "dynamig-system",
         "--set", "metrics.prometheusRule.enabled=true",
         "--set", "metrics.prometheusRule.skipCapabilityCheck=true",
         "--set", f"metrics.prometheusRule.runbookBaseURL={RUNBOOKS}"],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    (rule,) = [d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "PrometheusRule"]
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}, sort_keys=False))
    checked = subprocess.run(
        [promtool, "check", "rules", str(rules)], capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    # Every alert says where to look and links a runbook that exists in docs/operations.md.
    runbooks = (ROOT / "docs" / "operations.md").read_text()
    for group in rule["spec"]["groups"]:
        for r in group["rules"]:
            notes = r["annotations"]
            assert {"summary", "description", "runbook_url"} <= notes.keys(), r["alert"]
            anchor = notes["runbook_url"].split("#", 1)[1]
            assert anchor == r["alert"].lower() and f"#### {r['alert']}\n" in runbooks, r["alert"]

    # The agent's plugin error counter, as its registry exposes it: 0 from the start, then one error.
    metrics = AgentMetrics(CollectorRegistry(), "gpu-node-a")
    zero = _series(generate_latest(metrics.registry).decode(), "dynamig_kubelet_plugin_requests_total")
    errors = [s for s in zero if 'result="error"' in s and 'operation="prepare"' in s]
    assert len(errors) == 1, zero
    test: dict[str, Any] = {
        "rule_files": [str(rules)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [{"series": errors[0], "values": "0 0 0 1 1 1 1"}],
                "alert_rule_test": [
                    {"eval_time": "2m", "alertname": "DynamigKubeletPluginErrors", "exp_alerts": []},
                    {
                        "eval_time": "4m",
                        "alertname": "DynamigKubeletPluginErrors",
                        "exp_alerts": [
                            {
                                "exp_labels": {
                                    "severity": "warning",
                                    "Hostname": "gpu-node-a",
                                    "operation": "prepare",
                                },
                                "exp_annotations": {
                                    "summary": "The kubelet plugin on gpu-node-a failed to prepare claims "
                                    "in the last 10 minutes; their pods cannot start.",
                                    "description": "The agent's log and the pods' Events "
                                    "(FailedPrepareDynamicResources) say why.",
                                    "runbook_url": f"{RUNBOOKS}#dynamigkubeletpluginerrors",
                                },
                            }
                        ],
                    },
                ],
            }
        ],
    }
    test["tests"] += [*_operator_alert_tests(), _reshape_failure_test()]
    path = tmp_path / "alert_test.yaml"
    path.write_text(yaml.safe_dump(test, sort_keys=False))
    proc = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _operator_alert_tests() -> list[dict[str, Any]]:
    """DynamigDemandPendingTooLong over the operator's series (names and labels as its registry exposes
    them): policy ``old`` has a claim created 15 minutes before the operator started, policy ``new`` one
    created when it started. The old claim fires at once; the new one once it is older than the limit."""
    metrics = OperatorMetrics()
    for policy in ("old", "new"):
        metrics.set_pending(policy, {("1g.10gb", "NoCapacity"): 2})
        metrics.set_governed(policy, 1, 0.0)
    text = generate_latest(metrics.registry).decode()

    def by_policy(family: str) -> dict[str, str]:
        return {re.sub(r'.*policy="([^"]*)".*', r"\1", s): s for s in _series(text, family)}

    pending = by_policy("dynamig_operator_pending_devices")
    age = by_policy("dynamig_operator_oldest_pending_claim_age_seconds")
    summary = (
        "A claim under policy {p} has been pending for more than {limit}s; 2 device(s) of MIG profile "
        "1g.10gb are pending (NoCapacity)."
    )

    def firing(policy: str) -> dict[str, Any]:
        return {
            "exp_labels": {
                "severity": "warning",
                "policy": policy,
                "profile": "1g.10gb",
                "reason": "NoCapacity",
            },
            "exp_annotations": {
                "summary": summary.format(p=policy, limit=PENDING_CLAIM_SECONDS),
                "description": "kubectl describe gpupartitionpolicy and the Events of the pending claims "
                "say why.",
                "runbook_url": f"{RUNBOOKS}#dynamigdemandpendingtoolong",
            },
        }

    name = "DynamigDemandPendingTooLong"
    return [
        {
            "interval": "1m",
            "input_series": [
                {"series": pending["old"], "values": "2x15"},
                {"series": age["old"], "values": "900+60x15"},  # 15 min old when the operator starts
                {"series": pending["new"], "values": "2x15"},
                {"series": age["new"], "values": "0+60x15"},
            ],
            "alert_rule_test": [
                {"eval_time": "1m", "alertname": name, "exp_alerts": [firing("old")]},
                {"eval_time": "9m", "alertname": name, "exp_alerts": [firing("old")]},
                {"eval_time": "11m", "alertname": name, "exp_alerts": [firing("new"), firing("old")]},
            ],
        }
    ]


def _reshape_failure_test() -> dict[str, Any]:
    """DynamigReshapeFailures fires on a policy's first failed layout write: the operator's counter of
    failures exists at 0 from the policy's first round (OperatorMetrics.policy_seen)."""
    metrics = OperatorMetrics()
    metrics.set_governed("p", 1, 0.0)
    zero = _series(generate_latest(metrics.registry).decode(), "dynamig_operator_reshapes_total")
    (failed,) = [s for s in zero if 'result="failed"' in s]
    return {
        "interval": "1m",
        "input_series": [{"series": failed, "values": "0 0 0 1 1 1 1 1 1 1 1 1"}],
        "alert_rule_test": [
            {"eval_time": "2m", "alertname": "DynamigReshapeFailures", "exp_alerts": []},
            {
                "eval_time": "9m",  # after its `for: 5m`
                "alertname": "DynamigReshapeFailures",
                "exp_alerts": [
                    {
                        "exp_labels": {"severity": "warning", "policy": "p"},
                        "exp_annotations": {
                            "summary": "Writing GpuPartition layouts for policy p failed in the last 30 "
                            "minutes.",
                            "description": "The operator's log and the policy's Events (kubectl describe "
                            "gpupartitionpolicy) name the API error; RBAC or an admission webhook are the "
                            "usual causes.",
                            "runbook_url": f"{RUNBOOKS}#dynamigreshapefailures",
                        },
                    }
                ],
            },
        ],
    }
