"""A GPU node as tkestack gpu-manager 1.1 leaves it, with GPU pods running: for in-place upgrade tests.

What the old agent leaves (``reference/gpu-manager.md`` sections 3 to 5 and 7):

- its device plugin's allocations in the kubelet (``kubelet_internal_checkpoint``, PodResources),
  made with upstream's device IDs and Allocate answers: ``NVIDIA_VISIBLE_DEVICES``,
  ``LD_LIBRARY_PATH``, ``/dev/nvidia*``, ``vdriver/nvidia`` (shares) or ``vdriver/origin``
  (whole GPUs) mounted at ``/usr/local/nvidia``, ``<vm>/<pod uid>`` at ``/etc/vcuda``, and the
  ``tencent.com/vcuda-*`` annotations; no ``VCUDA_CONFIG_PATH``;
- ``gpumanager_internal_checkpoint`` with upstream's fields only;
- ``vdriver/nvidia`` and ``vdriver/origin`` as plain directories (its mirror), which running
  containers bind-mount; ``vdriver/nvidia/bin/gpu-client`` is its registration client;
- per pod ``<vm>/<pod uid>/`` (mode 0777) with ``vcuda.sock`` (a socket nobody listens on once
  the old agent is gone) and, for each container whose library registered,
  ``<container id>/vcuda.config`` and ``pids.config``.

:class:`OldAgent` plays the old agent's device plugin against the kubelet simulator;
:func:`legacy_vdriver` lays out its mirror; :class:`ContainerProcess` is a process of a running
container: it holds the directory mounted at ``/usr/local/nvidia`` (as its bind mount does) and
maps the library it loaded from it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from gpumanager import names
from gpumanager.api import deviceplugin_v1beta1_pb2 as pb
from gpumanager.api import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from gpumanager.vmanager import files
from simnode.gpusim_state import NodeSpec

log = logging.getLogger(__name__)

BLOCK = names.MEMORY_BLOCK_BYTES


@dataclass(frozen=True)
class OldAllocation:
    """What the old agent decided for one container."""

    pod_uid: str
    container: str
    minors: tuple[int, ...]
    cores: int
    memory: int  # bytes

    def checkpoint_entry(self) -> dict[str, Any]:
        """Upstream's checkpoint entry: Devices, Cores, Memory and nothing else."""
        return {"Devices": [f"/dev/nvidia{m}" for m in self.minors], "Cores": self.cores, "Memory": self.memory}


class _Plugin(pb_grpc.DevicePluginServicer):  # type: ignore[misc]
    def __init__(self, agent: OldAgent, resource: str) -> None:
        self._agent = agent
        self._resource = resource

    def GetDevicePluginOptions(self, request: Any, context: Any) -> Any:
        return pb.DevicePluginOptions(pre_start_required=self._resource == names.VCORE_RESOURCE)

    def ListAndWatch(self, request: Any, context: Any) -> Iterator[Any]:
        # Upstream sends the list once, then sleeps forever.
        yield pb.ListAndWatchResponse(devices=self._agent.devices(self._resource))
        while context.is_active() and not self._agent.stopped.is_set():
            time.sleep(0.05)

    def Allocate(self, request: Any, context: Any) -> Any:
        if self._resource != names.VCORE_RESOURCE:
            return pb.AllocateResponse(container_responses=[pb.ContainerAllocateResponse()])
        return pb.AllocateResponse(container_responses=[self._agent.answer()])

    def PreStartContainer(self, request: Any, context: Any) -> Any:
        if self._resource == names.VCORE_RESOURCE:
            self._agent.pre_start(list(request.devices_ids))
        return pb.PreStartContainerResponse()


class OldAgent:
    """tkestack gpu-manager 1.1's device plugin, as the kubelet and the node's files see it.

    Allocations are planned with :meth:`place` (upstream guesses the pod from the request's
    size; the test says which pod comes next) and answered in that order.
    """

    def __init__(
        self,
        spec: NodeSpec,
        *,
        plugin_dir: Path,
        vm_path: Path,
        vdriver_base: Path,
        checkpoint_dir: Path,
    ) -> None:
        self.spec = spec
        self.plugin_dir = plugin_dir
        self.vm_path = vm_path
        self.vdriver_base = vdriver_base
        self.checkpoint = checkpoint_dir / names.OWN_CHECKPOINT
        self.stopped = threading.Event()
        self.allocations: list[OldAllocation] = []
        self._plan: deque[OldAllocation] = deque()
        self._answered: dict[tuple[str, ...], OldAllocation] = {}
        self._servers: list[grpc.Server] = []
        self._vcuda_socks: dict[str, socket.socket] = {}
        self._lock = threading.Lock()

    # -- what upstream advertises and answers --------------------------------------------------

    def devices(self, resource: str) -> list[Any]:
        """Upstream's fake devices: cores 0..100*GPUs-1, memory blocks of the sum of all GPUs."""
        if resource == names.VCORE_RESOURCE:
            count = 100 * len(self.spec.gpus)
        else:
            count = sum(g.memory_mib for g in self.spec.gpus) * (1 << 20) // BLOCK
        return [
            pb.Device(
                ID=f"{resource}-{i}" if resource == names.VCORE_RESOURCE else f"{resource}-{BLOCK}-{i}",
                health="Healthy",
            )
            for i in range(count)
        ]

    def place(self, pod_uid: str, container: str, minors: Sequence[int], cores: int, blocks: int) -> None:
        """The next vcuda-core Allocate is for this container, on these GPUs."""
        with self._lock:
            self._plan.append(OldAllocation(pod_uid, container, tuple(minors), cores, blocks * BLOCK))

    def answer(self) -> Any:
        """Upstream's ContainerAllocateResponse for the next planned container; checkpointed first."""
        with self._lock:
            alloc = self._plan.popleft()
            self.allocations.append(alloc)
            self._write_checkpoint()
        uuids = {g.minor: g.uuid for g in self.spec.gpus}
        share = alloc.cores < names.HUNDRED_CORES
        devices = [
            pb.DeviceSpec(container_path=f"/dev/nvidia{m}", host_path=f"/dev/nvidia{m}", permissions="rwm")
            for m in alloc.minors
        ]
        devices += [
            pb.DeviceSpec(container_path=d, host_path=d, permissions="rwm")
            for d in ("/dev/nvidiactl", "/dev/nvidia-uvm")
        ]
        return pb.ContainerAllocateResponse(
            envs={
                "LD_LIBRARY_PATH": "/usr/local/nvidia/lib64",
                "NVIDIA_VISIBLE_DEVICES": ",".join(uuids[m] for m in alloc.minors),
            },
            devices=devices,
            mounts=[
                pb.Mount(
                    container_path="/usr/local/nvidia",
                    host_path=str(self.vdriver_base / ("nvidia" if share else "origin")),
                    read_only=True,
                ),
                pb.Mount(container_path="/etc/vcuda", host_path=str(self.vm_path / alloc.pod_uid), read_only=True),
            ],
            annotations={
                names.VCORE_RESOURCE: str(alloc.cores),
                names.VMEMORY_RESOURCE: str(alloc.memory),
                names.VDEVICE_ANNOTATION: ",".join(f"/dev/nvidia{m}" for m in alloc.minors),
            },
        )

    def pre_start(self, device_ids: list[str]) -> None:
        """Upstream's PreStart: the pod's directory (0777) and its vcuda.sock server."""
        with self._lock:
            uids = [a.pod_uid for a in self.allocations]
        for uid in uids:
            with self._lock:
                if uid in self._vcuda_socks:
                    continue
                directory = self.vm_path / uid
                directory.mkdir(parents=True, exist_ok=True)
                os.chmod(directory, 0o777)
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.bind(str(directory / names.VCUDA_SOCKET))
                os.chmod(directory / names.VCUDA_SOCKET, 0o777)
                sock.listen(4)
                self._vcuda_socks[uid] = sock

    def _write_checkpoint(self) -> None:
        mapping: dict[str, dict[str, Any]] = {}
        for a in self.allocations:
            mapping.setdefault(a.pod_uid, {})[a.container] = a.checkpoint_entry()
        self.checkpoint.parent.mkdir(parents=True, exist_ok=True)
        self.checkpoint.write_text(json.dumps({"PodGPUMapping": mapping}))

    # -- what upstream's library left after registering --------------------------------------------

    def registered(self, alloc: OldAllocation, container_id: str, pids: Sequence[int], *, driver: str) -> Path:
        """``<vm>/<pod uid>/<container id>/{vcuda.config,pids.config}`` as after a registration."""
        major = driver.split(".", 1)[0]
        directory = self.vm_path / alloc.pod_uid / container_id
        directory.mkdir(parents=True, exist_ok=True)
        os.chmod(directory, 0o777)
        config = files.VcudaConfig(
            pod_uid=alloc.pod_uid,
            container_name=alloc.container,
            gpu_memory=alloc.memory,
            utilization=alloc.cores,
            driver_major=int(major),
            driver_minor=0,  # upstream's quirk for three-part versions
            enable=1 if alloc.cores < names.HUNDRED_CORES else 0,
        )
        (directory / names.VCUDA_CONFIG_FILE).write_bytes(files.pack(config))
        files.write_pids(directory / names.PIDS_CONFIG_FILE, pids)
        return directory

    # -- lifecycle ---------------------------------------------------------------------------------

    def start(self, kubelet_socket: Path) -> None:
        """Serve vcore.sock and vmemory.sock and register both with the kubelet."""
        for resource, endpoint in (
            (names.VCORE_RESOURCE, names.VCORE_SOCKET),
            (names.VMEMORY_RESOURCE, names.VMEMORY_SOCKET),
        ):
            path = self.plugin_dir / endpoint
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
            pb_grpc.add_DevicePluginServicer_to_server(_Plugin(self, resource), server)
            server.add_insecure_port(f"unix://{path}")
            server.start()
            self._servers.append(server)
            with grpc.insecure_channel(f"unix://{kubelet_socket}") as channel:
                pb_grpc.RegistrationStub(channel).Register(
                    pb.RegisterRequest(
                        version="v1beta1",
                        endpoint=endpoint,
                        resource_name=resource,
                        options=pb.DevicePluginOptions(pre_start_required=True),
                    ),
                    timeout=15,
                )

    def stop(self) -> None:
        """The old agent's pod is deleted: its servers go; its vcuda.sock files stay, dead."""
        self.stopped.set()
        for server in self._servers:
            server.stop(grace=None).wait()
        self._servers.clear()
        with self._lock:
            socks = list(self._vcuda_socks.values())
            self._vcuda_socks.clear()
        for sock in socks:
            sock.close()


def legacy_vdriver(
    base: Path, *, driver_files: Mapping[str, Path], interceptor: Path, gpu_client: Path, driver: str
) -> None:
    """The old agent's mirror: ``<base>/nvidia`` and ``<base>/origin`` as plain directories.

    ``driver_files``: lib64 file name -> the driver's file (copied); ``libcuda.so.1`` and
    ``libnvidia-ml.so.1`` are the old interceptor in ``nvidia`` and soname links in ``origin``.
    """
    for volume in ("nvidia", "origin"):
        lib64 = base / volume / "lib64"
        bin_dir = base / volume / "bin"
        lib64.mkdir(parents=True, exist_ok=True)
        bin_dir.mkdir(parents=True, exist_ok=True)
        for name, source in driver_files.items():
            shutil.copy2(source, lib64 / name)
        for soname in ("libcuda.so.1", "libnvidia-ml.so.1"):
            real = f"{soname[:-2]}.{driver}"
            if volume == "nvidia":
                shutil.copy2(interceptor, lib64 / soname)
            else:
                (lib64 / soname).symlink_to(real)
        if volume == "nvidia":
            shutil.copy2(interceptor, lib64 / "libcuda-control.so")
            shutil.copy2(gpu_client, bin_dir / "gpu-client")


_HOLDER = r"""
import mmap, os, sys, time
os.chdir(sys.argv[1])
with open(os.path.join(sys.argv[1], sys.argv[2]), "rb") as f:
    mapped = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
print("ready", flush=True)
sys.stdin.read()
"""


class ContainerProcess:
    """A process of a running container: it holds the directory mounted at /usr/local/nvidia (its
    working directory, as a bind mount holds it wherever it is moved) and maps ``lib`` from it."""

    def __init__(self, mount_source: Path, lib: str = "lib64/libcuda.so.1") -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _HOLDER, str(mount_source), lib],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "ready":
            self.end()
            raise RuntimeError(f"container process on {mount_source} did not start")

    @property
    def pid(self) -> int:
        """Its PID."""
        return self.proc.pid

    @property
    def mount(self) -> Path:
        """The directory it holds, wherever it is now (``/proc/<pid>/cwd``)."""
        return Path(f"/proc/{self.pid}/cwd")

    def end(self) -> None:
        """The container stops."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
