"""Kubernetes-facing code shared by the node agent and the operator (names, device shapes, CRD models)."""
