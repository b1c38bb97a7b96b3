"""Per-pod directories and limit files, and the ``vcuda.VCUDAService`` on each pod's ``vcuda.sock``.

At PreStartContainer the pod's directory ``<vm>/<pod uid>`` (mounted read-only
at ``/etc/vcuda``) gets ``<container>/vcuda.config``, the file our interceptor
reads (named by ``VCUDA_CONFIG_PATH``), and the pod's ``vcuda.sock`` starts, for
the upstream vcuda-controller library, which registers with
``RegisterVDevice``; we then write ``pids.config`` and ``vcuda.config`` where it
looks: ``<container id>/`` or ``<container name>/``.

A pod's socket acts for that pod only: a request naming another pod's UID, or a
container that is not in the pod or has no allocation, is refused and logged,
and nothing is written. Directories of pods that are gone are removed.
"""

from __future__ import annotations

import logging
import shutil
import threading
from collections.abc import Callable, Iterable
from concurrent import futures
from pathlib import Path

import grpc

from gpumanager import names
from gpumanager.allocation import pods as podinfo
from gpumanager.allocation.pods import Pod, PodSpecError
from gpumanager.allocation.records import ContainerAllocation
from gpumanager.api import vcuda_pb2 as pb
from gpumanager.api import vcuda_pb2_grpc as pb_grpc
from gpumanager.vmanager import cgroups, files

log = logging.getLogger(__name__)

AllocationLookup = Callable[[str, str], ContainerAllocation | None]
PodLookup = Callable[[str], Pod | None]


class RegistrationRefused(Exception):
    """A RegisterVDevice request that is not allowed or cannot be served."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.FAILED_PRECONDITION) -> None:
        super().__init__(message)
        self.code = code


class _PodServicer(pb_grpc.VCUDAServiceServicer):  # type: ignore[misc]
    def __init__(self, manager: VirtualManager, pod_uid: str) -> None:
        self._manager = manager
        self._pod_uid = pod_uid

    def RegisterVDevice(self, request: pb.VDeviceRequest, context: grpc.ServicerContext) -> pb.VDeviceResponse:
        try:
            self._manager.register(self._pod_uid, request)
        except RegistrationRefused as exc:
            log.warning("vcuda.sock of pod %s refused %s: %s", self._pod_uid, _describe(request), exc)
            context.abort(exc.code, str(exc))
        return pb.VDeviceResponse()


def _describe(req: pb.VDeviceRequest) -> str:
    return f"RegisterVDevice(pod_uid={req.pod_uid!r}, container_name={req.container_name!r}, id={req.container_id!r})"


class VirtualManager:
    """Owns ``--virtual-manager-path``: pod directories, limit files, vcuda.sock servers."""

    def __init__(
        self,
        *,
        vm_path: Path,
        cgroup_root: Path,
        allocation: AllocationLookup,
        pod: PodLookup,
        driver_version: str,
    ) -> None:
        self.vm_path = vm_path
        self._allocation = allocation
        self._pod = pod
        self._driver = files.driver_version_fields(driver_version)
        self._lock = threading.Lock()
        self._servers: dict[str, grpc.Server] = {}
        self._executor = futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="vcuda")
        self._last_pids: dict[Path, list[int]] = {}
        self._cgroups = cgroups.CgroupLocator(cgroup_root)

    def pod_dir(self, pod_uid: str) -> Path:
        """``<vm>/<pod uid>``."""
        return self.vm_path / pod_uid

    # -- PreStartContainer ------------------------------------------------------------------------

    def prepare(self, alloc: ContainerAllocation) -> Path:
        """Write the container's vcuda.config where its answer points and serve the pod's vcuda.sock."""
        answered_pod, answered_container = alloc.answered
        directory = self.pod_dir(answered_pod)
        directory.mkdir(mode=0o755, parents=True, exist_ok=True)
        path = directory / answered_container / names.VCUDA_CONFIG_FILE
        files.write_config(path, self.config_for(alloc))
        self._serve(answered_pod)
        return path

    def config_for(self, alloc: ContainerAllocation) -> files.VcudaConfig:
        """gpu-manager's values for a container's vcuda.config."""
        pod = self._pod(alloc.pod_uid)
        limit = None
        if pod is not None:
            try:
                limit = podinfo.core_limit(pod)
            except PodSpecError as exc:
                log.warning("%s; using the hard limit", exc)
        return files.VcudaConfig(
            pod_uid=alloc.pod_uid,
            container_name=alloc.container,
            gpu_memory=alloc.memory,
            utilization=alloc.cores,
            limit=limit or 0,
            hard_limit=0 if limit is not None else 1,
            driver_major=self._driver[0],
            driver_minor=self._driver[1],
            enable=1 if alloc.cores < names.HUNDRED_CORES else 0,
        )

    def _serve(self, pod_uid: str) -> None:
        with self._lock:
            if pod_uid in self._servers:
                return
            sock = self.pod_dir(pod_uid) / names.VCUDA_SOCKET
            if len(str(sock).encode()) >= 108:
                log.warning("not serving %s: the path is too long for a unix socket", sock)
                return
            try:
                sock.unlink()
            except FileNotFoundError:
                pass
            server = grpc.server(self._executor)
            pb_grpc.add_VCUDAServiceServicer_to_server(_PodServicer(self, pod_uid), server)
            server.add_insecure_port(f"unix://{sock}")
            server.start()
            sock.chmod(0o777)  # the library in the container may run as any user
            self._servers[pod_uid] = server
        log.info("serving %s", sock)

    # -- RegisterVDevice --------------------------------------------------------------------------

    def register(self, socket_pod: str, req: pb.VDeviceRequest) -> Path:
        """Handle RegisterVDevice on pod ``socket_pod``'s socket; returns the directory written."""
        if req.pod_uid and req.pod_uid != socket_pod:
            raise RegistrationRefused(
                f"pod UID {req.pod_uid!r} is not the pod this socket serves", grpc.StatusCode.PERMISSION_DENIED
            )
        pod = self._pod(socket_pod)
        if pod is None:
            raise RegistrationRefused(f"pod {socket_pod} is not known on this node", grpc.StatusCode.NOT_FOUND)
        ids = podinfo.container_ids(pod)
        if req.container_name:
            name = _container_name(req.container_name, [c.get("name", "") for c in podinfo.containers(pod)])
            if name is None:
                raise RegistrationRefused(
                    f"container {req.container_name!r} is not in pod {podinfo.pod_key(pod)}",
                    grpc.StatusCode.PERMISSION_DENIED,
                )
            container_id = ids.get(name, "")
            subdir = name
        elif req.container_id:
            matches = [n for n, cid in ids.items() if cid == req.container_id or cid.startswith(req.container_id)]
            if len(matches) != 1:
                raise RegistrationRefused(
                    f"container ID {req.container_id!r} is not a container of pod {podinfo.pod_key(pod)}",
                    grpc.StatusCode.PERMISSION_DENIED,
                )
            name, container_id, subdir = matches[0], ids[matches[0]], req.container_id
        else:
            raise RegistrationRefused("request names no container", grpc.StatusCode.INVALID_ARGUMENT)
        alloc = self._allocation(socket_pod, name)
        if alloc is None:
            raise RegistrationRefused(f"container {name} of pod {podinfo.pod_key(pod)} has no GPU allocation")
        if not container_id:
            raise RegistrationRefused(f"container {name} of pod {podinfo.pod_key(pod)} has no container ID yet")
        qos = (pod.get("status") or {}).get("qosClass")
        pids = self._cgroups.pids(socket_pod, container_id, qos)
        if not pids:
            raise RegistrationRefused(f"empty pids: no process found in the cgroup of container {container_id}")
        directory = self.pod_dir(socket_pod) / subdir
        files.write_pids(directory / names.PIDS_CONFIG_FILE, pids)
        files.write_config(directory / names.VCUDA_CONFIG_FILE, self.config_for(alloc))
        log.info("registered pod %s container %s: %d pids", podinfo.pod_key(pod), name, len(pids))
        return directory

    # -- pids.config ------------------------------------------------------------------------------

    def refresh_pids(self, allocations: Iterable[ContainerAllocation]) -> int:
        """Rewrite ``pids.config`` of every shared container whose processes changed; returns how many.

        Written next to the container's vcuda.config (``<pod dir>/<container>/``) and in the
        directories the upstream library registered (``<pod dir>/<container id>/``).
        """
        written = 0
        for alloc in allocations:
            if not alloc.shared:
                continue
            pod = self._pod(alloc.pod_uid)
            if pod is None:
                continue
            cid = podinfo.container_ids(pod).get(alloc.container)
            if not cid:
                continue
            pids = self._cgroups.pids(alloc.pod_uid, cid, (pod.get("status") or {}).get("qosClass"))
            answered_pod, answered_container = alloc.answered
            targets = [self.pod_dir(answered_pod) / answered_container]
            registered = self.pod_dir(alloc.pod_uid) / cid
            if registered.is_dir():
                targets.append(registered)
            for directory in targets:
                path = directory / names.PIDS_CONFIG_FILE
                if self._last_pids.get(path) == pids or not directory.is_dir():
                    continue
                files.write_pids(path, pids)
                self._last_pids[path] = pids
                written += 1
        return written

    # -- cleanup ----------------------------------------------------------------------------------

    def gc(self, active: Iterable[str]) -> list[str]:
        """Remove directories (and stop sockets) of pods not in ``active``; returns their UIDs."""
        keep = set(active)
        removed: list[str] = []
        if not self.vm_path.is_dir():
            return removed
        for entry in sorted(self.vm_path.iterdir()):
            if entry.is_dir() and entry.name not in keep:
                self._stop_server(entry.name)
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry.name)
                for path in [p for p in self._last_pids if entry in p.parents]:
                    del self._last_pids[path]
                self._cgroups.forget_pod(entry.name)
        if removed:
            log.info("removed the directories of %d pods that are gone: %s", len(removed), ", ".join(removed))
        return removed

    def _stop_server(self, pod_uid: str) -> None:
        with self._lock:
            server = self._servers.pop(pod_uid, None)
        if server is not None:
            server.stop(grace=0.2)

    def serving(self) -> list[str]:
        """UIDs of pods whose vcuda.sock is served."""
        with self._lock:
            return sorted(self._servers)

    def resume(self, pod_uids: Iterable[str]) -> None:
        """Serve again the sockets of pods that have a directory (after an agent restart)."""
        for uid in pod_uids:
            if self.pod_dir(uid).is_dir():
                self._serve(uid)

    def stop(self) -> None:
        """Stop every socket server (directories stay: the containers still use them)."""
        with self._lock:
            servers = list(self._servers.values())
            self._servers.clear()
        for server in servers:
            server.stop(grace=0.2)
        self._executor.shutdown(wait=False, cancel_futures=True)


def _container_name(requested: str, known: list[str]) -> str | None:
    """Match a container name, also in docker's ``/k8s_<name>_...`` form (as upstream)."""
    if requested in known:
        return requested
    for name in known:
        if requested.startswith(f"/k8s_{name}_") or requested.startswith(f"k8s_{name}_"):
            return name
    return None
