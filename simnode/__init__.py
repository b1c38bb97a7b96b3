"""The simulated GPU node: every stand-in the tests, benchmarks and demo run the agent against.

A kubelet (device-plugin registration, PodResources, its checkpoint), an API server reached through the
real ``kubernetes`` client, gpusim control of the simulated NVIDIA driver, the cluster harness and the
demo. The product (``gpumanager``) never imports this package, and the wheel does not carry it.
"""
