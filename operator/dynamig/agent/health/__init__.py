"""Device health: XID errors from NVML, as DRA device taints or withdrawn devices."""
