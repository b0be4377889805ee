"""A GPU's MIG mode: switching it on request, and serving a GPU with MIG mode off whole."""
