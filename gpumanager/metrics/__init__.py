"""Prometheus metrics, the display gRPC service and the HTTP endpoints."""
