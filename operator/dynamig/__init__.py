"""dynamig: re-cut NVIDIA MIG GPUs while the cluster runs, driven by DRA demand."""

__version__ = "0.1.0"

API_GROUP = "dynamig.io"
API_VERSION = "v1alpha1"
DRIVER_NAME = "mig.dynamig.io"
