"""How the tests run Kueue beside the local control plane (``dynamig.devcluster.kueue``): its webhooks called
at a local URL and held to the namespaces that opt in, its Configuration."""

from __future__ import annotations

import base64
from pathlib import Path

import yaml

from dynamig.devcluster.kueue import MANAGED_NAMESPACE_LABEL, kueue_config, local_webhooks

# The shape of Kueue's config/components/webhook/manifests.yaml (v0.17.0): a service reference per webhook.
MANIFESTS = """
apiVersion: admissionregistration.k8s.io/v1
kind: MutatingWebhookConfiguration
metadata:
  name: mutating-webhook-configuration
webhooks:
- admissionReviewVersions: [v1]
  clientConfig:
    service: {name: webhook-service, namespace: system, path: /mutate-batch-v1-job}
  failurePolicy: Fail
  name: mjob.kb.io
  rules: [{apiGroups: [batch], apiVersions: [v1], operations: [CREATE], resources: [jobs]}]
  sideEffects: None
- admissionReviewVersions: [v1]
  clientConfig:
    service: {name: webhook-service, namespace: system, path: /mutate-jobset-x-k8s-io-v1alpha2-jobset}
  failurePolicy: Fail
  name: mjobset.kb.io
  rules: [{apiGroups: [jobset.x-k8s.io], apiVersions: [v1alpha2], operations: [CREATE], resources: [jobsets]}]
  sideEffects: None
- admissionReviewVersions: [v1]
  clientConfig:
    service: {name: webhook-service, namespace: system, path: /mutate--v1-pod}
  failurePolicy: Fail
  name: mpod.kb.io
  rules: [{apiGroups: [""], apiVersions: [v1], operations: [CREATE], resources: [pods]}]
  sideEffects: None
---
apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingWebhookConfiguration
metadata:
  name: validating-webhook-configuration
webhooks:
- admissionReviewVersions: [v1]
  clientConfig:
    service: {name: webhook-service, namespace: system, path: /validate-kueue-x-k8s-io-v1beta2-clusterqueue}
  failurePolicy: Fail
  name: vclusterqueue.kb.io
  rules:
  - {apiGroups: [kueue.x-k8s.io], apiVersions: [v1beta2], operations: [CREATE], resources: [clusterqueues]}
  sideEffects: None
"""


def test_webhooks_call_the_local_process_and_pods_and_jobs_only_in_opted_in_namespaces() -> None:
    hooks = local_webhooks(MANIFESTS, "https://127.0.0.1:9443", b"CA PEM")
    assert [h["kind"] for h in hooks] == ["MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"]
    mutating, validating = hooks
    # the JobSet webhook is dropped: that integration does not run, and a Fail hook with no handler would
    # refuse every JobSet in the cluster
    assert [w["name"] for w in mutating["webhooks"]] == ["mjob.kb.io", "mpod.kb.io"]
    job, pod = mutating["webhooks"]
    assert pod["clientConfig"] == {
        "url": "https://127.0.0.1:9443/mutate--v1-pod",
        "caBundle": base64.b64encode(b"CA PEM").decode(),
    }
    assert job["clientConfig"]["url"] == "https://127.0.0.1:9443/mutate-batch-v1-job"
    for hook in (pod, job):
        assert hook["namespaceSelector"] == {"matchLabels": {MANAGED_NAMESPACE_LABEL: "true"}}
    (cq,) = validating["webhooks"]
    assert cq["clientConfig"]["url"].endswith("/validate-kueue-x-k8s-io-v1beta2-clusterqueue")
    assert "namespaceSelector" not in cq  # cluster-scoped Kueue objects: every one is Kueue's
    assert {h["metadata"]["name"] for h in hooks} == {
        "dynamig-test-kueue-mutating",
        "dynamig-test-kueue-validating",
    }
    assert "service" not in yaml.safe_dump_all(hooks)


def test_configuration_runs_the_pod_and_job_integrations_locally_without_leader_election(
    tmp_path: Path,
) -> None:
    cfg = kueue_config(9443, 8081, tmp_path)
    assert cfg["webhook"] == {"port": 9443, "host": "127.0.0.1", "certDir": str(tmp_path)}
    assert cfg["integrations"] == {"frameworks": ["pod", "batch/job"]}
    assert cfg["internalCertManagement"] == {"enable": False}
    assert cfg["leaderElection"] == {"leaderElect": False}
    assert cfg["managedJobsNamespaceSelector"] == {"matchLabels": {MANAGED_NAMESPACE_LABEL: "true"}}
