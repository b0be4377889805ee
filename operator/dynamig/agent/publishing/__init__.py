"""What the agent tells the cluster: ResourceSlices, GpuPartition status and Events, and who owns a GPU."""
