"""Per-pod directories and limit files, and the ``vcuda.VCUDAService`` on each pod's ``vcuda.sock``.

Each container of a pod mounts the pod's directory ``<vm>/<pod uid>`` read-only at
``/etc/vcuda`` (its ``vcuda.sock``), and its own directory
``<vm>/configs/<pod uid>/<container>`` read-only at ``/etc/vcuda/<container>``
(both made at PreStartContainer, before the runtime creates the container); the
pod's directory keeps an empty ``<container>`` directory as its mount point, so a
container sees its own limit files alone, never a sibling's. At
PreStartContainer the container's directory gets ``vcuda.config``, the file our
interceptor reads (named by ``VCUDA_CONFIG_PATH``), and the pod's ``vcuda.sock``
is served (all pods' sockets by one server, :mod:`gpumanager.vmanager.sockets`),
for the upstream vcuda-controller library, which registers with
``RegisterVDevice`` through ``gpu-client``; we then write ``pids.config`` (and
``vcuda.config`` if it is missing) where it looks: ``<pod dir>/<container id>/``
or the container's directory (``/etc/vcuda/<container name>``).

A container answered by an earlier version (its answer, which the kubelet keeps
and never asks again, mounts the pod's directory alone) reads its files in
``<pod dir>/<container>/``, whether or not that version wrote one there before the
upgrade: its record says so (``layout``, kept in the checkpoint; a record rebuilt
without its answer gets its files in both places) (:meth:`VirtualManager.container_dirs`).

A process may register before the kubelet's status update, which names its
container ID, reaches us. Such a container is recognised by its cgroup below
the pod's when that leaves one candidate; otherwise the call waits (bounded by
the caller's deadline and :data:`REGISTER_WAIT_SECONDS`) for the pod's status.

A pod's socket acts for that pod, and for a container of another pod whose
PreStartContainer was answered with this pod's directory (two identical pods'
answers swapped: that container mounts this directory and its socket). The
files go into the socket's pod directory, the one the container mounts. A
request naming any other pod's UID, or a container that is not in the pod or
has no allocation, is refused and logged, and nothing is written. Directories
of pods that are gone are removed.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc

from gpumanager import names, safenames
from gpumanager.allocation import pods as podinfo
from gpumanager.allocation.pods import Pod, PodSpecError
from gpumanager.allocation.records import LAYOUT_OWN, LAYOUT_POD, ContainerAllocation
from gpumanager.api import vcuda_pb2 as pb
from gpumanager.deviceplugin.dirlock import DirectoryLock
from gpumanager.vmanager import cgroups, files, restarts
from gpumanager.vmanager.sockets import CallRefused, PodSockets
from gpumanager.vmanager.unwritable import UnwritableFiles

log = logging.getLogger(__name__)

AllocationLookup = Callable[[str, str], ContainerAllocation | None]
PodLookup = Callable[[str], Pod | None]

#: The longest RegisterVDevice waits for the pod's status to name the caller's container.
REGISTER_WAIT_SECONDS = 20.0
#: How often a waiting registration looks again (the pod cache; the cgroups at most once a second).
_WAIT_POLL_SECONDS = 0.05
_CGROUP_POLL_SECONDS = 1.0
#: Time kept back from the caller's deadline to send the answer.
_DEADLINE_MARGIN_SECONDS = 0.5
# A container ID as the runtimes write it (hex, 64 characters for containerd and docker); it becomes a directory.
_CONTAINER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
#: The shortest prefix of a container ID taken for it (docker's short IDs).
_SHORT_ID = 12
#: At most this many IDs of gone cgroups are remembered for registrations by name (then forgotten at once).
_GONE_IDS_LIMIT = 4096
#: The longest field of a request accepted (a pod UID is 36 bytes, a container ID 64, a name 63).
MAX_FIELD_BYTES = 256
#: Refusals logged per pod socket in each :data:`REFUSAL_LOG_WINDOW_SECONDS`; the rest are counted.
REFUSAL_LOGS_PER_WINDOW = 5
REFUSAL_LOG_WINDOW_SECONDS = 60.0
#: Registrations logged per pod socket in each :data:`REFUSAL_LOG_WINDOW_SECONDS` (a process registers at
#: each start; a container calling in a loop must not fill the log); the rest are counted.
REGISTRATION_LOGS_PER_WINDOW = 10
#: Characters of a request's value shown in a log line or a refusal.
_SHOWN = 64


class RegistrationRefused(CallRefused):
    """A RegisterVDevice request that is not allowed or cannot be served."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.FAILED_PRECONDITION) -> None:
        super().__init__(message, code)


class _NotYet(RegistrationRefused):
    """A refusal that may turn into an answer once the pod's status or our pod cache catches up."""


@dataclass(frozen=True)
class _Target:
    pod_uid: str
    pod: Pod
    name: str
    container_id: str
    subdir: str  # below the directory the container mounts: its answer's container, or the ID it gave
    alloc: ContainerAllocation
    by_id: bool = False  # registered by its ID (or a prefix): the directory goes once the container does


def _short(value: str) -> str:
    """``repr(value)``, cut short (a request's value is the caller's: it may be long)."""
    if len(value) <= _SHOWN:
        return repr(value)
    return f"{value[:_SHOWN]!r}... ({len(value.encode())} bytes)"


def _describe(req: pb.VDeviceRequest) -> str:
    return (
        f"RegisterVDevice(pod_uid={_short(req.pod_uid)}, container_name={_short(req.container_name)}, "
        f"id={_short(req.container_id)})"
    )


class _RefusalLog:
    """At most ``per_window`` lines (refusals, registrations) logged per pod socket in each window; those
    left out are counted and the count logged with the next one (a container calling in a loop must not
    fill the log)."""

    def __init__(self, per_window: int, window: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._per_window = per_window
        self._window = window
        self._clock = clock
        self._lock = threading.Lock()
        self._pods: dict[str, list[float]] = {}  # pod UID -> [window start, logged, left out]

    def admit(self, pod_uid: str) -> int | None:
        """None: leave this refusal out of the log; else how many were left out before it."""
        now = self._clock()
        with self._lock:
            entry = self._pods.get(pod_uid)
            if entry is None or now - entry[0] >= self._window:
                if entry is None and len(self._pods) >= 4096:
                    self._pods.clear()
                left_out = int(entry[2]) if entry is not None else 0
                self._pods[pod_uid] = [now, 1, 0]
                return left_out
            if entry[1] < self._per_window:
                entry[1] += 1
                left_out, entry[2] = int(entry[2]), 0
                return left_out
            entry[2] += 1
            return None

    def forget(self, pod_uid: str) -> None:
        with self._lock:
            self._pods.pop(pod_uid, None)


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
        dir_lock: DirectoryLock | None = None,
    ) -> None:
        """``dir_lock``: the agent's lock on ``vm_path`` (moved with the directory when it is made again):
        while another agent holds the directory there, nothing is written or removed in it."""
        self.vm_path = vm_path
        self._dir_lock = dir_lock
        self._allocation = allocation
        self._pod = pod
        self._driver = files.driver_version_fields(driver_version)
        self._lock = threading.Lock()
        self._sockets: PodSockets | None = None  # started with the first pod socket
        self._last_pids: dict[Path, list[int]] = {}
        # (pod UID, container ID) -> the PIDs last written to all of its pids.config files.
        self._current: dict[tuple[str, str], list[int]] = {}
        # (pod UID, container ID) of the last refresh -> the pids.config a registration of it writes.
        # (pod UID, container ID) -> (pod directory, directory name) of its registered pids.config
        self._swept_ids: dict[tuple[str, str], tuple[str, str]] = {}
        # (pod UID, container) -> the pids.config its last registration wrote (by container ID).
        self._registered: dict[tuple[str, str], Path] = {}
        # (pod UID, container) -> (the pod object its ID was read from, the ID).
        self._ids_of: dict[tuple[str, str], tuple[Pod, str]] = {}
        # <pod dir>/<container id> made by a registration -> (the registering pod's UID, the full ID).
        self._id_dirs: dict[Path, tuple[str, str]] = {}
        self._registrations = 0  # RegisterVDevice calls that wrote a pids.config
        # Of the last refresh: pod directory -> pods whose containers were answered with it, and
        # pids.config -> the (pod UID, container ID) whose PIDs the refresh writes there.
        self._answered_by: dict[str, set[str]] = {}
        self._writers: dict[tuple[str, str], set[tuple[str, str]]] = {}
        self._pids_lock = threading.Lock()  # a registration's write against the refresh's memo
        self._cgroups = cgroups.CgroupLocator(cgroup_root)
        self._prepare_listeners: list[Callable[[], None]] = []
        self._refusals = _RefusalLog(REFUSAL_LOGS_PER_WINDOW, REFUSAL_LOG_WINDOW_SECONDS)
        self._registrations_log = _RefusalLog(REGISTRATION_LOGS_PER_WINDOW, REFUSAL_LOG_WINDOW_SECONDS)
        self._unwritable = UnwritableFiles()  # pids.config files the refresh cannot write (reported)
        # Pods that are gone whose directory could not be removed (reported once each).
        self._unremovable: set[str] = set()
        # (answered pod UID, container) -> its own directory under configs/, once seen (it stays so).
        self._own_dirs: dict[tuple[str, str], Path] = {}
        # (pod UID, container ID) a status names whose cgroup a registration by name found gone.
        self._gone_ids: dict[tuple[str, str], None] = {}

    def pod_dir(self, pod_uid: str) -> Path:
        """``<vm>/<pod uid>``."""
        return self.vm_path / pod_uid

    @property
    def configs_path(self) -> Path:
        """``<vm>/configs``: the containers' own directories, by pod UID and container."""
        return self.vm_path / names.VCUDA_CONFIGS_DIR

    def own_dir(self, pod_uid: str, container: str) -> Path:
        """``<vm>/configs/<pod uid>/<container>``, which an answer for (pod, container) mounts at
        ``/etc/vcuda/<container>`` (ValueError for an unsafe name)."""
        return safenames.child(self.configs_path, safenames.pod_uid(pod_uid), safenames.container_name(container))

    def container_dir(self, answered: tuple[str, str]) -> Path:
        """Where the container answered as ``answered`` (pod UID, container) reads its limit files: its own
        directory, which its answer mounts at ``/etc/vcuda/<container>``; but ``<pod dir>/<container>``
        for an answer of an earlier version (or of upstream's agent), which mounts the pod's directory
        alone: there is no own directory then, and that version left the container's vcuda.config or its
        spare in the pod's directory (this version never writes a file there). ValueError for an unsafe
        name."""
        known = self._own_dirs.get(answered)
        if known is not None:
            return known
        own = self.own_dir(*answered)
        earlier = safenames.child(self.pod_dir(answered[0]), answered[1])
        found = own
        if not own.is_dir() and any(
            os.path.lexists(earlier / name)
            for name in (names.VCUDA_CONFIG_FILE, files.spare_path(Path(names.VCUDA_CONFIG_FILE)).name)
        ):
            found = earlier
        self._own_dirs[answered] = found
        return found

    def container_dirs(self, alloc: ContainerAllocation) -> list[Path]:
        """Where the container of ``alloc`` reads its limit files, by the layout its record keeps of the
        answer the runtime got: its own directory (:meth:`container_dir`) for this version's answer;
        ``<pod dir>/<container>`` for an earlier version's (it mounts the pod's directory alone), whether or
        not that version wrote a file there; both when not known (a record rebuilt without the answer): a
        container must never find no limits. ValueError for an unsafe name."""
        if alloc.layout == LAYOUT_OWN:
            return [self.container_dir(alloc.answered)]
        pod, container = alloc.answered
        earlier = safenames.child(self.pod_dir(safenames.pod_uid(pod)), safenames.container_name(container))
        if alloc.layout == LAYOUT_POD:
            return [earlier]
        return [self.own_dir(pod, container), earlier]

    def add_prepare_listener(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` after each container is prepared (its files written), and after each
        registration by a container ID (a directory that :meth:`refresh_pids` removes once the
        container has ended)."""
        self._prepare_listeners.append(listener)

    def has_registered_ids(self) -> bool:
        """Whether directories of registrations by container ID are kept (see :meth:`refresh_pids`)."""
        return bool(self._id_dirs)

    # -- PreStartContainer ------------------------------------------------------------------------

    def _owns_directory(self, *, make: bool = False) -> bool:
        """Whether this agent holds the lock of the directory at ``vm_path`` (moved there when it was made
        again; ``make``: made first when missing, locked before anything is written in it)."""
        lock = self._dir_lock
        if lock is None:
            return True
        return lock.make_and_follow(0o755) if make else lock.follow()

    def _check_owned(self) -> None:
        """OSError (the kubelet tries the start again) while another agent holds the directory."""
        if not self._owns_directory(make=True):
            raise OSError(
                errno.EBUSY,
                f"another gpu-manager holds the lock of --virtual-manager-path={self.vm_path} (made again since "
                "this agent locked it); not writing there while it holds it",
            )

    def prepare(self, alloc: ContainerAllocation) -> Path:
        """Write the container's vcuda.config where its answer points and serve the pod's vcuda.sock."""
        self._check_owned()
        answered_pod, answered_container = alloc.answered
        # The allocator refuses unsafe names already; nothing is ever written outside the pod's directories.
        directory = safenames.child(self.vm_path, safenames.pod_uid(answered_pod))
        files.make_open_dirs(directory)
        targets = self.container_dirs(alloc)
        # Its mount point in the pod's directory (mounted read-only before its own directory: the runtime
        # cannot make it), left empty when the container's files are in its own directory, mounted there.
        files.make_open_dirs(safenames.child(directory, safenames.container_name(answered_container)))
        config = self.config_for(alloc)
        for own in targets:
            files.make_open_dirs(own)
            files.write_config(own / names.VCUDA_CONFIG_FILE, config)
        path = targets[0] / names.VCUDA_CONFIG_FILE
        self._serve(answered_pod)
        for listener in self._prepare_listeners:
            listener()
        return path

    def prepare_ahead(self, pod_uid: str, containers: Iterable[str]) -> None:
        """Make a pod's directory and its containers' and serve its vcuda.sock, before the kubelet
        starts it (see :mod:`gpumanager.vmanager.ahead`). ValueError for an unsafe name, OSError when a
        directory cannot be made."""
        self._check_owned()
        directory = safenames.child(self.vm_path, safenames.pod_uid(pod_uid))
        files.make_open_dirs(directory)
        for name in containers:
            container = safenames.child(directory, safenames.container_name(name))
            own = self.container_dir((pod_uid, name))  # its own directory, or an earlier version's answer's
            files.make_open_dirs(container)  # the mount point of its own directory (or that one)
            files.make_open_dirs(own)
            files.make_spare(own / names.VCUDA_CONFIG_FILE)
        self._serve(pod_uid)

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

    def _serve(self, pod_uid: str, *, quiet: bool = False) -> bool:
        """Serve the pod's vcuda.sock; whether it was served now (not already, no failure). ``quiet``: the
        line saying so is a debug line (a restart serves every pod's again, and says so once)."""
        with self._lock:
            if self._sockets is None:
                self._sockets = PodSockets(self._handle)
                self._sockets.start()
            sockets = self._sockets
        if sockets.is_serving(pod_uid):
            return False
        sock = self.pod_dir(pod_uid) / names.VCUDA_SOCKET
        try:
            sockets.serve(pod_uid, sock)
        except OSError as exc:
            log.warning("not serving %s: %s", sock, exc)
            return False
        log.log(logging.DEBUG if quiet else logging.INFO, "serving %s", sock)
        return True

    async def _handle(self, socket_pod: str, req: pb.VDeviceRequest, time_left: float | None) -> None:
        try:
            await self.register_async(socket_pod, req, time_left=time_left)
        except RegistrationRefused as exc:
            left_out = self._refusals.admit(socket_pod)
            if left_out is not None:
                more = f" ({left_out} more refusals not logged)" if left_out else ""
                log.warning("vcuda.sock of pod %s refused %s: %s%s", socket_pod, _describe(req), exc, more)
            raise

    # -- RegisterVDevice --------------------------------------------------------------------------

    def _wait_budget(self, socket_pod: str, req: pb.VDeviceRequest, time_left: float | None) -> float:
        """Refuse what no wait can mend; else how long the call may wait for the pod's status."""
        for name, value in (
            ("pod_uid", req.pod_uid),
            ("container_name", req.container_name),
            ("container_id", req.container_id),
            ("bus_id", req.bus_id),
        ):
            if len(value.encode()) > MAX_FIELD_BYTES:
                raise RegistrationRefused(
                    f"{name} is {len(value.encode())} bytes, longer than {MAX_FIELD_BYTES}",
                    grpc.StatusCode.INVALID_ARGUMENT,
                )
        if req.pod_uid and req.pod_uid != socket_pod and not self._answered_here(socket_pod, req.pod_uid):
            raise RegistrationRefused(
                f"pod UID {_short(req.pod_uid)} is not the pod this socket serves", grpc.StatusCode.PERMISSION_DENIED
            )
        if not req.container_name and not req.container_id:
            raise RegistrationRefused("request names no container", grpc.StatusCode.INVALID_ARGUMENT)
        wait = REGISTER_WAIT_SECONDS
        if time_left is not None:
            wait = max(0.0, min(wait, time_left - _DEADLINE_MARGIN_SECONDS))
        return wait

    def _answered_here(self, socket_pod: str, pod_uid: str) -> bool:
        """Whether a container of pod ``pod_uid`` was answered with ``socket_pod``'s directory."""
        pod = self._pod(pod_uid)
        if pod is None:
            return False
        try:
            candidates = _container_names(pod)
        except PodSpecError:
            return False
        for name in candidates:
            alloc = self._allocation(pod_uid, name)
            if alloc is not None and alloc.answered[0] == socket_pod:
                return True
        return False

    def register(self, socket_pod: str, req: pb.VDeviceRequest, *, time_left: float | None = None) -> Path:
        """Handle RegisterVDevice on pod ``socket_pod``'s socket; returns the directory written.

        ``time_left``: seconds until the caller's deadline (None: none); a container the pod's
        status does not name yet is waited for until then, at most REGISTER_WAIT_SECONDS.
        """
        wait = self._wait_budget(socket_pod, req, time_left)
        started = time.monotonic()
        next_cgroup_look = started
        while True:
            now = time.monotonic()
            try:
                target = self._identify(socket_pod, req, use_cgroups=now >= next_cgroup_look)
                break
            except _NotYet as exc:
                if now - started >= wait:
                    raise RegistrationRefused(f"{exc} (waited {now - started:.1f} s)", exc.code) from None
                if now >= next_cgroup_look:
                    next_cgroup_look = now + _CGROUP_POLL_SECONDS
                time.sleep(min(_WAIT_POLL_SECONDS, max(0.0, started + wait - now)))
        return self._write_registration(socket_pod, target)

    async def register_async(self, socket_pod: str, req: pb.VDeviceRequest, *, time_left: float | None = None) -> Path:
        """:meth:`register` on the vcuda.sock server's event loop: the wait holds no thread (one pod's
        waiting calls cannot hold up another pod's), and the cgroup and file work runs in a thread."""
        wait = self._wait_budget(socket_pod, req, time_left)
        started = time.monotonic()
        next_cgroup_look = started
        while True:
            now = time.monotonic()
            try:
                if now >= next_cgroup_look:
                    target = await asyncio.to_thread(self._identify, socket_pod, req, use_cgroups=True)
                else:  # the pod cache and allocations only: memory, no I/O
                    target = self._identify(socket_pod, req, use_cgroups=False)
                break
            except _NotYet as exc:
                if now - started >= wait:
                    raise RegistrationRefused(f"{exc} (waited {now - started:.1f} s)", exc.code) from None
                if now >= next_cgroup_look:
                    next_cgroup_look = now + _CGROUP_POLL_SECONDS
                await asyncio.sleep(min(_WAIT_POLL_SECONDS, max(0.0, started + wait - now)))
        return await asyncio.to_thread(self._write_registration, socket_pod, target)

    def _identify(self, socket_pod: str, req: pb.VDeviceRequest, *, use_cgroups: bool) -> _Target:
        """Which container of the request's pod the request is for; _NotYet while the pod's status may
        still tell. The request's pod is the socket's or one answered with the socket's directory, and
        the container must have been answered with the socket's directory (it mounts that one alone)."""
        pod_uid = req.pod_uid or socket_pod
        pod = self._pod(pod_uid)
        if pod is None:
            raise _NotYet(f"pod {pod_uid} is not known on this node", grpc.StatusCode.NOT_FOUND)
        ids = podinfo.container_ids(pod)
        where = f"pod {podinfo.pod_key(pod)}"
        if req.container_name:
            name = _container_name(req.container_name, _container_names(pod))
            if name is None:
                raise RegistrationRefused(
                    f"container {_short(req.container_name)} is not in {where}", grpc.StatusCode.PERMISSION_DENIED
                )
            alloc = self._allocation(pod_uid, name)
            if alloc is not None and alloc.answered[0] != socket_pod and pod_uid == socket_pod:
                # Swapped away: the name is that of this pod's directory, which a container of another
                # pod (or another container of this one) was answered with; only it reaches this socket.
                return self._by_answer(socket_pod, pod, name, alloc, where)
            alloc = self._allocated(socket_pod, pod_uid, name, where)
            container_id = ids.get(name, "")
            if not container_id:
                raise _NotYet(f"container {name} of {where} has no container ID yet")
            container_id = self._running_id(pod, alloc, container_id, where, use_cgroups=use_cgroups)
            return _Target(pod_uid, pod, name, container_id, alloc.answered[1], alloc)
        # A prefix names a container only when it is at least a short ID (12 characters, as docker prints
        # them) and no container of the pod is called so: its files go into a directory of that name, and
        # a name-based registration's directory is the container's name.
        prefix_ok = len(req.container_id) >= _SHORT_ID and req.container_id not in ids
        matches = [
            n for n, cid in ids.items() if cid == req.container_id or (prefix_ok and cid.startswith(req.container_id))
        ]
        if not matches:
            # The last component of a cgroupfs path under CRI-O (``crio-<id>``), which the library sends
            # whole: the container whose status names ``<id>``; its files go where it reads, ``crio-<id>/``.
            bare = cgroups.without_runtime_prefix(req.container_id)
            matches = [n for n, cid in ids.items() if bare is not None and cid == bare]
        if matches or _CONTAINER_ID.fullmatch(req.container_id) is not None:
            # Its directory would be the pod directory's entry of that name: a container's mount point (its
            # limit files, for an earlier version's answer), removed with the registration once its
            # "container" ends, were the ID one of the names.
            self._refuse_a_name_as_id(socket_pod, pod, req.container_id)
        if len(matches) == 1:
            name = matches[0]
            alloc = self._allocated(socket_pod, pod_uid, name, where)
            return _Target(pod_uid, pod, name, ids[name], req.container_id, alloc, by_id=True)
        if _CONTAINER_ID.fullmatch(req.container_id) is None:
            raise RegistrationRefused(
                f"container ID {_short(req.container_id)} is not a container ID", grpc.StatusCode.INVALID_ARGUMENT
            )
        if use_cgroups:
            name = self._recognise_by_cgroup(pod_uid, pod, req.container_id)
            if name is not None:
                log.info(
                    "%s: container ID %s is %s (its cgroup; the status does not name it yet)",
                    where,
                    req.container_id,
                    name,
                )
                alloc = self._allocated(socket_pod, pod_uid, name, where)
                return _Target(pod_uid, pod, name, req.container_id, req.container_id, alloc, by_id=True)
        raise _NotYet(
            f"container ID {_short(req.container_id)} is not a container of {where}", grpc.StatusCode.PERMISSION_DENIED
        )

    def _running_id(
        self, pod: Pod, alloc: ContainerAllocation, container_id: str, where: str, *, use_cgroups: bool
    ) -> str:
        """The ID of the container's running cgroup, for a registration by its name: the one its status
        names, or, when that one's cgroup is gone (it restarted, and the status update naming its new ID
        has not come yet), the new one's (:meth:`_restarted`). _NotYet while it cannot be told; without
        ``use_cgroups`` (no I/O) as long as the last look found the status's ID gone."""
        key = (alloc.pod_uid, container_id)
        if not use_cgroups:
            if key in self._gone_ids:
                raise _NotYet(f"container {alloc.container} of {where}: the cgroup of its ID {container_id} is gone")
            return container_id
        # As the refresh looks for it (the tree is searched at most every SEARCH_BACKOFF_SECONDS per ID).
        found = self._cgroups.find(alloc.pod_uid, container_id, podinfo.qos_class(pod))
        restarts.settle(self._cgroups, pod)
        if found is not None:
            self._gone_ids.pop(key, None)
            return container_id
        restarted = self._restarted(alloc, pod)
        if restarted is not None:
            return restarted[0]
        if len(self._gone_ids) >= _GONE_IDS_LIMIT:
            self._gone_ids.clear()
        self._gone_ids[key] = None
        raise _NotYet(
            f"container {alloc.container} of {where}: the cgroup of its ID {container_id} is gone, and no "
            "cgroup below its pod's is told to be its new one (the status does not name a new ID yet)"
        )

    def _refuse_a_name_as_id(self, socket_pod: str, pod: Pod, container_id: str) -> None:
        """Refuse a container ID that is a container's name in the request's pod or the socket's: the
        socket pod's directory holds an entry of that name, which no registration by ID may take."""
        pods = [pod]
        if podinfo.uid(pod) != socket_pod:
            other = self._pod(socket_pod)
            if other is not None:
                pods.append(other)
        for each in pods:
            try:
                taken = _container_names(each)
            except PodSpecError:
                continue
            if container_id in taken:
                raise RegistrationRefused(
                    f"container ID {_short(container_id)} is the name of a container of pod "
                    f"{podinfo.pod_key(each)}, not a container ID",
                    grpc.StatusCode.INVALID_ARGUMENT,
                )

    def _allocated(self, socket_pod: str, pod_uid: str, name: str, where: str) -> ContainerAllocation:
        alloc = self._allocation(pod_uid, name)
        if alloc is None:
            raise RegistrationRefused(f"container {name} of {where} has no GPU allocation")
        if alloc.answered[0] != socket_pod:
            raise RegistrationRefused(
                f"container {name} of {where} was answered with the directory of pod {alloc.answered[0]}, "
                f"not that of pod {socket_pod}: it registers on that pod's vcuda.sock",
                grpc.StatusCode.PERMISSION_DENIED,
            )
        return alloc

    def _by_answer(
        self, socket_pod: str, socket_pod_obj: Pod, name: str, own: ContainerAllocation, where: str
    ) -> _Target:
        """The container answered with ``<socket pod dir>/<name>``, for a registration by ``name`` on the
        socket pod's socket whose own container ``name`` was answered with another pod's directory."""
        wanted = (socket_pod, name)
        # Swap partners are found from this pod's answers; the last refresh tells of the others.
        pods = {socket_pod, own.answered[0]} | self._answered_by.get(socket_pod, set())
        for other in _container_names(socket_pod_obj):
            answered = self._allocation(socket_pod, other)
            if answered is not None:
                pods.add(answered.answered[0])
        found: list[tuple[str, Pod, str, ContainerAllocation]] = []
        for uid in sorted(pods):
            pod = self._pod(uid)
            if pod is None:
                continue
            try:
                containers = _container_names(pod)
            except PodSpecError:
                continue
            for container in containers:
                alloc = self._allocation(uid, container)
                if alloc is not None and alloc.answered == wanted:
                    found.append((uid, pod, container, alloc))
        if not found:
            raise RegistrationRefused(
                f"container {name} of {where} was answered with the directory of pod {own.answered[0]} and no "
                f"container with its directory {name} here",
                grpc.StatusCode.PERMISSION_DENIED,
            )
        if len(found) > 1:
            whose = ", ".join(f"{podinfo.pod_key(p)}/{c}" for _, p, c, _ in found)
            raise RegistrationRefused(
                f"container {name} of {where} was answered with the directory of pod {own.answered[0]}, and more "
                f"than one container with its directory {name} here ({whose}): register by container ID"
            )
        uid, pod, container, alloc = found[0]
        container_id = podinfo.container_ids(pod).get(container, "")
        if not container_id:
            raise _NotYet(f"container {container} of pod {podinfo.pod_key(pod)} has no container ID yet")
        return _Target(uid, pod, container, container_id, name, alloc)

    def _recognise_by_cgroup(self, pod_uid: str, pod: Pod, container_id: str) -> str | None:
        """The container a cgroup below the pod's belongs to, when only one GPU container can be it.

        Candidates: containers and init containers with an allocation whose status names no
        container ID, or one whose cgroup is gone (the container was restarted and has a new ID),
        except an init container that has completed (it does not run again). With more than one
        candidate nothing is guessed: the caller waits for the pod's status.

        The ID is the caller's claim: it is looked for below the pod's own cgroup only (a bogus ID
        must not cost a walk of the node's whole tree each second).
        """
        qos = podinfo.qos_class(pod)
        if self._cgroups.find_claimed(pod_uid, container_id, qos) is None:
            return None
        ids = podinfo.container_ids(pod)
        completed = _completed_inits(pod)
        candidates = []
        for name in _container_names(pod):
            if name in completed or self._allocation(pod_uid, name) is None:
                continue
            known = ids.get(name)
            if not known or self._cgroups.find(pod_uid, known, qos) is None:
                candidates.append(name)
        return candidates[0] if len(candidates) == 1 else None

    def _write_registration(self, socket_pod: str, target: _Target) -> Path:
        qos = podinfo.qos_class(target.pod)
        # Looked for as a claimed ID is (below the pod's cgroup): a caller repeating a registration by
        # name of a container that has ended must not walk the whole tree each time.
        self._cgroups.find_claimed(target.pod_uid, target.container_id, qos)
        pids = self._cgroups.pids(target.pod_uid, target.container_id, qos)
        if not pids:
            why = ""
            if cgroups.hidden_processes_seen():
                why = "; the processes cgroups list are outside the agent's PID namespace: run the agent with hostPID"
            raise RegistrationRefused(
                f"empty pids: no process found in the cgroup of container {target.container_id}{why}"
            )
        # By its ID: below the pod's directory the container mounts (its answer's pod: the socket's); by
        # its name: the directory of its answer's container (its own, mounted at /etc/vcuda/<name>).
        also: list[Path] = []  # by its name, where the layout is not known: the other place too
        if target.by_id:
            directory = safenames.child(self.pod_dir(target.alloc.answered[0]), target.subdir)
        else:
            directory, *also = self.container_dirs(target.alloc)
        path = directory / names.PIDS_CONFIG_FILE
        with self._pids_lock:
            try:
                files.write_pids(path, pids, make_dir=True)
            except FileNotFoundError:
                # The pod's directory was removed (the pod is gone): it is not made again.
                raise RegistrationRefused(
                    f"the directory {directory.parent} of pod {target.alloc.answered[0]} is gone: not writing {path}",
                    grpc.StatusCode.NOT_FOUND,
                ) from None
            except OSError as exc:
                raise RegistrationRefused(
                    f"cannot write {path}: {exc.strerror or exc}", grpc.StatusCode.UNAVAILABLE
                ) from None
            # The refresh compares against what each file holds: this one now holds ``pids``, the
            # container's files no longer all hold the same list, and a refresh in progress must not
            # remember what it wrote (this may have overwritten it).
            self._last_pids[path] = pids
            for other in also:  # the refresh writes it again where this fails
                try:
                    files.write_pids(other / names.PIDS_CONFIG_FILE, pids, make_dir=True)
                except OSError as exc:
                    log.debug("cannot write %s: %s", other / names.PIDS_CONFIG_FILE, exc)
                else:
                    self._last_pids[other / names.PIDS_CONFIG_FILE] = pids
            # A restarted container registers under its new ID: what is remembered of the old one goes
            # (a crash-looping container added one entry per restart, even when no refresh saw it).
            before = self._registered.get((target.pod_uid, target.name))
            if before is not None and before != path:
                self._last_pids.pop(before, None)
            self._registered[(target.pod_uid, target.name)] = path
            if target.by_id:  # by its ID (or a prefix): removed once the container is gone
                self._id_dirs[directory] = (target.pod_uid, target.container_id)
            self._registrations += 1
            # The next refresh rewrites what the refresh writes to this file (from its container's
            # PIDs, should they differ), and the registering container's other files.
            self._current.pop((target.pod_uid, target.container_id), None)
            for writer in self._writers.get((target.alloc.answered[0], target.subdir), ()):
                self._current.pop(writer, None)
        config = directory / names.VCUDA_CONFIG_FILE
        if not config.exists():  # as upstream: written once; a running container may be reading it
            try:
                files.write_config(config, self.config_for(target.alloc), make_dirs=False)
            except FileNotFoundError:
                # Removed since its pids.config was written (the pod is gone, and what was remembered of it
                # may have been dropped before this registration noted its own): nothing of it is kept.
                with self._pids_lock:
                    self._last_pids.pop(path, None)
                    if self._registered.get((target.pod_uid, target.name)) == path:
                        del self._registered[(target.pod_uid, target.name)]
                    if target.by_id and self._id_dirs.get(directory) == (target.pod_uid, target.container_id):
                        del self._id_dirs[directory]
                raise RegistrationRefused(
                    f"the directory {directory} of pod {target.alloc.answered[0]} is gone: not writing {config}",
                    grpc.StatusCode.NOT_FOUND,
                ) from None
            except OSError as exc:
                raise RegistrationRefused(
                    f"cannot write {config}: {exc.strerror or exc}", grpc.StatusCode.UNAVAILABLE
                ) from None
        if target.by_id:
            for listener in self._prepare_listeners:
                listener()
        left_out = self._registrations_log.admit(socket_pod)
        if left_out is not None:
            log.info(
                "registered pod %s container %s (%s): %d pids%s",
                podinfo.pod_key(target.pod),
                target.name,
                target.container_id,
                len(pids),
                f" ({left_out} more registrations not logged)" if left_out else "",
            )
        return directory

    # -- pids.config ------------------------------------------------------------------------------

    def refresh_pids(self, allocations: Iterable[ContainerAllocation]) -> int:
        """Rewrite ``pids.config`` of every shared container whose processes changed; returns how many.
        Directories of registrations by a container ID whose container has ended are removed (any
        container's: the library registers whole-GPU containers too).

        Written next to the container's vcuda.config (``<pod dir>/<container>/``) and in the
        directories the upstream library registered (``<pod dir>/<container id>/``). A container
        whose PIDs are those last written everywhere costs a read of its cgroup and nothing more.
        """
        if not self._owns_directory():
            return 0  # another agent's directory now (said by the lock)
        written = 0
        seen_containers: set[tuple[str, str]] = set()  # (pod UID, container)
        # (pod UID, container ID) -> (pod directory, directory name) of its registered pids.config, and
        # (pod directory, directory name) of a pids.config -> the containers written there: names, not
        # paths (a path costs microseconds to build, each second for every shared container).
        seen_ids: dict[tuple[str, str], tuple[str, str]] = {}
        answered_by: dict[str, set[str]] = {}  # pod directory -> pods whose containers were answered with it
        writers: dict[tuple[str, str], set[tuple[str, str]]] = {}
        allocations = list(allocations)
        for alloc in allocations:
            answered_by.setdefault(alloc.answered[0], set()).add(alloc.pod_uid)
        self._answered_by = answered_by
        for alloc in allocations:
            if not alloc.shared:
                continue
            pod = self._pod(alloc.pod_uid)
            if pod is None:
                continue
            seen_containers.add(alloc.key)
            cid = self._container_id(alloc, pod)
            if not cid:
                continue
            registrations = self._registrations
            pids = self._cgroups.pids(alloc.pod_uid, cid, podinfo.qos_class(pod))
            if self._cgroups.unsettled(alloc.pod_uid):
                restarts.settle(self._cgroups, pod)
            if not pids and not self._cgroups.located(alloc.pod_uid, cid):
                restarted = self._restarted(alloc, pod)
                if restarted is not None:
                    cid, pids = restarted
            key = (alloc.pod_uid, cid)
            answered_pod, answered_container = alloc.answered
            seen_ids[key] = (answered_pod, cid)
            for place in ((answered_pod, answered_container), (answered_pod, cid)):
                writers.setdefault(place, set()).add(key)
            if self._current.get(key) == pids:
                continue
            done, count = self._write_pids_of(alloc, cid, pids)
            written += count
            # A registration meanwhile may have written older PIDs over ours: look again next time.
            with self._pids_lock:
                if done and registrations == self._registrations:
                    self._current[key] = pids
        # What is remembered of containers that are gone (or no longer shared) goes with them.
        # (A registration may drop an entry meanwhile, from the sockets' thread: list() copies at once.)
        for memo, seen in ((self._current, seen_ids), (self._ids_of, seen_containers)):
            for gone in [k for k in list(memo) if k not in seen]:
                memo.pop(gone, None)
        # So does the file a container ID registered, once that container is gone (a container that
        # crash-loops gets a new ID each time: its pod would otherwise add an entry per restart).
        for key, (dir_pod, dir_name) in self._swept_ids.items():
            if key not in seen_ids:
                self._last_pids.pop(self.pod_dir(dir_pod) / dir_name / names.PIDS_CONFIG_FILE, None)
        self._swept_ids = seen_ids
        self._writers = writers
        self._remove_ended_ids(answered_by)
        return written

    def _restarted(self, alloc: ContainerAllocation, pod: Pod) -> tuple[str, list[int]] | None:
        """The ID and PIDs of the container's new cgroup, when it restarted and its pod's status still names
        the old ID, whose cgroup is gone (:func:`restarts.new_cgroup`); None when it cannot be told."""
        found = restarts.new_cgroup(self._cgroups, pod, alloc.container)
        return (found[0], cgroups.pids_under(found[1])) if found is not None else None

    def _remove_ended_ids(self, answered_by: dict[str, set[str]]) -> None:
        """Remove the ``<pod dir>/<container id>/`` of registrations whose container has ended: its ID
        is in no status of the pods that use the directory and its cgroup is gone (a crash-looping
        container registers a new ID at each start; the pod's directory would collect them)."""
        for directory, (pod_uid, cid) in list(self._id_dirs.items()):
            dir_pod = directory.parent.name
            if self._id_in_use({pod_uid, dir_pod} | answered_by.get(dir_pod, set()), directory.name, cid):
                continue
            with self._pids_lock:
                if self._id_dirs.get(directory) != (pod_uid, cid):
                    continue  # registered again meanwhile
                del self._id_dirs[directory]
                path = directory / names.PIDS_CONFIG_FILE
                self._last_pids.pop(path, None)
                for key in [k for k, v in list(self._registered.items()) if v == path]:
                    self._registered.pop(key, None)
            shutil.rmtree(directory, ignore_errors=True)
            log.info("removed %s: its container has ended", directory)

    def _id_in_use(self, pod_uids: Iterable[str], name: str, cid: str) -> bool:
        """Whether a status of these pods names the ID (``name`` may be a prefix of it) or its cgroup
        lives; True also when none of the pods is known (nothing can be told)."""
        known = False
        for uid in pod_uids:
            pod = self._pod(uid)
            if pod is None:
                continue
            known = True
            for current in podinfo.container_ids(pod).values():
                if current in (name, cid) or (len(name) >= _SHORT_ID and current.startswith(name)):
                    return True
            qos = podinfo.qos_class(pod)
            if self._cgroups.find_claimed(uid, cid, qos) is not None:
                return True
        return not known

    def _container_id(self, alloc: ContainerAllocation, pod: Pod) -> str:
        """The container's runtime ID from its pod's status (read again only when the pod changed)."""
        key = alloc.key
        known = self._ids_of.get(key)
        if known is not None and known[0] is pod:
            return known[1]
        cid = podinfo.container_ids(pod).get(alloc.container, "")
        self._ids_of[key] = (pod, cid)
        return cid

    def _answered_dirs(self, alloc: ContainerAllocation) -> list[Path]:
        """The directories of the container's answer (:meth:`container_dirs`): the files it reads, and a
        registration by its name writes."""
        return self.container_dirs(alloc)

    def _registered_dir(self, alloc: ContainerAllocation, cid: str) -> Path:
        """Where a registration of the container by its ID writes: below the directory it mounts."""
        return self.pod_dir(alloc.answered[0]) / cid

    def _write_pids_of(self, alloc: ContainerAllocation, cid: str, pids: list[int]) -> tuple[bool, int]:
        """Write ``pids`` wherever the container's files are; (whether every place exists, files written)."""
        targets = self._answered_dirs(alloc)
        registered = self._registered_dir(alloc, cid)
        if registered.is_dir():
            targets.append(registered)
        # Registered under another name of its ID (CRI-O's cgroupfs ``crio-<id>``, which the library sends
        # whole), by an earlier run of the agent too (then not remembered): the processes it forks later
        # never register.
        for prefix in cgroups.RUNTIME_PREFIXES:
            prefixed = registered.with_name(f"{prefix}-{cid}")
            if prefixed.is_dir():
                targets.append(prefixed)
        # Where its last registration wrote, when that was by another name of its ID (``crio-<id>``).
        last = self._registered.get(alloc.key)
        if (
            last is not None
            and last.parent not in targets
            and last.parent.parent == registered.parent
            and last.parent.is_dir()
        ):
            targets.append(last.parent)
        complete, written = True, 0
        for directory in targets:
            path = directory / names.PIDS_CONFIG_FILE
            if self._last_pids.get(path) == pids:
                continue
            if not directory.is_dir():
                complete = False
                continue
            with self._pids_lock:  # a registration writes the same file: what is recorded is what it holds
                try:
                    files.write_pids(path, pids)
                except FileNotFoundError:  # removed since it was looked at (its pod gone): not made again
                    complete = False
                    continue
                except OSError as exc:
                    # Tried again each period; reported once until it works (not a traceback a second).
                    complete = False
                    self._unwritable.failed(path, exc, f"pod {alloc.pod_uid} container {alloc.container}")
                    continue
                self._last_pids[path] = pids
                self._unwritable.written(path)
            written += 1
        return complete, written

    # -- cleanup ----------------------------------------------------------------------------------

    def gc(self, active: Iterable[str], only: Iterable[str] | None = None) -> list[str]:
        """Remove directories (and stop sockets) of pods not in ``active``; returns their UIDs.

        Only directories named by a pod UID are pods' directories; anything else is left alone.
        ``only``: look at these pods' directories alone instead of every directory.
        """
        if not self._owns_directory():
            return []  # another agent's pods' directories now (said by the lock)
        keep = set(active)
        removed: list[str] = []
        configs = self.configs_path
        if only is None:
            if not self.vm_path.is_dir():
                return removed
            # Pod directories alone (named by a pod UID): not what else lives there (``lost+found`` of a
            # mounted volume, the agent's own directories when the path is their parent).
            uids = {e.name for e in self.vm_path.iterdir() if e.name not in keep and _is_pod_uid(e.name) and e.is_dir()}
            if configs.is_dir():
                uids |= {e.name for e in configs.iterdir() if e.name not in keep and _is_pod_uid(e.name) and e.is_dir()}
        else:
            uids = {uid for uid in set(only) - keep if _is_pod_uid(uid)}
            uids = {u for u in uids if (self.vm_path / u).is_dir() or (configs / u).is_dir()}
        for uid in sorted(uids):
            entry = self.vm_path / uid
            self._stop_server(uid)
            failure = _remove_tree(entry) or _remove_tree(configs / uid)
            self._forget(entry)
            if failure is None:
                removed.append(uid)
                with self._lock:
                    self._unremovable.discard(uid)
                continue
            with self._lock:  # reported once per pod (each periodic check tries again)
                known = uid in self._unremovable
                if not known:
                    if len(self._unremovable) >= 4096:
                        self._unremovable.clear()
                    self._unremovable.add(uid)
            if not known:
                log.warning("cannot remove the directory of pod %s, which is gone: %s; trying again", uid, failure)
        if removed:
            log.info("removed the directories of %d pods that are gone: %s", len(removed), ", ".join(removed))
        return removed

    def _forget(self, entry: Path) -> None:
        """Drop what is remembered of a removed pod directory (lists copied: other threads add meanwhile)."""
        prefix = str(entry) + os.sep
        own_prefix = str(self.configs_path / entry.name) + os.sep
        for path in [p for p in list(self._last_pids) if str(p).startswith((prefix, own_prefix))]:
            self._last_pids.pop(path, None)
        self._unwritable.forget_under(entry)
        self._unwritable.forget_under(self.configs_path / entry.name)
        for answered in [k for k in list(self._own_dirs) if k[0] == entry.name]:
            self._own_dirs.pop(answered, None)
        for key in [k for k in list(self._current) if k[0] == entry.name]:
            self._current.pop(key, None)
        for ids_key in [k for k in list(self._ids_of) if k[0] == entry.name]:
            self._ids_of.pop(ids_key, None)
        for id_dir in [d for d in list(self._id_dirs) if d.parent == entry]:
            self._id_dirs.pop(id_dir, None)
        for registered_key, path in list(self._registered.items()):
            if registered_key[0] == entry.name or str(path).startswith((prefix, own_prefix)):
                self._registered.pop(registered_key, None)
        self._cgroups.forget_pod(entry.name)
        self._refusals.forget(entry.name)
        self._registrations_log.forget(entry.name)

    def _stop_server(self, pod_uid: str) -> None:
        if self._sockets is not None:
            self._sockets.unserve(pod_uid)

    def serving(self) -> list[str]:
        """UIDs of pods whose vcuda.sock is served."""
        return self._sockets.serving() if self._sockets is not None else []

    def resume(self, pod_uids: Iterable[str]) -> None:
        """Serve again the sockets of pods that have a directory (after an agent restart)."""
        served = 0
        for uid in pod_uids:
            directory = self.pod_dir(uid)
            if directory.is_dir():
                served += self._serve(uid, quiet=True)
                self._adopt_id_dirs(directory)
        if served:
            log.info("serving the vcuda.sock of %d pods again, in %s", served, self.vm_path)

    def _adopt_id_dirs(self, directory: Path) -> None:
        """Take the registrations' directories a previous run left in a pod's directory into account
        (see :meth:`_remove_ended_ids`): those named by a whole container ID, longer than any
        container's name (63 characters)."""
        try:
            entries = [e for e in directory.iterdir() if len(e.name) > 63 and _CONTAINER_ID.fullmatch(e.name)]
        except OSError:
            return
        with self._pids_lock:
            for entry in entries:
                if entry.is_dir():
                    self._id_dirs.setdefault(entry, (directory.name, entry.name))

    def stop(self) -> None:
        """Stop serving every socket (directories stay: the containers still use them)."""
        with self._lock:
            sockets, self._sockets = self._sockets, None
        if sockets is not None:
            sockets.stop()


def _remove_tree(path: Path) -> str | None:
    """Remove a directory tree; None when it is gone, else why it is not (the first failure)."""
    shutil.rmtree(path, ignore_errors=True)
    if not os.path.lexists(path):
        return None
    try:
        shutil.rmtree(path)  # once more, for the reason (only when something was left)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return str(exc)
    return None


def _is_pod_uid(name: str) -> bool:
    """Whether a name under the virtual-manager path is a pod's directory (a pod UID)."""
    try:
        safenames.pod_uid(name)
    except safenames.UnsafeNameError:
        return False
    return True


def _container_names(pod: Pod) -> list[str]:
    """Names of the pod's init containers and containers (an init container may have a GPU too)."""
    inits = [r.name for r in podinfo.init_gpu_requests(pod)]
    return inits + [str(c.get("name", "")) for c in podinfo.containers(pod)]


def _completed_inits(pod: Pod) -> set[str]:
    """Init containers (not sidecars) whose status says they ended with success: they do not run again."""
    status = pod.get("status")
    entries = status.get("initContainerStatuses") if isinstance(status, Mapping) else None
    done = set()
    for cs in entries if isinstance(entries, list) else []:
        if not isinstance(cs, Mapping):
            continue
        state = cs.get("state")
        terminated = state.get("terminated") if isinstance(state, Mapping) else None
        name = str(cs.get("name", ""))
        if isinstance(terminated, Mapping) and terminated.get("exitCode") == 0 and not podinfo.is_sidecar(pod, name):
            done.add(name)
    return done


def _container_name(requested: str, known: list[str]) -> str | None:
    """Match a container name, also in docker's ``/k8s_<name>_...`` form (as upstream)."""
    if requested in known:
        return requested
    for name in known:
        if requested.startswith(f"/k8s_{name}_") or requested.startswith(f"k8s_{name}_"):
            return name
    return None
