"""Allocation: which GPUs a container gets, its Allocate answer, checkpoints and recovery (no gRPC here)."""
