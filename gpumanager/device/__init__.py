"""NVML access: GPU inventory, health (XID events, lost GPUs) and usage sampling."""
