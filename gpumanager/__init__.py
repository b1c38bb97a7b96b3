"""gpumanager: a Kubernetes node agent that shares NVIDIA GPUs between containers."""

__version__ = "0.1.0"
