"""The embedded demo: local control plane, simulated GPU nodes, operator and agents.

It replays the morning-burst story.
"""
