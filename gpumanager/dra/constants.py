"""Names of DRA mode: the driver, its sockets, its ResourceSlice fields, its CDI kind."""

from __future__ import annotations

import hashlib

DEFAULT_DRIVER_NAME = "vcuda.tencent.com"
DEFAULT_PLUGIN_REGISTRY = "/var/lib/kubelet/plugins_registry"
DEFAULT_PLUGINS_DIR = "/var/lib/kubelet/plugins"
DEFAULT_CDI_ROOT = "/var/run/cdi"

#: The socket the kubelet calls NodePrepareResources on, in --dra-plugin-path.
DRA_SOCKET = "dra.sock"
#: PluginInfo.type of a DRA driver.
PLUGIN_TYPE = "DRAPlugin"
#: The health stream's gRPC service names: v1, the beta name, and the alpha name kubelets of 1.34
#: and 1.35 call (k8s.io/kubelet pkg/apis/dra-health v1, v1beta1, v1alpha1: the same messages,
#: field for field).
HEALTH_SERVICES = ("v1.DRAResourceHealth", "v1beta1.DRAResourceHealth", "v1alpha1.DRAResourceHealth")
#: gRPC service names the kubelet may pick from (it takes the newest it speaks of each kind). A
#: kubelet that speaks dra-health v1 opens the health stream only for a driver listing it here.
SUPPORTED_VERSIONS = ("v1.DRAPlugin", "v1beta1.DRAPlugin", *HEALTH_SERVICES)

RESOURCE_API = "resource.k8s.io/v1"

# Capacities of every GPU device.
CORES = "cores"
MEMORY = "memory"
#: vcuda-memory's unit: memory is requested and published in steps of 256 MiB.
MEMORY_STEP = 256 << 20

# Attributes (unqualified names belong to the driver's domain).
ATTR_UUID = "uuid"
ATTR_PRODUCT = "productName"
ATTR_INDEX = "index"
ATTR_MINOR = "minor"
#: The GPU's NVLink group: GPUs joined by NVLink share a value, so a multi-GPU claim can match on it.
ATTR_NVLINK_GROUP = "nvlinkGroup"
ATTR_PCIE_ROOT = "resource.kubernetes.io/pcieRoot"
ATTR_NUMA_NODE = "resource.kubernetes.io/numaNode"

#: Effect of the taint an unhealthy GPU gets (new claims are not placed there).
TAINT_EFFECT = "NoSchedule"
#: Name of the taint (in the driver's domain); its value says why, e.g. ``xid-79``.
TAINT_NAME = "unhealthy"

#: CDI class of the driver's devices: ``<driver>/gpu``.
CDI_CLASS = "gpu"
CDI_VERSION = "0.5.0"


MAX_NAME = 253
"""The longest object name (a DNS subdomain)."""


def device_name(index: int) -> str:
    """The device of GPU ``index`` in the ResourceSlice: ``gpu-<index>``."""
    return f"gpu-{index}"


def taint_key(driver: str) -> str:
    """``<driver>/unhealthy``."""
    return f"{driver}/{TAINT_NAME}"


def slice_name(node: str, driver: str) -> str:
    """Name of the node's ResourceSlice: ``<node>-<driver>``; when that is over the 253 characters of an
    object name (a node name may have 253 itself), the node name cut short, then the first 10 hex
    digits of its SHA-256 (so long names that differ only past the cut stay apart), then the driver."""
    name = f"{node}-{driver}"
    if len(name) <= MAX_NAME:
        return name
    digest = hashlib.sha256(node.encode()).hexdigest()[:10]
    keep = max(MAX_NAME - len(driver) - len(digest) - 2, 0)
    # A DNS subdomain: no '-' or '.' next to the '-' that follows.
    head = node[:keep].rstrip("-.")
    return f"{head}-{digest}-{driver}" if head else f"{digest}-{driver}"
