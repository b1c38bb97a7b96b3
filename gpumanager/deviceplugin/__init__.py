"""The kubelet-facing side: device-plugin gRPC servers for vcuda-core and vcuda-memory, and registration."""
