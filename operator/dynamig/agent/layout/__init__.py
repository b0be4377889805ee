"""One GPU's MIG layout: the reshape protocol as a pure plan, and carrying it out through NVML."""
