"""DRA mode: the agent's second face to the kubelet (one mode per node).

Instead of the device-plugin resources, every GPU is published once in a
``resource.k8s.io/v1`` ResourceSlice with consumable ``cores`` and ``memory``
(:mod:`~gpumanager.dra.slices`), so the kube-scheduler itself places shares.
The kubelet's DRA API (registration socket and ``dra.sock``,
:mod:`~gpumanager.dra.plugin`) prepares allocated claims into the same limit
files the device plugin writes and a CDI spec (:mod:`~gpumanager.dra.prepare`,
:mod:`~gpumanager.dra.cdi`); the claims are recorded in the shared allocation
state and checkpoint.
"""
