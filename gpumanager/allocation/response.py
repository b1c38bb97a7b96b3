"""The container's Allocate answer, in gpu-manager's exact shape, as plain data (no gRPC types here)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

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


def build_response(
    allocation: ContainerAllocation,
    gpus: Sequence[GPUInfo],
    settings: ResponseSettings,
    *,
    compat32: bool = False,
) -> ContainerResponse:
    """gpu-manager's response (§3.4), plus ``VCUDA_CONFIG_PATH`` naming the container's vcuda.config."""
    by_minor = {g.minor: g for g in gpus}
    chosen = [by_minor[m] for m in allocation.minors]
    envs = {
        "LD_LIBRARY_PATH": f"{names.DRIVER_MOUNTPOINT}/lib" if compat32 else f"{names.DRIVER_MOUNTPOINT}/lib64",
        "NVIDIA_VISIBLE_DEVICES": ",".join(g.uuid for g in chosen),
        names.VCUDA_CONFIG_ENV: str(Path(names.VCUDA_MOUNTPOINT) / allocation.container / names.VCUDA_CONFIG_FILE),
    }
    devices = [DeviceNode(g.device_path, g.device_path) for g in chosen]
    devices += [DeviceNode(p, p) for p in ("/dev/nvidiactl", "/dev/nvidia-uvm", *settings.extra_devices)]
    driver = settings.vdriver_nvidia if allocation.shared else settings.vdriver_origin
    mounts = (
        Mount(names.DRIVER_MOUNTPOINT, driver, True),
        Mount(names.VCUDA_MOUNTPOINT, str(Path(settings.virtual_manager_path) / allocation.answered[0]), True),
    )
    annotations = {
        names.VCORE_RESOURCE: str(allocation.cores),
        names.VMEMORY_RESOURCE: str(allocation.memory),
        names.VDEVICE_ANNOTATION: ",".join(allocation.devices),
    }
    return ContainerResponse(envs=envs, mounts=mounts, devices=tuple(devices), annotations=annotations)
