"""The container's Allocate answer, in gpu-manager's exact shape, as plain data (no gRPC types here)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import PurePosixPath

from gpumanager import names
from gpumanager.allocation.records import ContainerAllocation
from gpumanager.device.types import GPUInfo


@dataclass(frozen=True)
class Mount:
    """A bind mount into the container."""

    container_path: str
    host_path: str
    read_only: bool = True


@dataclass(frozen=True)
class DeviceNode:
    """A device node made available to the container."""

    container_path: str
    host_path: str
    permissions: str = "rwm"


@dataclass(frozen=True)
class ContainerResponse:
    """What the kubelet passes to the runtime for one container."""

    envs: dict[str, str] = field(default_factory=dict)
    mounts: tuple[Mount, ...] = ()
    devices: tuple[DeviceNode, ...] = ()
    annotations: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ResponseSettings:
    """Node-wide inputs of every answer."""

    vdriver_nvidia: str  # host path of the share-mode driver mirror (interceptor inside)
    vdriver_origin: str  # host path of the untouched driver mirror
    virtual_manager_path: str
    extra_devices: tuple[str, ...] = ()

    @cached_property
    def _parts(self) -> _Parts:
        """What every answer shares, made once per settings (an Allocate is answered while the kubelet waits)."""
        common = tuple(DeviceNode(p, p) for p in ("/dev/nvidiactl", "/dev/nvidia-uvm", *self.extra_devices))
        return _Parts(
            common_devices=common,
            shared_driver=Mount(names.DRIVER_MOUNTPOINT, self.vdriver_nvidia, True),
            whole_driver=Mount(names.DRIVER_MOUNTPOINT, self.vdriver_origin, True),
            vm_dir=str(PurePosixPath(self.virtual_manager_path)),
            configs_dir=str(PurePosixPath(self.virtual_manager_path) / names.VCUDA_CONFIGS_DIR),
        )


@dataclass(frozen=True)
class _Parts:
    common_devices: tuple[DeviceNode, ...]
    shared_driver: Mount
    whole_driver: Mount
    vm_dir: str  # the virtual manager directory, normalised as a path
    configs_dir: str  # its directory of containers' own directories


def _child(directory: str, name: str) -> str:
    """``directory/name`` for an absolute, normalised directory and a name without slashes."""
    return directory + name if directory.endswith("/") else f"{directory}/{name}"


_LIB64 = f"{names.DRIVER_MOUNTPOINT}/lib64"
_LIB = f"{names.DRIVER_MOUNTPOINT}/lib"


def build_response(
    allocation: ContainerAllocation,
    gpus: Sequence[GPUInfo],
    settings: ResponseSettings,
    *,
    compat32: bool = False,
) -> ContainerResponse:
    """gpu-manager's response (§3.4), plus ``VCUDA_CONFIG_PATH`` naming the container's vcuda.config.

    ``/etc/vcuda`` is the pod's directory (its vcuda.sock, and the directories upstream's library
    registers by container ID); ``/etc/vcuda/<container>``, mounted after it, the container's own
    directory ``<vm>/configs/<pod uid>/<container>`` (its vcuda.config and pids.config): a sibling's
    directory is an empty mount point in this container's view.

    Pod UIDs and container names are safe names (no slash, never empty), so paths are joined as text.
    """
    parts = settings._parts
    by_minor = {g.minor: g for g in gpus}
    chosen = [by_minor[m] for m in allocation.minors]
    # List comprehensions, not generators: one call each rather than one per GPU and one more.
    pod, container = allocation.answered
    envs = {
        "LD_LIBRARY_PATH": _LIB if compat32 else _LIB64,
        "NVIDIA_VISIBLE_DEVICES": ",".join([g.uuid for g in chosen]),
        # The container directory of the answer (another container's name when the answer is another's).
        names.VCUDA_CONFIG_ENV: f"{names.VCUDA_MOUNTPOINT}/{container}/{names.VCUDA_CONFIG_FILE}",
    }
    devices = tuple([DeviceNode(path, path) for path in [g.device_path for g in chosen]]) + parts.common_devices
    mounts = (
        parts.shared_driver if allocation.shared else parts.whole_driver,
        Mount(names.VCUDA_MOUNTPOINT, _child(parts.vm_dir, pod), True),
        Mount(f"{names.VCUDA_MOUNTPOINT}/{container}", f"{parts.configs_dir}/{pod}/{container}", True),
    )
    annotations = {
        names.VCORE_RESOURCE: str(allocation.cores),
        names.VMEMORY_RESOURCE: str(allocation.memory),
        names.VDEVICE_ANNOTATION: ",".join(allocation.devices),
    }
    return ContainerResponse(envs=envs, mounts=mounts, devices=devices, annotations=annotations)
