"""Per-pod directories, per-container limit files (vcuda.config, pids.config), the vcuda.sock service."""
