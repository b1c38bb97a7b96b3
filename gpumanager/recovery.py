"""Rebuilding allocations from the kubelet's records when our own checkpoint is missing or corrupt.

Sources, most exact first:
1. ``kubelet_internal_checkpoint``: the ``AllocResp`` the kubelet stored for each
   container is our own Allocate answer, whose annotations name the devices
   (``tencent.com/vcuda-device``), cores and memory.
2. PodResources: the kubelet's current device IDs per container; the GPUs come
   from the pod's ``tencent.com/predicate-gpu-idx-<i>`` once we have marked it
   ``gpu-assigned=true``, else from the GPUs the vcuda-core IDs belong to.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import replace
from pathlib import Path, PurePosixPath

from gpumanager import names, safenames
from gpumanager.allocation import pods as podinfo
from gpumanager.allocation import records
from gpumanager.allocation.allocator import MIRROR_ANNOTATION, AllocationError, Allocator
from gpumanager.allocation.pods import Pod, PodSpecError
from gpumanager.allocation.records import LAYOUT_OWN, LAYOUT_POD, LAYOUT_UNKNOWN, ContainerAllocation
from gpumanager.api import deviceplugin_v1beta1_pb2 as pb
from gpumanager.device.types import GPUInfo
from gpumanager.deviceplugin.devices import DeviceLayout, UnknownDeviceError
from gpumanager.dra import quantity
from gpumanager.faults import stall_point
from gpumanager.fileio import read_regular
from gpumanager.kube import kubelet_checkpoint
from gpumanager.kube.kubelet_checkpoint import KubeletEntry
from gpumanager.kube.podresources import ContainerDevices, PodResourcesClient, PodResourcesUnavailableError
from gpumanager.retry import Backoff
from gpumanager.vmanager import files as vcuda_files

log = logging.getLogger(__name__)


def report_gpus_gone(
    allocations: Iterable[ContainerAllocation],
    gpus: Sequence[GPUInfo],
    lost: Collection[int],
) -> int:
    """Log each container that holds a GPU NVML no longer counts (``lost``: indexes) or a device node this
    node does not have; return how many lines were logged. (A container whose device node reaches another
    GPU than when it was allocated is told of by :mod:`gpumanager.deviceplugin.replaced`.)

    Their records are kept (the kubelet counts the IDs until the pod ends), but the containers cannot use
    what they were given, and only the operator can end them."""
    by_minor = {g.minor: g for g in gpus}
    logged = 0
    for alloc in sorted(allocations, key=lambda a: (a.namespace, a.pod_name, a.pod_uid, a.container)):
        who = f"pod {alloc.namespace}/{alloc.pod_name or alloc.pod_uid} container {alloc.container}"
        for minor in alloc.minors:
            gpu = by_minor.get(minor)
            if gpu is None:
                log.error(
                    "%s holds GPU minor %d, which this node does not have; delete the pod to place it again", who, minor
                )
            elif gpu.index in lost:
                log.error(
                    "%s holds GPU %d (%s), which NVML no longer counts: the container cannot use it (its device IDs "
                    "are listed Unhealthy); delete the pod to place it again",
                    who,
                    gpu.index,
                    gpu.uuid,
                )
            else:
                continue
            logged += 1
    return logged


#: How many pods one line names before it says how many more there are.
_PODS_NAMED = 20


def report_moved_vm_path(
    entries: Sequence[KubeletEntry],
    vm_path: Path,
    allocation: Callable[[str, str], ContainerAllocation | None],
) -> int:
    """Log, once per directory, the share containers we hold whose answer (the kubelet's stored AllocResp,
    used again at each start of the container) mounts ``/etc/vcuda`` from another directory than
    ``vm_path`` (--virtual-manager-path changed since they were answered); return how many there are.

    Their allocations stand, but their processes look for ``vcuda.sock`` and the limit files where this
    agent no longer serves or writes them (the upstream library ends a process whose registration finds
    no one). A whole GPU's container is not named: its driver mount holds no interceptor."""
    current = PurePosixPath(os.path.normpath(str(vm_path)))
    moved: dict[PurePosixPath, list[str]] = {}
    for e in entries:
        if e.resource != names.VCORE_RESOURCE or not e.alloc_resp:
            continue
        alloc = allocation(e.pod_uid, e.container)
        if alloc is None or alloc.cores >= 100:
            continue
        try:
            resp = pb.ContainerAllocateResponse.FromString(e.alloc_resp)
        except Exception:  # unusable answers are reported where they are read (from_kubelet_checkpoint)
            continue
        pod_dir = next((m.host_path for m in resp.mounts if m.container_path == names.VCUDA_MOUNTPOINT), "")
        if not pod_dir:
            continue
        answered = PurePosixPath(os.path.normpath(pod_dir)).parent
        if answered == current or _same_directory(Path(answered), vm_path):
            continue
        pod = f"{alloc.namespace}/{alloc.pod_name}" if alloc.pod_name else f"pod {alloc.pod_uid}"
        moved.setdefault(answered, []).append(f"{pod} container {alloc.container}")
    for answered, containers in sorted(moved.items()):
        shown = ", ".join(containers[:_PODS_NAMED])
        if len(containers) > _PODS_NAMED:
            shown += f" and {len(containers) - _PODS_NAMED} more"
        log.error(
            "%d running share containers were answered with /etc/vcuda under %s, not under "
            "--virtual-manager-path=%s: their processes look for vcuda.sock and their limit files there, where "
            "this agent does not serve or write them (a new CUDA process in them is ended at its registration); "
            "their GPU shares stay allocated. Start the agent with --virtual-manager-path=%s until these pods "
            "have ended, or delete them: %s",
            len(containers),
            answered,
            vm_path,
            answered,
            shown,
        )
    return sum(len(c) for c in moved.values())


def _same_directory(a: Path, b: Path) -> bool:
    """Whether two paths reach one directory (another spelling, a symbolic link); False when either cannot be read."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def from_kubelet_checkpoint(entries: Sequence[KubeletEntry]) -> list[ContainerAllocation]:
    """Allocations recorded in the AllocResp of vcuda-core entries."""
    out = []
    for e in entries:
        if e.resource != names.VCORE_RESOURCE or not e.alloc_resp:
            continue
        try:
            resp = pb.ContainerAllocateResponse.FromString(e.alloc_resp)
            devices = [d for d in resp.annotations.get(names.VDEVICE_ANNOTATION, "").split(",") if d]
            minors = tuple(m for d in devices if (m := records.device_minor(d)) is not None)
            # Read as Go reads them: int() alone also reads " 10 ", "1_0" and other scripts' digits.
            cores = podinfo.go_atoi(resp.annotations.get(names.VCORE_RESOURCE, "0"))
            memory = podinfo.go_atoi(resp.annotations.get(names.VMEMORY_RESOURCE, "0"))
        except Exception as exc:
            log.warning("kubelet checkpoint: pod %s container %s: unusable AllocResp: %s", e.pod_uid, e.container, exc)
            continue
        where = f"kubelet checkpoint: pod {e.pod_uid} container {e.container}"
        if cores is None or memory is None:
            log.warning(
                "%s: AllocResp says %s=%s, %s=%s: not numbers of ours; skipped",
                where,
                names.VCORE_RESOURCE,
                quantity.shown(resp.annotations.get(names.VCORE_RESOURCE)),
                names.VMEMORY_RESOURCE,
                quantity.shown(resp.annotations.get(names.VMEMORY_RESOURCE)),
            )
            continue
        if not minors or len(minors) != len(devices):
            log.warning("%s: no devices in AllocResp", where)
            continue
        if len(set(minors)) != len(minors) or memory < 0:
            log.warning(
                "%s: AllocResp names GPUs %s and %d bytes: not an answer of ours; skipped", where, devices, memory
            )
            continue
        if e.device_ids and cores != len(e.device_ids):
            # One vcuda-core ID per core, whole GPUs included: the kubelet's count is the truth.
            log.warning(
                "%s: AllocResp says %d cores for %d device IDs; counting the IDs", where, cores, len(e.device_ids)
            )
            cores = len(e.device_ids)
        if cores <= 0:
            log.warning("%s: no cores in AllocResp; skipped", where)
            continue
        out.append(
            ContainerAllocation(
                pod_uid=e.pod_uid,
                container=e.container,
                minors=minors,
                cores=cores,
                memory=memory,
                device_ids=e.device_ids,
                answered_as=_answered_as(resp, (e.pod_uid, e.container)),
                layout=_layout_of(resp),
                # The kubelet keys a static pod by its own UID, the config hash its mirror pod carries as
                # kubernetes.io/config.mirror: the pod outlives its mirror pods, as when allocated.
                mirror=e.pod_uid if safenames.is_static_pod_uid(e.pod_uid) else "",
            )
        )
    return out


def _answered_as(resp: pb.ContainerAllocateResponse, key: tuple[str, str]) -> tuple[str, str]:
    """The (pod, container) an answer was built for, from its ``/etc/vcuda`` mount and its
    ``VCUDA_CONFIG_PATH``: another container's after a swap at PreStartContainer ("", "" when its own)."""
    pod = next((PurePosixPath(m.host_path).name for m in resp.mounts if m.container_path == names.VCUDA_MOUNTPOINT), "")
    config = PurePosixPath(resp.envs.get(names.VCUDA_CONFIG_ENV, ""))
    container = config.parent.name if config.parent != PurePosixPath(names.VCUDA_MOUNTPOINT) else ""
    if not pod or not container or (pod, container) == key:
        return ("", "")
    return (pod, container)


def _layout_of(resp: pb.ContainerAllocateResponse) -> str:
    """Where the answer puts the container's limit files: its own directory when it mounts one below
    ``/etc/vcuda``; the pod's directory when it mounts that alone (an earlier version's answer)."""
    below = PurePosixPath(names.VCUDA_MOUNTPOINT)
    nested = any(below in PurePosixPath(m.container_path).parents for m in resp.mounts)
    return LAYOUT_OWN if nested else LAYOUT_POD


def from_pod_resources(
    entries: Sequence[ContainerDevices],
    *,
    find_pod: Callable[[str, str], Pod | None],
    layout: DeviceLayout,
    gpus: Sequence[GPUInfo],
) -> list[ContainerAllocation]:
    """Allocations implied by the kubelet's current device assignment and the pods' annotations."""
    minor_of = {g.index: g.minor for g in gpus}
    out = []
    for e in entries:
        if e.resource != names.VCORE_RESOURCE or not e.device_ids:
            continue
        pod = find_pod(e.namespace, e.pod)
        where = f"pod {e.namespace}/{e.pod} container {e.container}"
        if pod is None:
            log.warning("PodResources: %s is not known to the API server; skipped", where)
            continue
        try:
            # App containers, and sidecars (init containers that run beside them and keep their IDs).
            sidecars = [r for r in podinfo.init_gpu_requests(pod) if podinfo.is_sidecar(pod, r.name)]
            request = next((r for r in podinfo.gpu_requests(pod) + sidecars if r.name == e.container), None)
            predicated = podinfo.predicated_gpus(pod, request.index) if request else None
        except PodSpecError as exc:
            log.warning("PodResources: %s: %s; skipped", where, exc)
            continue
        if request is None:
            continue
        if predicated is not None and podinfo.is_assigned(pod):
            minors = tuple(predicated)
        else:
            try:
                by_gpu = layout.group_by_gpu(names.VCORE_RESOURCE, e.device_ids)
            except UnknownDeviceError as exc:
                log.warning("PodResources: %s: %s; skipped", where, exc)
                continue
            minors = tuple(minor_of[g] for g in sorted(by_gpu))
        out.append(
            ContainerAllocation(
                pod_uid=podinfo.uid(pod),
                container=e.container,
                minors=minors,
                cores=request.cores,
                memory=request.memory_bytes,
                device_ids=e.device_ids,
                namespace=e.namespace,
                pod_name=e.pod,
                container_index=request.index,
                mirror=_config_mirror(pod),
                # No answer to tell where it mounts its files: both places (never none).
                layout=LAYOUT_UNKNOWN,
            )
        )
    return out


def answered_elsewhere(vm_path: Path) -> dict[tuple[str, str], tuple[str, str]]:
    """The containers whose ``vcuda.config`` lies in another container's directory under ``vm_path`` (its own
    directory under ``configs``, or in an earlier version's answers the pod's): (pod UID, container) -> (pod
    UID, container) of the directory. PreStartContainer writes a container's file in
    the directory its answer named, which is another's after it took over an identical pod's answer; with
    both checkpoints lost, that file alone still says which directory the container mounts. Only plain
    files of this agent's user of the right size, in directories named as pods and containers are, count.

    A container can write into the directory it mounts (a writable mount), so such a file is taken only when
    nothing contradicts it: a container that two directories' files name, or whose own directory holds a
    file naming it (PreStartContainer wrote it there: it mounts its own), is left out."""
    found: dict[tuple[str, str], tuple[str, str]] = {}
    doubtful: dict[tuple[str, str], str] = {}  # named -> why its file elsewhere is not taken
    uid = os.geteuid()
    pod_dirs: list[os.DirEntry[str]] = []
    # The containers' own directories (<vm>/configs/<pod uid>/<container>), and the pods' directories, where
    # an earlier version's answers have them (<vm>/<pod uid>/<container>).
    for root in (vm_path / names.VCUDA_CONFIGS_DIR, vm_path):
        try:
            pod_dirs += [e for e in os.scandir(root) if e.is_dir(follow_symlinks=False)]
        except FileNotFoundError:
            continue
        except OSError as exc:
            log.debug("cannot list %s: %s", root, exc)
    if not pod_dirs:
        return found
    for pod_dir in pod_dirs:
        try:
            safenames.pod_uid(pod_dir.name)
        except safenames.UnsafeNameError:
            continue
        try:
            container_dirs = [e for e in os.scandir(pod_dir.path) if e.is_dir(follow_symlinks=False)]
        except OSError:
            continue
        for container_dir in container_dirs:
            try:
                safenames.container_name(container_dir.name)
            except safenames.UnsafeNameError:
                continue
            path = Path(container_dir.path) / names.VCUDA_CONFIG_FILE
            try:
                st = path.lstat()
                if not stat.S_ISREG(st.st_mode) or st.st_uid != uid or st.st_size != vcuda_files.CONFIG_SIZE:
                    continue
                config = vcuda_files.unpack(read_regular(path, vcuda_files.CONFIG_SIZE))
            except (OSError, ValueError, UnicodeDecodeError):
                continue
            here = (pod_dir.name, container_dir.name)
            named = (config.pod_uid, config.container_name)
            if not config.pod_uid or not config.container_name:
                continue
            if named == here:
                doubtful[named] = "its own directory holds one naming it"
            elif named in found:
                doubtful.setdefault(named, f"the directory of pod {here[0]} container {here[1]} holds one too")
            else:
                found[named] = here
    for named, why in doubtful.items():
        if named in found:
            log.warning(
                "%s: a vcuda.config naming pod %s container %s lies in the directory of pod %s container %s, "
                "but %s; not taken as the directory it mounts",
                vm_path,
                *named,
                *found.pop(named),
                why,
            )
    return found


def _config_mirror(pod: Pod) -> str:
    """A mirror pod's static pod (its config hash, the kubelet's UID of the static pod); '' for any other."""
    value = podinfo.pod_annotations(pod).get(MIRROR_ANNOTATION)
    return value if isinstance(value, str) else ""


class Recovery:
    """Rebuilds the allocation state at start: our checkpoint first, the kubelet's records for the rest.

    :meth:`from_disk` needs no API server: our checkpoint, then every vcuda-core entry of
    ``kubelet_internal_checkpoint`` for a container we hold nothing for (so an entry our
    checkpoint lost or cannot be trusted with comes back from the kubelet's own record of
    our answer). :meth:`from_pod_resources` runs once the pod cache can name pods: the
    kubelet's current assignments fill what is still missing. An untrusted entry that no
    kubelet record explains keeps the GPUs it names reserved whole while no kubelet record
    could be read at all, so what was lost is never handed out twice.
    """

    def __init__(
        self,
        allocator: Allocator,
        *,
        kubelet_checkpoint_path: Path,
        layout: DeviceLayout,
        gpus: Sequence[GPUInfo],
        vm_path: Path | None = None,
    ) -> None:
        self._allocator = allocator
        self._kubelet_checkpoint = kubelet_checkpoint_path
        self._vm_path = vm_path  # where containers' vcuda.config files are (--virtual-manager-path)
        self._layout = layout
        self._gpus = list(gpus)
        self._untrusted: dict[tuple[str, str], tuple[int, ...]] = {}
        self._kubelet_answered = False
        self._named: set[tuple[str, str]] = set()  # containers the kubelet's records say hold our IDs
        #: PodResources listed containers holding our IDs whose pod could not be named (the API server did
        #: not answer): any entry of ours may be one of them.
        self._unnamed_holders = False
        self.rebuilt = 0
        # The answers the kubelet's checkpoint holds, as read at start (each names the GPUs' device nodes).
        self.kubelet_answers: list[ContainerAllocation] = []
        # The (pod UID, container) the kubelet's checkpoint, read at start, lists with vcuda-core devices
        # (none when it is missing or cannot be used: the kubelet reading it knows none either).
        self.kubelet_listed: frozenset[tuple[str, str]] = frozenset()

    def from_disk(self) -> None:
        """Our checkpoint, then the kubelet checkpoint for whatever is missing."""
        allocator = self._allocator
        path = allocator.checkpoint_path
        full_rebuild = False
        stall_point("recovery")
        try:
            parsed = allocator.load()
        except AllocationError as exc:
            log.error("our checkpoint is unusable (%s); rebuilding every allocation from the kubelet's records", exc)
            parsed, full_rebuild = records.Parsed(), True
        for problem in parsed.problems:
            log.warning("checkpoint %s: cannot trust %s; rebuilding it from the kubelet's records", path, problem)
        self._untrusted = {key: parsed.salvaged.get(key, ()) for key in parsed.untrusted}
        if parsed.allocations:
            log.info("recovered %d container allocations from %s", len(parsed.allocations), path)
        try:
            entries = kubelet_checkpoint.read(self._kubelet_checkpoint)
        except kubelet_checkpoint.KubeletCheckpointError as exc:
            log.warning("cannot use %s: %s", self._kubelet_checkpoint, exc)
            entries = []
        else:
            # A missing file (a fresh node, a kubelet directory wiped) says nothing of what runs: an entry of
            # ours it lacks is not known to hold nothing until PodResources answers.
            if self._kubelet_checkpoint.exists():
                self._kubelet_answered = True
            else:
                log.info("%s does not exist; PodResources alone tells what the kubelet holds", self._kubelet_checkpoint)
        self.kubelet_listed = frozenset(
            (e.pod_uid, e.container) for e in entries if e.resource == names.VCORE_RESOURCE and e.device_ids
        )
        self._named |= self.kubelet_listed
        found = self.kubelet_answers = from_kubelet_checkpoint(entries)
        missing = [a for a in found if not allocator.holds(a.key)]
        taken = allocator.adopt(missing, source=str(self._kubelet_checkpoint), kubelet_holds=True)
        self.rebuilt += taken
        self._settle_untrusted()
        if self._vm_path is not None:
            report_moved_vm_path(entries, self._vm_path, allocator.get)
        if taken or full_rebuild or self._untrusted:
            log.info(
                "rebuilt %d container allocations from the kubelet (its checkpoint names %d)", self.rebuilt, len(found)
            )

    def from_pod_resources(self, client: PodResourcesClient, find_pod: Callable[[str, str], Pod | None]) -> bool:
        """The kubelet's current assignments, for containers still missing (needs pod names resolved);
        whether that settled it: the kubelet answered and every pod it names holding our IDs could be named
        by the API server (False: ask it again, :meth:`retry_pod_resources`)."""
        try:
            entries = client.list_all()
        except PodResourcesUnavailableError as exc:
            log.warning(
                "the kubelet's PodResources did not answer for recovery (%s); asking again in the background", exc
            )
            self._take_pod_resources([], find_pod)
            return False
        self._kubelet_answered = True
        unnamed = self._take_pod_resources(entries, find_pod)
        if unnamed:
            log.warning(
                "PodResources lists %d containers holding vcuda-core IDs whose pods the API server cannot name "
                "yet; asking again in the background",
                unnamed,
            )
        return not unnamed

    def retry_pod_resources(
        self,
        client: PodResourcesClient,
        find_pod: Callable[[str, str], Pod | None],
        stop: threading.Event,
        backoff: Backoff | None = None,
    ) -> bool:
        """Ask the kubelet's PodResources again, with backoff, until it answers and every pod it names holding
        our IDs can be named, or ``stop`` is set; what it names that we hold nothing for is then taken over
        (a kubelet restarting as the agent started, or an API server not answering then, must not leave a
        running container's GPUs free to be handed out). Whether it settled."""
        backoff = backoff or Backoff()
        while not backoff.wait(stop):
            try:
                entries = client.list_all()
            except PodResourcesUnavailableError as exc:
                log.debug("PodResources still unavailable for recovery (attempt %d): %s", backoff.failures, exc)
                continue
            self._kubelet_answered = True
            unnamed = self._take_pod_resources(entries, find_pod)
            if unnamed:
                log.debug("PodResources: %d pods still not named (attempt %d)", unnamed, backoff.failures)
                continue
            log.info("the kubelet's PodResources answered for recovery after %d attempts", backoff.failures)
            return True
        return False

    def _take_pod_resources(
        self, entries: Sequence[ContainerDevices], find_pod: Callable[[str, str], Pod | None]
    ) -> int:
        """Take what ``entries`` name that we hold nothing for; returns how many of the containers holding
        our IDs belong to pods that could not be named."""
        wanted = [e for e in entries if e.resource == names.VCORE_RESOURCE and e.device_ids]
        unnamed = 0
        pods: dict[tuple[str, str], Pod | None] = {}  # each pod looked up once (a miss asks the API server)
        for e in wanted:
            if (e.namespace, e.pod) not in pods:
                pods[(e.namespace, e.pod)] = find_pod(e.namespace, e.pod)
            pod = pods[(e.namespace, e.pod)]
            if pod is not None:
                self._named.add((podinfo.uid(pod), e.container))
            else:
                self._unnamed_holders = True
                unnamed += 1
        found = (
            from_pod_resources(
                wanted, find_pod=lambda ns, name: pods.get((ns, name)), layout=self._layout, gpus=self._gpus
            )
            if wanted
            else []
        )
        # A static pod rebuilt from the kubelet's checkpoint is held under the kubelet's UID of it, which
        # its mirror pod, the one PodResources' names give, carries as its config hash.
        missing = [
            a
            for a in found
            if not self._allocator.holds(a.key) and not (a.mirror and self._allocator.holds((a.mirror, a.container)))
        ]
        if missing and self._vm_path is not None:
            running = {a.pod_uid for a in found} | {a.mirror for a in found if a.mirror}
            missing = self._with_directories(missing, self._vm_path, running=running, all_named=not unnamed)
        taken = self._allocator.adopt(missing, source="PodResources", kubelet_holds=True, answered=False)
        self.rebuilt += taken
        if taken:
            log.info("rebuilt %d container allocations from PodResources", taken)
        self._settle_untrusted(final=True)
        return unnamed

    def _with_directories(
        self, missing: list[ContainerAllocation], vm_path: Path, *, running: Collection[str], all_named: bool
    ) -> list[ContainerAllocation]:
        """``missing`` (rebuilt from PodResources, which has no answer), each answered with the directory its
        ``vcuda.config`` lies in when that is another's (:func:`answered_elsewhere`) and free: no pod the
        kubelet lists (``running``: their UIDs) or the cache knows of that UID, nothing held or answered with
        it. Not when some pod the kubelet lists could not be named (``all_named`` False): its directory may
        be that one (the cache, not synced yet or without the API server, cannot tell)."""
        elsewhere = answered_elsewhere(vm_path)
        if not elsewhere:
            return missing
        if not all_named:
            moved = [a for a in missing if a.key in elsewhere]
            if moved:
                log.warning(
                    "PodResources: %d containers' vcuda.config lie in other directories (pod %s container %s in "
                    "the directory of pod %s container %s first), but some pods the kubelet lists could not be "
                    "named (theirs may be those directories); answered with their own",
                    len(moved),
                    *moved[0].key,
                    *elsewhere[moved[0].key],
                )
            return missing
        out = []
        used: set[tuple[str, str]] = set()
        for alloc in missing:
            directory = elsewhere.get(alloc.key)
            if (
                directory is not None
                and directory not in used
                and directory[0] not in running
                and self._allocator.directory_free(directory)
            ):
                used.add(directory)
                log.info(
                    "PodResources: pod %s container %s, whose vcuda.config is in the directory of pod %s "
                    "container %s (the answer it took over), is answered with that directory",
                    *alloc.key,
                    *directory,
                )
                alloc = replace(alloc, answered_as=directory)
            out.append(alloc)
        return out

    def _settle_untrusted(self, *, final: bool = False) -> None:
        for key in [k for k in self._untrusted if self._allocator.holds(k)]:
            del self._untrusted[key]
        if not final or not self._untrusted:
            return
        for (pod_uid, container), minors in sorted(self._untrusted.items()):
            if self._kubelet_answered and not self._unnamed_holders and (pod_uid, container) not in self._named:
                log.warning(
                    "checkpoint entry of pod %s container %s is not in the kubelet's records: the kubelet holds "
                    "no devices for it, so it holds no GPU",
                    pod_uid,
                    container or "(all)",
                )
                continue
            if not minors or not container:
                log.error(
                    "checkpoint entry of pod %s container %s cannot be rebuilt (no usable kubelet record, no GPU "
                    "named)",
                    pod_uid,
                    container or "(all)",
                )
                continue
            reserve = ContainerAllocation(
                pod_uid=pod_uid, container=container, minors=minors, cores=names.HUNDRED_CORES * len(minors), memory=0
            )
            if self._allocator.adopt([reserve], source="unreadable checkpoint entry"):
                log.error(
                    "checkpoint entry of pod %s container %s cannot be rebuilt (no usable kubelet record): "
                    "GPU(s) %s stay reserved whole until the pod ends",
                    pod_uid,
                    container,
                    list(minors),
                )
        self._untrusted.clear()
