"""Names shared with the kubelet, gpu-admission and the in-container library.

These values are part of the compatibility contract with tkestack gpu-manager
clusters and must not change.
"""

from __future__ import annotations

VCORE_RESOURCE = "tencent.com/vcuda-core"
VMEMORY_RESOURCE = "tencent.com/vcuda-memory"

#: 100 vcuda-core units make one whole GPU.
HUNDRED_CORES = 100
#: One vcuda-memory unit is 256 MiB.
MEMORY_BLOCK_BYTES = 268435456

VCORE_ID_PREFIX = f"{VCORE_RESOURCE}-"
VMEMORY_ID_PREFIX = f"{VMEMORY_RESOURCE}-{MEMORY_BLOCK_BYTES}-"

VCORE_SOCKET = "vcore.sock"
VMEMORY_SOCKET = "vmemory.sock"
KUBELET_SOCKET = "kubelet.sock"
KUBELET_CHECKPOINT = "kubelet_internal_checkpoint"

DEVICE_PLUGIN_API_VERSION = "v1beta1"
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"

DEFAULT_DEVICE_PLUGIN_PATH = "/var/lib/kubelet/device-plugins/"
DEFAULT_DISPLAY_SOCKET = "/var/run/gpu-manager.sock"
DEFAULT_VIRTUAL_MANAGER_PATH = "/etc/gpu-manager/vm"
DEFAULT_CHECKPOINT_PATH = "/etc/gpu-manager/checkpoint"
DEFAULT_POD_RESOURCES_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"

#: XIDs that are application errors, not GPU faults (NVIDIA's device plugin skips the same set).
DEFAULT_IGNORED_XIDS = (13, 31, 43, 45, 68, 109)

# Pod annotations shared with gpu-admission.
PREDICATE_GPU_IDX_PREFIX = "tencent.com/predicate-gpu-idx-"
PREDICATE_TIME = "tencent.com/predicate-time"
PREDICATE_NODE = "tencent.com/predicate-node"
GPU_ASSIGNED = "tencent.com/gpu-assigned"
VCORE_LIMIT_ANNOTATION = "tencent.com/vcuda-core-limit"
CLUSTER_NAME_ANNOTATION = "clusterName"

# Annotations of an Allocate response (the runtime stores them on the container).
VDEVICE_ANNOTATION = "tencent.com/vcuda-device"

# Inside the container.
VCUDA_MOUNTPOINT = "/etc/vcuda"
DRIVER_MOUNTPOINT = "/usr/local/nvidia"
#: Env var naming the container's vcuda.config for the interceptor (ours; upstream's library looks elsewhere).
VCUDA_CONFIG_ENV = "VCUDA_CONFIG_PATH"
VCUDA_CONFIG_FILE = "vcuda.config"
PIDS_CONFIG_FILE = "pids.config"
VCUDA_SOCKET = "vcuda.sock"
#: Under ``--virtual-manager-path``: ``configs/<pod uid>/<container>/``, each container's own directory of
#: limit files, mounted alone at ``/etc/vcuda/<container>`` (the pod's directory, mounted at /etc/vcuda for
#: its vcuda.sock, keeps an empty mount point there): no container sees another's.
VCUDA_CONFIGS_DIR = "configs"
OWN_CHECKPOINT = "gpumanager_internal_checkpoint"

#: Marker the kubelet shows in a container's waiting message when PreStartContainer fails.
PRESTART_FAILED = "PreStartContainer check failed"
