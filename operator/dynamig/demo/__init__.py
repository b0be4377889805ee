"""The embedded demo: local control plane, simulated GPU nodes, operator and agents, the morning-burst story."""
