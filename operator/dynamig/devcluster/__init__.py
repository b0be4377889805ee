"""A local Kubernetes control plane (etcd, kube-apiserver, kube-scheduler, kube-controller-manager) for tests,
the embedded demo and ``dynamig dev-cluster``. See :class:`ControlPlane`."""

from dynamig.devcluster.binaries import Binaries, BinariesNotFoundError, find_binaries
from dynamig.devcluster.controlplane import ControlPlane, ControlPlaneError

__all__ = ["Binaries", "BinariesNotFoundError", "ControlPlane", "ControlPlaneError", "find_binaries"]
