"""A local Kubernetes control plane for tests, the embedded demo and ``dynamig dev-cluster``.

etcd, kube-apiserver, kube-scheduler and kube-controller-manager (ResourceClaim, garbage-collector, namespace,
service-account, ClusterRole-aggregation, Deployment, ReplicaSet, Job and disruption controllers; no node
lifecycle controller) run on 127.0.0.1 with free ports, RBAC + Node authorization and ``resource.k8s.io/v1``.
Nodes are registered through the API::

    with ControlPlane() as cp:                     # or: async with ControlPlane() as cp:
        cp.register_node("gpu-node-1", labels={"dynamig.io/managed": "true"})
        cp.kubectl("apply", "-f", "crds/")         # CompletedProcess; raises on failure
        subprocess.run([...], env=cp.env())        # KUBECONFIG set, kubectl's directory first on PATH
        async with cp.api_client() as api:         # kubernetes_asyncio ApiClient (admin)
            ...

Binaries come from ``KUBEBUILDER_ASSETS``, else PATH, else ``hack/build-control-plane.sh`` (see
:mod:`dynamig.devcluster.binaries`). pytest fixtures are in :mod:`dynamig.devcluster.pytest_plugin`.
"""

from dynamig.devcluster.binaries import Binaries, BinariesNotFoundError, find_binaries
from dynamig.devcluster.controlplane import ControlPlane, ControlPlaneError
from dynamig.devcluster.waiting import eventually

__all__ = [
    "Binaries",
    "BinariesNotFoundError",
    "ControlPlane",
    "ControlPlaneError",
    "eventually",
    "find_binaries",
]
