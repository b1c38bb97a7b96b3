"""The Kubernetes API side: client construction, pod cache, annotation patches, node labels, PodResources."""
