"""The scheduler extender (its own process, ``gpu-manager-extender``): places vcuda shares and whole
GPUs on GPUs that can hold them, and writes gpu-admission's annotations at bind."""
