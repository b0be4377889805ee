"""The agent's Kubernetes API calls and the watched copies its rounds read."""
