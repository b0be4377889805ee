"""A Helm release of the chart on the local control plane, for the tests that install it: the repository's
CRDs (applied before) adopted by the release, and everything put back afterwards. Side effects: kubectl and
helm against the cluster."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path

from dynamig.devcluster.controlplane import ControlPlane

RELEASE_NAME_ANNOTATION = "meta.helm.sh/release-name"
RELEASE_NAMESPACE_ANNOTATION = "meta.helm.sh/release-namespace"


def adopt_crds(cp: ControlPlane, crds: Sequence[str], release: str, namespace: str) -> None:
    """Mark existing CRDs as the release's, as a user moving from the plain manifests to Helm does."""
    for crd in crds:
        cp.kubectl("label", "--overwrite", "crd", crd, "app.kubernetes.io/managed-by=Helm")
        cp.kubectl(
            "annotate", "--overwrite", "crd", crd,
            f"{RELEASE_NAME_ANNOTATION}={release}", f"{RELEASE_NAMESPACE_ANNOTATION}={namespace}",
        )  # fmt: skip


def forget_release(
    cp: ControlPlane, helm: str, release: str, namespace: str, crds: Sequence[str], repo_crds: Path
) -> None:
    """Uninstall (no hooks: no kubelet here runs the pre-delete Job), delete the namespace, and leave the CRDs
    unadopted and exactly as the repository defines them for the rest of the session. Never raises."""
    subprocess.run(
        [helm, "uninstall", release, "--namespace", namespace, "--ignore-not-found", "--no-hooks"],
        capture_output=True, text=True, timeout=120, env=cp.env(), check=False,
    )  # fmt: skip
    cp.kubectl("delete", "namespace", namespace, "--ignore-not-found", "--wait=false", check=False)
    for crd in crds:
        cp.kubectl("label", "crd", crd, "app.kubernetes.io/managed-by-", check=False)
        cp.kubectl(
            "annotate", "crd", crd, f"{RELEASE_NAME_ANNOTATION}-", f"{RELEASE_NAMESPACE_ANNOTATION}-",
            check=False,
        )  # fmt: skip
    cp.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(repo_crds), check=False)
