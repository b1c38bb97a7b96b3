"""``gpu-manager selftest``: isolation proven on the node's own GPU.

The command lays out a temporary driver mirror as the agent does (the installed interceptor under
the driver's names, the node's real ``libcuda``/``libnvidia-ml`` beside it), runs small CUDA
programs in child processes through NVIDIA's cuda-bindings (a spin kernel shipped as PTX text and
compiled by the driver with ``cuModuleLoadData``), and prints one table: every allocation path
held or escaped, the memory views inside, four processes of one container against its cap, the SM
share achieved at several limits, and the per-call cost of the interceptor.  See ``command.py``.
"""

from gpumanager.selftest.command import main

__all__ = ["main"]
