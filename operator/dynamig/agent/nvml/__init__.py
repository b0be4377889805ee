"""NVML: MIG discovery and changes, the profile table, NVLink facts, and the simulated driver's files."""
