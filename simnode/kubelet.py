"""A kubelet device-manager simulator speaking the real device-plugin gRPC API over unix sockets.

It stands in for the kubelet on machines without one (tests, benchmarks, the demo) and follows
the kubelet's device manager closely:

* :meth:`KubeletSimulator.start` creates the plugin directory, removes every unix socket in it
  (the kubelet's ``CleanupPluginDirectory``; the checkpoint and other files stay) and serves
  ``v1beta1.Registration/Register`` on ``<dir>/kubelet.sock``.
* ``Register`` checks the version and the extended-resource name, then - inside the call, as the
  kubelet does - dials ``<dir>/<endpoint>`` (blocking, 10 s by default), fetches
  ``GetDevicePluginOptions`` and starts a ``ListAndWatch`` reader. Errors carry the kubelet's
  message texts with gRPC status ``UNKNOWN`` (a plain Go error returned from a handler).
* Every ``ListAndWatch`` message replaces the resource's device list and rewrites
  ``kubelet_internal_checkpoint`` (V2 shape). When the stream ends, every device of the resource
  turns unhealthy.
* :meth:`KubeletSimulator.allocate` picks devices like ``devicesToAllocate`` (reuse, availability
  check, NUMA split into aligned/unaligned/no-affinity, ``GetPreferredAllocation``, fill) and
  sends one ``Allocate`` with exactly one container request. The kubelet fills from Go sets, i.e.
  in effectively random order; ``fill="random"`` (seedable) mimics that, ``fill="sorted"`` makes
  it deterministic. IDs freed by :meth:`KubeletSimulator.remove_pod` come first in that order
  (``reuse_freed``, on by default): the kubelet frees a deleted pod's IDs at once and a new
  container of the same size may well get the very same set.
* A new ``Register`` of a resource makes its endpoint current without stopping the one it replaces
  (kubelet 1.25 on): that stream reads on, and its end marks every device unhealthy and stops the
  current endpoint (its calls refused until the next registration); ``keep_replaced_streams=False``
  closes the old one at once, as kubelets up to 1.24 did. Calls on a stopped endpoint are refused
  ("endpoint ... has been stopped") before they reach the plugin.
* :meth:`KubeletSimulator.restart` simulates a kubelet restart: plugin connections dropped (their
  devices unhealthy), every unix socket in the directory removed, ``kubelet.sock`` re-created. The
  allocations come back from ``kubelet_internal_checkpoint``: with that file missing or damaged the
  restarted kubelet knows no container's devices, and a container that starts again later fails in
  PreStartContainer's look-up ("no devices found allocated in local cache ...") before any plugin
  call, as the kubelet's GetDeviceRunContainerOptions checks that before it would allocate again.
* An optional PodResources v1 server (:mod:`simnode.kubelet_podresources`).

A resource whose endpoint stopped (stream ended, kubelet restarted) and was not registered again within
``endpoint_stop_grace`` (5 minutes) is forgotten at the next allocation, as the kubelet's GetCapacity
drops it: allocations fail as for a resource never registered.

Not modelled: node status (capacity, allocatable),
the Topology Manager (a NUMA hint is passed to :meth:`KubeletSimulator.allocate` directly).

Run as a process for demos::

    python -m simnode.kubelet --plugin-dir DIR [--pod-resources-socket PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import os
import random
import re
import signal
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, Literal, NoReturn

import grpc

from gpumanager.api import deviceplugin_v1beta1_pb2 as _pb
from gpumanager.api import deviceplugin_v1beta1_pb2_grpc as _pb_grpc
from simnode.apiserver_quantity import value as quantity_value
from simnode.kubelet_checkpoint import (
    CHECKPOINT_FILE,
    NODE_WITHOUT_TOPOLOGY,
    CheckpointEntry,
    CheckpointV2Writer,
    write_checkpoint_v1,
    write_checkpoint_v2,
    write_checkpoint_v2_boot_id,
)
from simnode.kubelet_podresources import (
    DEFAULT_BURST,
    DEFAULT_QPS,
    ContainerSnapshot,
    DeviceSnapshot,
    GetMethod,
    PodResourcesCall,
    PodResourcesServer,
    PodSnapshot,
)

pb: Any = _pb
pb_grpc: Any = _pb_grpc

logger = logging.getLogger(__name__)

__all__ = [
    "CHECKPOINT_FILE",
    "DEFAULT_DIAL_TIMEOUT",
    "ENDPOINT_STOP_GRACE",
    "HEALTHY",
    "KUBELET_SOCKET",
    "PRE_START_TIMEOUT",
    "SUPPORTED_VERSIONS",
    "UNHEALTHY",
    "AllocationError",
    "AllocationRecord",
    "AllocationTimings",
    "CheckpointEntry",
    "DeviceState",
    "DeviceUpdate",
    "FillOrder",
    "KubeletSimError",
    "KubeletSimulator",
    "PluginRPCError",
    "RegistrationRecord",
    "is_extended_resource_name",
    "main",
    "write_checkpoint_v1",
    "write_checkpoint_v2",
    "write_checkpoint_v2_boot_id",
]

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
VERSION = "v1beta1"
SUPPORTED_VERSIONS = (VERSION,)
KUBELET_SOCKET = "kubelet.sock"
DEFAULT_DIAL_TIMEOUT = 10.0
"""The kubelet dials a registering plugin with a 10 s blocking timeout."""
PRE_START_TIMEOUT = 30.0
ENDPOINT_STOP_GRACE = 300.0
"""``endpointStopGracePeriod``: a stopped endpoint's resource is dropped after 5 minutes."""
"""``KubeletPreStartContainerRPCTimeoutInSecs``."""

FillOrder = Literal["random", "sorted"]

# --------------------------------------------------------------------------------------------
# errors


def admission_order(pod: Mapping[str, Any]) -> list[tuple[Mapping[str, Any], bool]]:
    """The pod's containers in the order the kubelet's device manager allocates and starts them: the init
    containers in spec order, then the app containers; with each, whether it is an ordinary init container
    (one that runs to completion, whose devices later containers of the pod may reuse) rather than a sidecar
    (``restartPolicy: Always``, running beside the app containers) or an app container."""
    spec = pod.get("spec") or {}
    inits = [(c, c.get("restartPolicy") != "Always") for c in spec.get("initContainers") or []]
    return [*inits, *((c, False) for c in spec.get("containers") or [])]


class KubeletSimError(RuntimeError):
    """Base class of the simulator's errors."""


class AllocationError(KubeletSimError):
    """The kubelet side refused an allocation (unregistered resource, too few devices, ...)."""


class PluginRPCError(KubeletSimError):
    """A call into the device plugin failed; carries the gRPC status code and details."""

    def __init__(self, method: str, code: grpc.StatusCode | None, details: str) -> None:
        self.method = method
        self.code = code
        self.details = details
        code_name = code.name if code is not None else "Unknown"
        super().__init__(f"device plugin {method} rpc failed: code = {code_name} desc = {details}")


def _rpc_error_parts(err: BaseException) -> tuple[grpc.StatusCode | None, str]:
    code_fn = getattr(err, "code", None)
    details_fn = getattr(err, "details", None)
    code = code_fn() if callable(code_fn) else None
    details = details_fn() if callable(details_fn) else None
    return (code if isinstance(code, grpc.StatusCode) else None), (details or str(err))


# --------------------------------------------------------------------------------------------
# validation helpers

_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_SUBDOMAIN = re.compile(rf"^{_DNS_LABEL}(\.{_DNS_LABEL})*$")
_QUALIFIED_NAME_PART = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")


def is_extended_resource_name(name: str) -> bool:
    """The kubelet's ``IsExtendedResourceName``: ``domain/name``, not native, qualified."""
    if "/" not in name or "kubernetes.io/" in name:
        return False  # native resource
    if name.startswith("requests."):
        return False
    parts = ("requests." + name).split("/")
    if len(parts) != 2:
        return False
    prefix, short = parts
    if not prefix or len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix):
        return False
    return 0 < len(short) <= 63 and bool(_QUALIFIED_NAME_PART.match(short))


@functools.lru_cache(maxsize=1 << 16)
def _natural_key(s: str) -> tuple[tuple[int, int, str], ...]:
    """Sort key of Go's natural order of device IDs (cached: the kubelet sorts the same IDs all the time)."""
    return tuple((0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", s) if t)


#: Devices of a ListAndWatch message read between two yields of the interpreter (about 0.7 ms): a Go
#: kubelet reads each resource's stream on its own, while the simulator's share one interpreter.
READ_YIELD_EVERY = 256


def _go_join(directory: Path, endpoint: str) -> Path:
    """``filepath.Join(dir, endpoint)``: an absolute endpoint stays under ``dir``."""
    return Path(os.path.normpath(os.path.join(str(directory), endpoint.lstrip("/"))))


def _is_socket(path: Path) -> bool:
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False


# --------------------------------------------------------------------------------------------
# records


@dataclass(frozen=True)
class DeviceState:
    """A device as last reported by the plugin's ``ListAndWatch`` (or marked by the kubelet)."""

    id: str
    health: str
    numa_nodes: tuple[int, ...] = ()
    """NUMA node ids from the device's topology; empty when the plugin sent none."""

    @property
    def healthy(self) -> bool:
        """True when the health string is ``Healthy``."""
        return self.health == HEALTHY


@dataclass
class RegistrationRecord:
    """One successful ``Register`` call. Times are ``time.monotonic()`` values."""

    index: int
    """Position among all successful registrations of this simulator (0-based)."""
    resource: str
    endpoint: str
    version: str
    options: Any
    """``DevicePluginOptions`` as returned by ``GetDevicePluginOptions`` (what the kubelet uses)."""
    request_options: Any
    """``DevicePluginOptions`` carried in the ``RegisterRequest``."""
    registered_at: float
    """When the Register call arrived."""
    connected_at: float
    """When the dial and ``GetDevicePluginOptions`` had completed."""
    first_list_and_watch_at: float | None = None
    """When the first ``ListAndWatch`` response arrived."""
    list_and_watch_messages: int = 0
    ended_at: float | None = None
    """When the ``ListAndWatch`` stream ended (error, EOF, replacement, restart or stop)."""
    end_reason: str | None = None


@dataclass(frozen=True)
class DeviceUpdate:
    """An entry of a resource's device history."""

    at: float
    kind: Literal["list_and_watch", "disconnected", "restart", "stop", "expired"]
    devices: Mapping[str, DeviceState]
    registration_index: int | None = None
    detail: str = ""


@dataclass(frozen=True)
class AllocationTimings:
    """Monotonic timings of one :meth:`KubeletSimulator.allocate`."""

    started_at: float
    finished_at: float
    preferred_seconds: float | None = None
    """Duration of the ``GetPreferredAllocation`` call, None when not called."""
    allocate_seconds: float | None = None
    """Duration of the ``Allocate`` call, None when no call was made (reuse)."""

    @property
    def total_seconds(self) -> float:
        """Whole allocation, picking included."""
        return self.finished_at - self.started_at


@dataclass(frozen=True)
class AllocationRecord:
    """Devices the simulator assigned to one resource of one container, and the plugin's answer."""

    pod_uid: str
    container_name: str
    resource: str
    device_ids: tuple[str, ...]
    """The IDs sent in the ``ContainerAllocateRequest``, in the order sent."""
    devices_per_numa: Mapping[int, tuple[str, ...]]
    """NUMA node -> IDs, as recorded in the checkpoint (``-1``: no topology)."""
    response: Any
    """The ``ContainerAllocateResponse`` (``container_responses[0]`` of the plugin's answer)."""
    timings: AllocationTimings
    preferred: tuple[str, ...] | None = None
    """What ``GetPreferredAllocation`` returned, None when it was not called."""
    pod_name: str = ""
    namespace: str = ""
    reused: bool = False
    """True when the container already held these devices and no ``Allocate`` was issued."""
    init_container: bool = False
    """An init container that runs to completion (not a sidecar): PodResources does not list it."""


@dataclass
class _PodInfo:
    name: str
    namespace: str


@dataclass(frozen=True)
class _CheckpointData:
    """The checkpoint's content at one moment; ``sequence`` orders the moments."""

    sequence: int
    entries: list[CheckpointEntry]
    registered: dict[str, list[str]]


class _Endpoint:
    """The simulator's connection to one registered plugin."""

    def __init__(
        self, resource: str, path: Path, channel: grpc.Channel, options: Any, record: RegistrationRecord
    ) -> None:
        self.resource = resource
        self.path = path
        self.channel = channel
        self.stub: Any = pb_grpc.DevicePluginStub(channel)
        self.options = options
        self.record = record
        self.stopped_at: float | None = None
        """The kubelet's stop time (monotonic), None while the endpoint is not stopped."""
        self.closed = False
        """The simulator dropped the connection: its messages and the end of its stream are ignored."""
        self.thread: threading.Thread | None = None

    @property
    def stopped(self) -> bool:
        """The kubelet's stop time is set: its calls are refused ("endpoint ... has been stopped")."""
        return self.stopped_at is not None

    @stopped.setter
    def stopped(self, value: bool) -> None:
        if not value:
            self.stopped_at = None
        elif self.stopped_at is None:
            self.stopped_at = time.monotonic()

    def close(self) -> None:
        self.stopped = self.closed = True
        self.channel.close()  # cancels the ListAndWatch call


class _RegistrationServicer:
    """Duck-typed ``RegistrationServicer`` forwarding to the simulator."""

    def __init__(self, sim: KubeletSimulator) -> None:
        self._sim = sim

    def Register(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self._sim._handle_register(request, context)


# --------------------------------------------------------------------------------------------
# the simulator


class KubeletSimulator:
    """The kubelet's device manager, its Registration server, checkpoint and PodResources API.

    Thread-safe: every piece of state is guarded by one lock (with a condition variable on it for
    the ``wait_for_*`` helpers); no gRPC call is made while the lock is held.
    """

    def __init__(
        self,
        plugin_dir: Path,
        *,
        pod_resources_socket: Path | None = None,
        dial_timeout: float = DEFAULT_DIAL_TIMEOUT,
        pre_start_timeout: float = PRE_START_TIMEOUT,
        rpc_timeout: float | None = None,
        fill: FillOrder = "random",
        seed: int | None = None,
        rng: random.Random | None = None,
        write_checkpoint: bool = True,
        reuse_freed: bool = True,
        pod_resources_qps: float = DEFAULT_QPS,
        pod_resources_burst: int = DEFAULT_BURST,
        pod_resources_get: GetMethod = "enabled",
    ) -> None:
        """Configure (nothing starts until :meth:`start`).

        ``dial_timeout``: the blocking dial inside Register (kubelet: 10 s).
        ``rpc_timeout``: deadline for GetDevicePluginOptions, GetPreferredAllocation and Allocate
        (kubelet: none, i.e. ``None``). ``fill``/``seed``/``rng``: default fill order of picking.
        ``pod_resources_qps``/``pod_resources_burst``: PodResources' rate limit (kubelet: 100 and 10;
        qps 0: none). ``pod_resources_get``: how its ``Get`` is served (see :data:`GetMethod`).
        """
        self.plugin_dir = Path(plugin_dir)
        self.pod_resources_socket = Path(pod_resources_socket) if pod_resources_socket else None
        self.dial_timeout = dial_timeout
        self.pre_start_timeout = pre_start_timeout
        self.rpc_timeout = rpc_timeout
        self.fill: FillOrder = fill
        if rng is None and seed is None:
            # A fresh order each run, as the kubelet's; named on stderr (shown with a failed test's output) so
            # that SIMNODE_KUBELET_SEED repeats it.
            pinned = os.environ.get("SIMNODE_KUBELET_SEED", "")
            seed = int(pinned) if pinned.strip() else random.randrange(2**32)
            print(
                f"kubelet simulator: fill order seed {seed} (SIMNODE_KUBELET_SEED={seed} repeats it)", file=sys.stderr
            )
        #: The seed of the fill order (None when the caller gave its own ``rng``).
        self.seed = seed
        self._rng = rng if rng is not None else random.Random(seed)
        self._write_enabled = write_checkpoint
        self.reuse_freed = reuse_freed
        self._pr_limit = (pod_resources_qps, pod_resources_burst)
        self.pod_resources_get: GetMethod = pod_resources_get
        self._pr_calls: list[PodResourcesCall] = []  # across kubelet restarts
        self._freed: list[str] = []  # IDs freed by remove_pod, most recent first
        #: Records of removed pods still written to the checkpoint file: the kubelet drops a removed pod's
        #: entries from its memory only at the next Allocate of any device (UpdateAllocatedDevices), and
        #: writes the file only at an allocation or a device-list update, so a deleted pod's entries stay
        #: in kubelet_internal_checkpoint until the next pod with devices is admitted. False: gone at once.
        self.keep_departed_in_checkpoint = True
        self._departed: dict[tuple[str, str, str], AllocationRecord] = {}

        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._running = False
        self._generation = 0
        self._server: grpc.Server | None = None
        self._pr_server: PodResourcesServer | None = None
        self._endpoints: dict[str, _Endpoint] = {}
        #: A new Register of a resource does not stop the endpoint it replaces (kubelet 1.25 on: a list of
        #: clients per resource): that stream reads on, its messages still set the resource's devices, and
        #: when it ends the kubelet's PluginDisconnected, which knows the resource only, marks every device
        #: unhealthy and sets the stop time of the current endpoint, whose calls are then refused ("has been
        #: stopped") until the next registration. False: the old endpoint is closed at once (kubelet <= 1.24).
        self.keep_replaced_streams = True
        #: Seconds after its endpoint stopped (stream ended, kubelet restarted) with no new registration that
        #: the kubelet forgets a resource (endpointStopGracePeriod; GetCapacity drops it, capacity 0): an
        #: allocation then fails as for a resource never registered.
        self.endpoint_stop_grace = ENDPOINT_STOP_GRACE
        self._replaced: dict[str, list[_Endpoint]] = {}  # resource -> replaced endpoints still reading
        self._devices: dict[str, dict[str, DeviceState]] = {}
        # Per resource: the last ListAndWatch message read and what it read as (see _on_devices).
        self._last_read: dict[str, tuple[bytes, dict[str, DeviceState]]] = {}
        self._history: dict[str, list[DeviceUpdate]] = {}
        self._registrations: list[RegistrationRecord] = []
        self._registration_errors: list[tuple[float, str, str]] = []
        self._allocations: dict[tuple[str, str, str], AllocationRecord] = {}
        # The device dicts the registered devices were last sorted from, and that sorting.
        self._registered_made: tuple[tuple[dict[str, DeviceState], ...], dict[str, list[str]]] = ((), {})
        # The PodSnapshot made for each pod: ((name, namespace), its records, snapshot).
        self._pod_snapshots: dict[str, tuple[tuple[str, str], tuple[AllocationRecord, ...], PodSnapshot]] = {}
        # pod_resources_snapshot() of every pod, and the version of allocations and pods it was made at.
        self._pod_resources_version = 0
        self._pod_resources: tuple[int, list[PodSnapshot]] = (-1, [])
        # Device IDs seen so far in natural order, and each one's position in it (see _order).
        self._natural_ids: list[str] = []
        self._natural_rank: dict[str, int] = {}
        self._in_use_made: dict[str, tuple[int, frozenset[str]]] = {}  # resource -> (version, allocated IDs)
        # The device dict of a resource its healthy IDs and whether any has a NUMA node were taken from.
        self._healthy_made: dict[str, tuple[dict[str, DeviceState], frozenset[str], bool]] = {}
        self._checkpoint_writer = CheckpointV2Writer()  # used under _checkpoint_file_lock
        # The checkpoint entry made for each record: (record, entry).
        self._entries_made: dict[tuple[str, str, str], tuple[AllocationRecord, CheckpointEntry]] = {}
        self._pending: dict[str, set[str]] = {}
        self._reusable: dict[tuple[str, str], set[str]] = {}  # (pod UID, resource) -> init containers' devices
        self._pods: dict[str, _PodInfo] = {}
        self._pre_start_calls: list[tuple[str, str, str, tuple[str, ...]]] = []
        self._checkpoint_writes = 0
        self._checkpoint_taken = 0  # sequence of the newest content taken under the lock
        self._checkpoint_written = 0  # sequence of the content on disk
        # Sequence of the newest content whose write is over (written, superseded or failed), and
        # of the content taken with the newest device list: wait_for_devices answers only once the
        # devices' checkpoint is on disk, so a test that saw them can read it.
        self._checkpoint_done = 0
        self._devices_checkpoint = 0
        self._checkpoint_file_lock = threading.Lock()

    # ---------------------------------------------------------------- lifecycle

    @property
    def socket_path(self) -> Path:
        """``<plugin_dir>/kubelet.sock``."""
        return self.plugin_dir / KUBELET_SOCKET

    @property
    def checkpoint_path(self) -> Path:
        """``<plugin_dir>/kubelet_internal_checkpoint``."""
        return self.plugin_dir / CHECKPOINT_FILE

    @property
    def running(self) -> bool:
        """True between :meth:`start` and :meth:`stop`."""
        with self._lock:
            return self._running

    def start(self) -> float:
        """Create the directory, wipe its sockets, serve Registration (and PodResources).

        Returns the monotonic time at which ``kubelet.sock`` was created.
        """
        with self._lock:
            if self._running:
                raise KubeletSimError("kubelet simulator already started")
            self._running = True
        try:
            self.plugin_dir.mkdir(parents=True, exist_ok=True, mode=0o750)
            self.cleanup_plugin_directory()
            return self._start_servers()
        except BaseException:
            with self._lock:
                self._running = False
            self._stop_servers()
            raise

    def stop(self) -> None:
        """Stop serving and drop every plugin connection (devices turn unhealthy). Idempotent."""
        with self._cond:
            if not self._running:
                return
            self._running = False
            self._generation += 1
            endpoints = self._detach_endpoints_locked("stop", "kubelet stopped")
            self._cond.notify_all()
        self._stop_servers()
        self._close_endpoints(endpoints)
        logger.info("kubelet simulator stopped")

    def restart(self) -> float:
        """Simulate a kubelet restart; return the monotonic time the new ``kubelet.sock`` appeared.

        The Registration server stops, plugin channels close (their devices turn unhealthy),
        every unix socket in the directory is removed (plugins' sockets included), then
        ``kubelet.sock`` is created again. Allocations survive as the checkpoint holds them; when it is
        missing or damaged, the restarted kubelet knows none (:meth:`_read_checkpoint`).
        """
        with self._cond:
            if not self._running:
                raise KubeletSimError("kubelet simulator is not running")
            self._generation += 1
            endpoints = self._detach_endpoints_locked("restart", "kubelet restarted")
            self._cond.notify_all()
        self._stop_servers()
        self._close_endpoints(endpoints)
        self.cleanup_plugin_directory()
        self._read_checkpoint()
        created = self._start_servers()
        logger.info("kubelet simulator restarted; kubelet.sock re-created")
        return created

    def _read_checkpoint(self) -> None:
        """What a starting kubelet's device manager knows (``readCheckpoint``): the allocations and
        endpoints of ``kubelet_internal_checkpoint``. A file that is missing (the directory removed and
        made again) or cannot be read (damaged) leaves it knowing none ("Continue after failing to read
        checkpoint file. Device allocation info may NOT be up-to-date"): every container's devices,
        every resource and its endpoint are forgotten until the plugins register again. A file that reads
        holds what this simulator knows (it writes it on every change), which is kept. Without
        checkpoint writing (``write_checkpoint=False``) the state is kept as it is."""
        if not self._write_enabled:
            return
        try:
            document = json.loads(self.checkpoint_path.read_text())
            readable = isinstance(document, dict) and isinstance(document.get("Data"), dict)
            problem = "" if readable else "no Data object"
        except (OSError, UnicodeDecodeError, ValueError) as err:
            readable, problem = False, f"{type(err).__name__}: {err}"
        if readable:
            return
        with self._cond:
            forgotten = len(self._allocations)
            self._allocations.clear()
            self._departed.clear()
            self._reusable.clear()
            self._pending.clear()
            self._endpoints.clear()
            self._replaced.clear()
            self._devices.clear()
            self._last_read.clear()
            self._pod_resources_version += 1
            self._cond.notify_all()
        logger.warning(
            "kubelet restarted without a readable %s (%s): %d device allocation(s) and every resource forgotten",
            self.checkpoint_path,
            problem,
            forgotten,
        )

    def __enter__(self) -> KubeletSimulator:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def cleanup_plugin_directory(self) -> list[Path]:
        """Remove every unix socket directly in the plugin directory; return what was removed."""
        removed: list[Path] = []
        try:
            names = os.listdir(self.plugin_dir)
        except FileNotFoundError:
            return removed
        for name in names:
            path = self.plugin_dir / name
            if name == CHECKPOINT_FILE or not _is_socket(path):
                continue
            try:
                os.unlink(path)
                removed.append(path)
            except FileNotFoundError:
                pass
        if removed:
            logger.info("removed %d socket(s) from %s", len(removed), self.plugin_dir)
        return removed

    def _start_servers(self) -> float:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="kubelet-reg"))
        pb_grpc.add_RegistrationServicer_to_server(_RegistrationServicer(self), server)
        try:
            os.unlink(self.socket_path)
        except FileNotFoundError:
            pass
        server.add_insecure_port(f"unix://{self.socket_path}")  # binds: the socket file exists now
        created = time.monotonic()
        server.start()
        pr_server = None
        if self.pod_resources_socket is not None:
            qps, burst = self._pr_limit
            pr_server = PodResourcesServer(
                self.pod_resources_socket, self, qps=qps, burst=burst, calls=self._pr_calls, get=self.pod_resources_get
            )
            pr_server.start()
        with self._lock:
            self._server = server
            self._pr_server = pr_server
        logger.info("kubelet registration server listening on %s", self.socket_path)
        return created

    def _stop_servers(self) -> None:
        with self._lock:
            server, self._server = self._server, None
            pr_server, self._pr_server = self._pr_server, None
        if server is not None:
            server.stop(grace=None).wait()
        if pr_server is not None:
            pr_server.stop()

    def _detach_endpoints_locked(self, kind: Literal["restart", "stop"], reason: str) -> list[_Endpoint]:
        endpoints = [*self._endpoints.values(), *(ep for eps in self._replaced.values() for ep in eps)]
        self._replaced.clear()
        now = time.monotonic()
        for ep in endpoints:
            ep.stopped = ep.closed = True
            if kind == "restart":
                # The restarted kubelet reads its endpoints back from the checkpoint as stopped ones without
                # options: PreStartContainer (and GetPreferredAllocation) are skipped until the plugin registers.
                ep.options = None
            if ep.record.ended_at is None:
                ep.record.ended_at = now
                ep.record.end_reason = reason
        for resource in list(self._devices):
            self._mark_unhealthy_locked(resource, kind, None, reason)
        return endpoints

    @staticmethod
    def _close_endpoints(endpoints: Iterable[_Endpoint]) -> None:
        for ep in endpoints:
            ep.close()
        for ep in endpoints:
            if ep.thread is not None and ep.thread is not threading.current_thread():
                ep.thread.join(timeout=5.0)

    # ---------------------------------------------------------------- Register

    def _reject(self, context: grpc.ServicerContext, request: Any, message: str) -> NoReturn:
        with self._cond:
            self._registration_errors.append((time.monotonic(), request.resource_name, message))
            self._cond.notify_all()
        logger.warning("registration of %r refused: %s", request.resource_name, message)
        context.abort(grpc.StatusCode.UNKNOWN, message)

    def _handle_register(self, request: Any, context: grpc.ServicerContext) -> Any:
        registered_at = time.monotonic()
        with self._lock:
            generation = self._generation
        logger.info(
            "got registration request: resource=%s endpoint=%s version=%s",
            request.resource_name,
            request.endpoint,
            request.version,
        )
        if request.version not in SUPPORTED_VERSIONS:
            self._reject(
                context,
                request,
                f'requested API version "{request.version}" is not supported by kubelet. '
                f'Supported version is "{VERSION}"',
            )
        if not is_extended_resource_name(request.resource_name):
            self._reject(context, request, f'the ResourceName "{request.resource_name}" is invalid')

        path = _go_join(self.plugin_dir, request.endpoint)
        # A connection of this dial's own, as each of the Go kubelet's dials is: from grpc's shared pool, it
        # would take over the reconnect backoff of a dial of an earlier kubelet generation to the same path
        # (still waiting on a socket that generation's successor removed), grown over the failed tries to
        # many seconds.
        channel = grpc.insecure_channel(
            f"unix://{path}", options=[("grpc.default_authority", "localhost"), ("grpc.use_local_subchannel_pool", 1)]
        )
        error: str | None = None
        options: Any = None
        try:
            grpc.channel_ready_future(channel).result(timeout=self.dial_timeout)
        except grpc.FutureTimeoutError:
            error = "failed to dial device plugin: context deadline exceeded"
        if error is None:
            try:
                options = pb_grpc.DevicePluginStub(channel).GetDevicePluginOptions(pb.Empty(), timeout=self.rpc_timeout)
            except grpc.RpcError as err:
                code, details = _rpc_error_parts(err)
                code_name = code.name if code is not None else "Unknown"
                error = f"failed to get device plugin options: rpc error: code = {code_name} desc = {details}"
        if error is not None:
            channel.close()
            self._reject(context, request, error)

        old: _Endpoint | None = None
        with self._cond:
            if not self._running or self._generation != generation:
                stale = True
            else:
                stale = False
                record = RegistrationRecord(
                    index=len(self._registrations),
                    resource=request.resource_name,
                    endpoint=request.endpoint,
                    version=request.version,
                    options=options,
                    request_options=request.options,
                    registered_at=registered_at,
                    connected_at=time.monotonic(),
                )
                ep = _Endpoint(request.resource_name, path, channel, options, record)
                old = self._endpoints.get(request.resource_name)
                if old is not None and not old.closed and self.keep_replaced_streams:
                    # Today's kubelet keeps a list of clients per resource: the replaced one reads on.
                    self._replaced.setdefault(request.resource_name, []).append(old)
                    old = None
                elif old is not None:
                    old.stopped = old.closed = True
                    if old.record.ended_at is None:
                        old.record.ended_at = time.monotonic()
                        old.record.end_reason = "replaced by a new registration"
                self._endpoints[request.resource_name] = ep
                self._registrations.append(record)
                self._devices.setdefault(request.resource_name, {})
                self._history.setdefault(request.resource_name, [])
                thread = threading.Thread(
                    target=self._run_list_and_watch,
                    args=(ep,),
                    name=f"listandwatch-{request.resource_name}-{record.index}",
                    daemon=True,
                )
                ep.thread = thread
                self._cond.notify_all()
        if stale:
            channel.close()
            context.abort(grpc.StatusCode.UNAVAILABLE, "kubelet is restarting")
        if old is not None:
            old.close()
        thread.start()
        logger.info(
            "registered device plugin %s at %s (pre_start_required=%s, get_preferred_allocation=%s)",
            record.resource,
            record.endpoint,
            options.pre_start_required,
            options.get_preferred_allocation_available,
        )
        return pb.Empty()

    # ---------------------------------------------------------------- ListAndWatch

    def _run_list_and_watch(self, ep: _Endpoint) -> None:
        reason = "listAndWatch stream ended"
        # Each message is taken as it arrives, read later (_on_devices): a Go kubelet reads each stream
        # in its own goroutine, while here both share one interpreter.
        list_and_watch = ep.channel.unary_stream(
            "/v1beta1.DevicePlugin/ListAndWatch",
            request_serializer=pb.Empty.SerializeToString,
            response_deserializer=None,
        )
        try:
            for raw in list_and_watch(pb.Empty()):
                self._on_devices(ep, raw, time.monotonic())
        except grpc.RpcError as err:
            code, details = _rpc_error_parts(err)
            code_name = code.name if code is not None else "Unknown"
            reason = f"rpc error: code = {code_name} desc = {details}"
        except Exception as err:  # closed channel and the like
            reason = f"{type(err).__name__}: {err}"
        self._on_stream_end(ep, reason)

    def _on_devices(self, ep: _Endpoint, raw: bytes, now: float) -> None:
        """One ListAndWatch message (``raw``, received at ``now``). A list the same as the resource's
        last one (every re-registration sends it again) is not read device by device again: that took
        this interpreter 10 ms for 2,560 IDs (35 ms on 16 x H200), during which the other resource's
        answer waited to be received and was timestamped late. A new list is read yielding the
        interpreter every :data:`READ_YIELD_EVERY` devices, for the same reason."""
        last = self._last_read.get(ep.resource)
        if last is not None and last[0] == raw:
            devices = last[1]  # never changed in place: every update replaces the resource's dict
        else:
            devices = {}
            for i, d in enumerate(pb.ListAndWatchResponse.FromString(raw).devices):
                if i % READ_YIELD_EVERY == READ_YIELD_EVERY - 1:
                    time.sleep(0)  # the other stream's message is received now, not after this list
                nodes = tuple(int(n.ID) for n in d.topology.nodes) if d.HasField("topology") else ()
                devices[d.ID] = DeviceState(id=d.ID, health=d.health, numa_nodes=nodes)
                _natural_key(d.ID)  # here, not in the checkpoint's sort under the lock (cached)
            self._last_read[ep.resource] = (raw, devices)
        with self._cond:
            if ep.closed or (
                self._endpoints.get(ep.resource) is not ep and ep not in self._replaced.get(ep.resource, ())
            ):
                return
            rec = ep.record
            if rec.first_list_and_watch_at is None:
                rec.first_list_and_watch_at = now
            rec.list_and_watch_messages += 1
            before = self._devices.get(ep.resource, {})
            self._devices[ep.resource] = devices
            self._history.setdefault(ep.resource, []).append(
                DeviceUpdate(now, "list_and_watch", dict(devices), rec.index)
            )
            checkpoint = self._checkpoint_locked()
            if checkpoint is not None:
                self._devices_checkpoint = checkpoint.sequence
        self._write_checkpoint(checkpoint)
        with self._cond:
            self._cond.notify_all()
        healthy = sum(1 for d in devices.values() if d.healthy)
        old_healthy = sum(1 for d in before.values() if d.healthy)
        level = logging.INFO if (len(before), old_healthy) != (len(devices), healthy) else logging.DEBUG
        logger.log(level, "%s: %d devices, %d healthy", ep.resource, len(devices), healthy)

    def _on_stream_end(self, ep: _Endpoint, reason: str) -> None:
        with self._cond:
            if ep.record.ended_at is None:
                ep.record.ended_at = time.monotonic()
                ep.record.end_reason = reason
            replaced = self._replaced.get(ep.resource, [])
            current = self._endpoints.get(ep.resource)
            if ep in replaced:
                # PluginDisconnected knows the resource only: the current endpoint gets the stop time.
                replaced.remove(ep)
                ep.closed = True
                if current is not None:
                    current.stopped = True
            elif ep.closed or current is not ep:
                self._cond.notify_all()
                return
            ep.stopped = ep.closed = True
            self._mark_unhealthy_locked(
                ep.resource,
                "disconnected",
                ep.record.index,
                f"listAndWatch ended unexpectedly for device plugin {ep.resource} with error {reason}",
            )
            self._cond.notify_all()
        logger.warning("ListAndWatch of %s ended (%s); its devices are unhealthy now", ep.resource, reason)
        ep.channel.close()

    def _mark_unhealthy_locked(
        self,
        resource: str,
        kind: Literal["disconnected", "restart", "stop"],
        registration_index: int | None,
        detail: str,
    ) -> None:
        devices = {i: dataclasses.replace(d, health=UNHEALTHY) for i, d in self._devices.get(resource, {}).items()}
        self._devices[resource] = devices
        self._history.setdefault(resource, []).append(
            DeviceUpdate(time.monotonic(), kind, dict(devices), registration_index, detail)
        )

    # ---------------------------------------------------------------- observation

    @property
    def registrations(self) -> list[RegistrationRecord]:
        """Every successful registration so far, oldest first (records are live objects)."""
        with self._lock:
            return list(self._registrations)

    @property
    def registration_errors(self) -> list[tuple[float, str, str]]:
        """Refused registrations as ``(monotonic time, resource name, message)``."""
        with self._lock:
            return list(self._registration_errors)

    def registration_count(self, resource: str | None = None) -> int:
        """How many successful registrations (of ``resource``, or of any) have happened."""
        with self._lock:
            return sum(1 for r in self._registrations if resource is None or r.resource == resource)

    def wait_for_registration(
        self,
        resource: str,
        after: int | None = None,
        timeout: float = 10.0,
        *,
        with_devices: bool = False,
        since: float | None = None,
    ) -> RegistrationRecord:
        """Wait for a registration of ``resource`` and return its record.

        ``after=None``: the latest registration (waiting for the first one if there is none).
        ``after=n``: the registration that follows the first ``n`` ones of this resource, i.e.
        its (n+1)-th, typically ``wait_for_registration(r, after=sim.registration_count(r))``.
        ``since``: instead of ``after``, the first registration whose ``Register`` call arrived at or
        after this ``time.monotonic()`` value. A registration is recorded only once the kubelet has
        dialled the plugin back, so one still in flight when a count is taken would be miscounted;
        use ``since`` for "the registration of the process started at that time".
        ``with_devices``: also wait for its first ``ListAndWatch`` response.
        Raises ``TimeoutError``.
        """

        def pick() -> RegistrationRecord | None:
            regs = [r for r in self._registrations if r.resource == resource]
            if since is not None:
                regs = sorted((r for r in regs if r.registered_at >= since), key=lambda r: r.registered_at)
                wanted = 0
            else:
                wanted = len(regs) - 1 if after is None else after
            rec = regs[wanted] if 0 <= wanted < len(regs) else None
            if rec is not None and with_devices and rec.first_list_and_watch_at is None:
                return None
            return rec

        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                rec = pick()
                if rec is not None:
                    return rec
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    have = sum(1 for r in self._registrations if r.resource == resource)
                    which = "since the given time" if since is not None else f"#{(after or 0) + 1}"
                    devices = " with its first ListAndWatch" if with_devices else ""
                    raise TimeoutError(
                        f"no registration {which} of {resource}{devices} within {timeout}s ({have} so far)"
                    )
                self._cond.wait(remaining)

    def devices(self, resource: str) -> dict[str, DeviceState]:
        """The resource's devices as last known (empty if never reported)."""
        with self._lock:
            return dict(self._devices.get(resource, {}))

    def healthy_ids(self, resource: str) -> set[str]:
        """IDs of the resource's healthy devices."""
        with self._lock:
            return {i for i, d in self._devices.get(resource, {}).items() if d.healthy}

    def resources(self) -> list[str]:
        """Every resource that has registered at least once."""
        with self._lock:
            return sorted(self._devices)

    def updates(self, resource: str) -> list[DeviceUpdate]:
        """The resource's device history (every ListAndWatch message and every health drop)."""
        with self._lock:
            return list(self._history.get(resource, []))

    def endpoint_options(self, resource: str) -> Any:
        """The ``DevicePluginOptions`` of the current endpoint of ``resource`` (None if none)."""
        with self._lock:
            ep = self._endpoints.get(resource)
            return ep.options if ep is not None else None

    def wait_for_devices(
        self,
        resource: str,
        predicate_or_count: Callable[[dict[str, DeviceState]], bool] | int,
        timeout: float = 10.0,
    ) -> dict[str, DeviceState]:
        """Wait until the resource's devices satisfy a predicate, now or in any update after this
        call (a state they passed through counts), and return that state.

        An ``int`` means "exactly that many healthy devices". Raises ``TimeoutError``.
        """
        predicate: Callable[[dict[str, DeviceState]], bool]
        if isinstance(predicate_or_count, int):
            want = predicate_or_count

            def predicate(devs: dict[str, DeviceState]) -> bool:
                return sum(1 for d in devs.values() if d.healthy) == want

        else:
            predicate = predicate_or_count
        deadline = time.monotonic() + timeout
        with self._cond:
            # A state the devices passed through while this waited counts too (a GPU marked
            # unhealthy and recovered before this woke up); once one matched, the answer waits
            # only for the checkpoint written with it.
            seen = len(self._history.get(resource, []))
            matched: dict[str, DeviceState] | None = None
            while True:
                devs = dict(self._devices.get(resource, {}))
                if matched is None:
                    history = self._history.get(resource, [])
                    passed = [dict(u.devices) for u in history[seen:]]
                    seen = len(history)
                    matched = next((d for d in [*passed, devs] if predicate(d)), None)
                if matched is not None and self._checkpoint_done >= self._devices_checkpoint:
                    return matched
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    healthy = sum(1 for d in devs.values() if d.healthy)
                    raise TimeoutError(
                        f"devices of {resource} did not reach the expected state within {timeout}s "
                        f"({len(devs)} devices, {healthy} healthy)"
                    )
                self._cond.wait(remaining)

    def allocations(self, pod_uid: str | None = None) -> list[AllocationRecord]:
        """Recorded allocations (of one pod, or all), in allocation order."""
        with self._lock:
            return [a for a in self._allocations.values() if pod_uid is None or a.pod_uid == pod_uid]

    @property
    def pre_start_calls(self) -> list[tuple[str, str, str, tuple[str, ...]]]:
        """``(resource, pod_uid, container_name, device_ids)`` of every PreStartContainer sent."""
        with self._lock:
            return list(self._pre_start_calls)

    @property
    def pod_resources_calls(self) -> list[PodResourcesCall]:
        """Every PodResources call received since the simulator was made, in order."""
        return list(self._pr_calls)

    @property
    def checkpoint_writes(self) -> int:
        """How many times the checkpoint has been written."""
        with self._lock:
            return self._checkpoint_writes

    # ---------------------------------------------------------------- allocation

    def _order(self, ids: Iterable[str], fill: FillOrder) -> list[str]:
        """Iteration order of a Go set: natural-sorted, then shuffled for ``random`` (lock held)."""
        out = list(ids)
        for _ in range(2):
            rank = self._natural_rank
            # Every ID is normally known (ranked) already: an unknown one shows as a KeyError in the sort,
            # or as one missing from the filter, and every ID is ranked again (a check of each first cost
            # this simulator a quarter of its whole Allocate with thousands of vcuda-memory IDs offered).
            try:
                if isinstance(ids, (set, frozenset)) and 8 * len(out) > len(rank):
                    ordered = list(filter(ids.__contains__, self._natural_ids))  # most of them: no sort at all
                    if len(ordered) != len(out):
                        raise KeyError("an ID not ranked yet")
                    out = ordered
                else:
                    out.sort(key=rank.__getitem__)
                break
            except KeyError:
                # Every ID seen so far in natural order, by number: sorting by it is four times faster
                # than by the natural key.
                seen = rank.keys() | out if len(rank) < 1 << 16 else out
                self._natural_ids = sorted(seen, key=_natural_key)
                self._natural_rank = {dev: i for i, dev in enumerate(self._natural_ids)}
        if fill == "random":
            self._rng.shuffle(out)
        if self.reuse_freed and self._freed:
            rank = {dev: i for i, dev in enumerate(self._freed)}
            out.sort(key=lambda dev: rank.get(dev, len(rank)))
        return out

    def _devices_seen_locked(self, resource: str) -> tuple[frozenset[str], bool]:
        """(the healthy IDs of ``resource``, whether any of its devices has a NUMA node), taken again only
        when its device list changed (each update replaces the resource's dict)."""
        devs = self._devices.get(resource, {})
        made = self._healthy_made.get(resource)
        if made is None or made[0] is not devs:
            healthy = frozenset(i for i, d in devs.items() if d.healthy)
            made = self._healthy_made[resource] = (devs, healthy, any(d.numa_nodes for d in devs.values()))
        return made[1], made[2]

    def _in_use_locked(self, resource: str) -> frozenset[str]:
        # The allocated IDs are gathered again only after an allocation or a removal (each bumps the
        # PodResources version): with 500 records, gathering them on every pick cost this simulator
        # more than the plugin's whole Allocate.
        made = self._in_use_made.get(resource)
        if made is None or made[0] != self._pod_resources_version:
            allocated: set[str] = set()
            for (_, _, res), rec in self._allocations.items():
                if res == resource:
                    allocated.update(rec.device_ids)
            made = self._in_use_made[resource] = (self._pod_resources_version, frozenset(allocated))
        return made[1].union(self._pending.get(resource, ()))

    def _filter_by_affinity_locked(
        self, resource: str, available: AbstractSet[str], numa_hint: set[int] | None
    ) -> tuple[set[str], set[str], set[str]]:
        devs = self._devices.get(resource, {})
        has_topology = self._devices_seen_locked(resource)[1]
        if numa_hint is None or not has_topology:
            return set(), set(), set(available)
        per_node: dict[int, set[str]] = {}
        for dev_id in available:
            nodes = devs[dev_id].numa_nodes or (NODE_WITHOUT_TOPOLOGY,)
            for n in nodes:
                per_node.setdefault(n, set()).add(dev_id)

        def rank(n: int) -> tuple[int, int]:
            group = 0 if n in numa_hint else (2 if n == NODE_WITHOUT_TOPOLOGY else 1)
            return group, len(per_node[n])

        ordered_nodes = sorted(per_node, key=rank)
        aligned: set[str] = set()
        unaligned: set[str] = set()
        no_affinity: set[str] = set()
        for dev_id in available:
            for n in ordered_nodes:
                if dev_id in per_node[n]:
                    if n in numa_hint:
                        aligned.add(dev_id)
                    elif n == NODE_WITHOUT_TOPOLOGY:
                        no_affinity.add(dev_id)
                    else:
                        unaligned.add(dev_id)
                    break
        return aligned, unaligned, no_affinity

    def _call_preferred(
        self, ep: _Endpoint, available: Sequence[str], must_include: Sequence[str], size: int
    ) -> tuple[tuple[str, ...] | None, float | None]:
        if ep.options is None or not ep.options.get_preferred_allocation_available:
            return None, None
        if ep.stopped:
            raise PluginRPCError("GetPreferredAllocation", None, f"endpoint {ep.resource} has been stopped")
        req = pb.PreferredAllocationRequest(
            container_requests=[
                pb.ContainerPreferredAllocationRequest(
                    available_deviceIDs=list(available),
                    must_include_deviceIDs=list(must_include),
                    allocation_size=size,
                )
            ]
        )
        t0 = time.monotonic()
        try:
            resp = ep.stub.GetPreferredAllocation(req, timeout=self.rpc_timeout)
        except grpc.RpcError as err:
            code, details = _rpc_error_parts(err)
            raise PluginRPCError("GetPreferredAllocation", code, details) from err
        except ValueError as err:  # channel closed under us
            raise PluginRPCError("GetPreferredAllocation", None, f"endpoint {ep.resource} has been stopped") from err
        elapsed = time.monotonic() - t0
        if len(resp.container_responses) == 0:
            return (), elapsed
        return tuple(resp.container_responses[0].deviceIDs), elapsed

    def limits_order(self, resources: Iterable[str]) -> list[str]:
        """The order in which the kubelet goes through a container's resources, for Allocate at admission
        and PreStartContainer at its start: it ranges over ``container.Resources.Limits``, a Go map, so the
        order is random on every pass (``fill="random"``); ``fill="sorted"`` keeps the order given."""
        out = list(resources)
        if self.fill == "random":
            with self._lock:
                self._rng.shuffle(out)
        return out

    def admit_pod(self, pod: Mapping[str, Any], resources: Iterable[str]) -> Iterator[AllocationRecord]:
        """Allocate for every container of ``pod`` asking for any of ``resources``, as the kubelet's device
        manager admits a pod: in :func:`admission_order` (init containers first, whose devices later
        containers may reuse), each container's resources in :meth:`limits_order`, the checkpoint written
        once per container after all of its resources (not when they were all reused).

        Yields each record as it is made; the first failure raises (:class:`KubeletSimError`), the
        devices allocated before it staying recorded until the caller removes the pod."""
        md = pod["metadata"]
        uid, name, namespace = str(md["uid"]), str(md["name"]), str(md.get("namespace") or "default")
        kinds = list(resources)
        for c, init in admission_order(pod):
            limits = (c.get("resources") or {}).get("limits") or {}
            wanted = {res: int(quantity_value(limits.get(res, 0))) for res in kinds}
            made = []
            for res in self.limits_order(r for r, n in wanted.items() if n):
                record = self.allocate(
                    res,
                    wanted[res],
                    pod_uid=uid,
                    container_name=str(c["name"]),
                    pod_name=name,
                    namespace=namespace,
                    init_container=init,
                    write=False,
                )
                made.append(record)
                yield record
            if any(not record.reused for record in made):
                self.write_checkpoint()

    def allocate(
        self,
        resource: str,
        count: int,
        *,
        pod_uid: str,
        container_name: str,
        numa_hint: set[int] | None = None,
        pod_name: str | None = None,
        namespace: str | None = None,
        fill: FillOrder | None = None,
        init_container: bool = False,
        write: bool = True,
    ) -> AllocationRecord:
        """Admit ``count`` devices of ``resource`` for one container, the kubelet's way.

        As the kubelet does, devices of the pod's init containers are reused: an init container's
        devices become reusable within the pod (init containers run one after the other, before the
        app containers), and a later container takes reusable devices first (an app container's
        devices stop being reusable). ``init_container`` says which kind this container is.

        ``write``: write the checkpoint after this allocation. The kubelet writes it once per container,
        after all of its resources (none when one fails): pass False for all but the last, as
        :meth:`simnode.cluster.SimCluster.admit` does, or call :meth:`write_checkpoint`.

        Reuses the container's recorded devices (no Allocate call) when it already has them;
        otherwise picks from healthy - allocated (NUMA split by ``numa_hint``, then
        GetPreferredAllocation if the plugin offers it, then fill in ``fill`` order), calls
        Allocate with one container request, records the answer and writes the checkpoint.

        Raises :class:`AllocationError` when the kubelet would refuse, and
        :class:`PluginRPCError` when a plugin call fails (nothing is recorded then).
        """
        if count <= 0:
            raise ValueError("count must be positive")
        self._expire_stopped()
        order: FillOrder = fill or self.fill
        started = time.monotonic()
        key = (pod_uid, container_name, resource)
        with self._lock:
            self._departed.clear()  # UpdateAllocatedDevices: removed pods are forgotten before any admission
            existing = self._allocations.get(key)
            if existing is not None and len(existing.device_ids) != count:
                raise AllocationError(
                    f'pod "{pod_uid}" container "{container_name}" changed request for resource '
                    f'"{resource}" from {len(existing.device_ids)} to {count}'
                )
            if resource not in self._devices:
                raise AllocationError(f"cannot allocate unregistered device {resource}")
            healthy = self._devices_seen_locked(resource)[0]
            if not healthy:
                raise AllocationError(f"no healthy devices present; cannot allocate unhealthy devices {resource}")
            if existing is not None:
                if not healthy.issuperset(existing.device_ids):
                    raise AllocationError(
                        "previously allocated devices are no longer healthy; "
                        f"cannot allocate unhealthy devices {resource}"
                    )
                now = time.monotonic()
                return dataclasses.replace(existing, reused=True, timings=AllocationTimings(started, now, None, None))
            ep = self._endpoints.get(resource)
            if ep is None:
                raise AllocationError(f"unknown Device Plugin {resource}")
            reusable = self._reusable.get((pod_uid, resource), set())
            # Reusable devices are taken as they are, healthy or not (the kubelet checks only the
            # container's own devices for health), and the shortfall is what remains to be found.
            picked: list[str] = self._order(reusable, order)[:count]
            available = healthy - self._in_use_locked(resource)
            if len(available) + len(picked) < count:
                raise AllocationError(
                    f"requested number of devices unavailable for {resource}. "
                    f"Requested: {count - len(picked)}, Available: {len(available)}"
                )
            aligned, unaligned, no_affinity = self._filter_by_affinity_locked(resource, available, numa_hint)
            pending = self._pending.setdefault(resource, set())

        def take_locked(candidates: Iterable[str]) -> bool:
            """allocateRemainingFrom: True once nothing more is needed."""
            in_use = self._in_use_locked(resource)
            for dev in self._order(set(candidates).difference(picked), order):
                if len(picked) >= count:
                    break
                if dev in in_use:
                    continue  # taken by a concurrent allocation meanwhile
                picked.append(dev)
                pending.add(dev)
            return len(picked) >= count

        preferred: tuple[str, ...] | None = None
        preferred_seconds: float | None = None
        try:
            if len(picked) >= count:
                done = True
            elif count < len(aligned):
                with self._lock:
                    offer = self._order(aligned | set(picked), order)
                preferred, preferred_seconds = self._call_preferred(ep, offer, list(picked), count)
                with self._lock:
                    done = take_locked(set(preferred or ()) & aligned) or take_locked(aligned)
            else:
                with self._lock:
                    done = take_locked(aligned)
                if not done:
                    with self._lock:
                        offer = self._order(available | set(picked), order)
                        must = self._order(picked, order)
                    preferred, preferred_seconds = self._call_preferred(ep, offer, must, count)
                    with self._lock:
                        done = (
                            take_locked(set(preferred or ()) & available)
                            or take_locked(unaligned)
                            or take_locked(no_affinity)
                        )
            if not done:
                raise AllocationError(
                    f"unexpectedly allocated less resources than required. Requested: {count}, Got: {len(picked)}"
                )

            with self._lock:
                device_ids = self._order(picked, order)  # the kubelet sends set.UnsortedList()
            request = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=device_ids)])
            if ep.stopped:
                raise PluginRPCError("Allocate", None, f"endpoint {resource} has been stopped")
            t0 = time.monotonic()
            try:
                resp = ep.stub.Allocate(request, timeout=self.rpc_timeout)
            except grpc.RpcError as err:
                code, details = _rpc_error_parts(err)
                raise PluginRPCError("Allocate", code, details) from err
            except ValueError as err:  # channel closed under us
                raise PluginRPCError("Allocate", None, f"endpoint {resource} has been stopped: {err}") from err
            allocate_seconds = time.monotonic() - t0
            if len(resp.container_responses) == 0:
                raise PluginRPCError("Allocate", None, f"no containers return in allocation response {resp}")
            container_resp = resp.container_responses[0]
        except BaseException:
            with self._lock:
                pending.difference_update(picked)
            raise

        with self._cond:
            pending.difference_update(picked)
            devs = self._devices.get(resource, {})
            per_numa: dict[int, list[str]] = {}
            for dev in device_ids:
                state = devs.get(dev)
                for n in state.numa_nodes if state and state.numa_nodes else (NODE_WITHOUT_TOPOLOGY,):
                    per_numa.setdefault(n, []).append(dev)
            info = self._pods.get(pod_uid)
            if info is None:
                info = _PodInfo(pod_name or pod_uid, namespace or "default")
                self._pods[pod_uid] = info
            else:
                if pod_name:
                    info.name = pod_name
                if namespace:
                    info.namespace = namespace
            record = AllocationRecord(
                pod_uid=pod_uid,
                container_name=container_name,
                resource=resource,
                device_ids=tuple(device_ids),
                devices_per_numa={n: tuple(v) for n, v in per_numa.items()},
                response=container_resp,
                timings=AllocationTimings(started, time.monotonic(), preferred_seconds, allocate_seconds),
                preferred=preferred,
                pod_name=info.name,
                namespace=info.namespace,
                init_container=init_container,
            )
            self._allocations[key] = record
            self._pod_resources_version += 1
            reusable = self._reusable.setdefault((pod_uid, resource), set())
            if init_container:
                reusable.update(device_ids)
            else:
                reusable.difference_update(device_ids)
            checkpoint = self._checkpoint_locked() if write else None
        self._write_checkpoint(checkpoint)
        with self._cond:
            self._cond.notify_all()
        logger.info("allocated %s x%d to %s/%s: %s", resource, count, pod_uid, container_name, ", ".join(device_ids))
        return record

    def _expire_stopped(self) -> None:
        """Forget the resources whose endpoint stopped more than ``endpoint_stop_grace`` seconds ago (the
        kubelet's GetCapacity, on its next node status update, writing the checkpoint without them)."""
        now = time.monotonic()
        with self._cond:
            gone = [
                res
                for res, ep in self._endpoints.items()
                if ep.stopped_at is not None and now - ep.stopped_at > self.endpoint_stop_grace
            ]
            for res in gone:
                del self._endpoints[res]
                self._devices.pop(res, None)
                self._history.setdefault(res, []).append(
                    DeviceUpdate(now, "expired", {}, None, f"endpoint stopped over {self.endpoint_stop_grace:g} s ago")
                )
            checkpoint = self._checkpoint_locked() if gone else None
        self._write_checkpoint(checkpoint)
        if gone:
            logger.info("forgot resource(s) %s: their endpoint stopped long ago", ", ".join(gone))

    def pre_start(self, resource: str, *, pod_uid: str, container_name: str) -> bool:
        """Call PreStartContainer (30 s deadline) if the plugin asked for it; return whether it did.

        Raises :class:`KubeletSimError` when the container holds no devices of ``resource`` or the
        endpoint is gone, and :class:`PluginRPCError` when the call fails. A resource the kubelet
        neither has registered nor allocated (its checkpoint lost, the plugin not back yet) is skipped.
        """
        with self._lock:
            ep = self._endpoints.get(resource)
            if ep is None:
                if resource not in self._devices and not any(k[2] == resource for k in self._allocations):
                    # isDevicePluginResource: neither registered nor allocated (a restarted kubelet whose
                    # checkpoint was lost, before the plugin registers): the resource is skipped.
                    return False
                raise KubeletSimError(f"endpoint not found in cache for a registered resource: {resource}")
            if ep.options is None or not ep.options.pre_start_required:
                return False
            rec = self._allocations.get((pod_uid, container_name, resource))
            if rec is None:
                raise KubeletSimError(
                    f"no devices found allocated in local cache for pod {pod_uid}, "
                    f"container {container_name}, resource {resource}"
                )
            if ep.stopped:
                raise PluginRPCError("PreStartContainer", None, f"endpoint {resource} has been stopped")
            ids = list(rec.device_ids)
            self._pre_start_calls.append((resource, pod_uid, container_name, tuple(ids)))
        try:
            ep.stub.PreStartContainer(pb.PreStartContainerRequest(devices_ids=ids), timeout=self.pre_start_timeout)
        except grpc.RpcError as err:
            code, details = _rpc_error_parts(err)
            raise PluginRPCError("PreStartContainer", code, details) from err
        except ValueError as err:  # channel closed under us
            raise PluginRPCError("PreStartContainer", None, f"endpoint {resource} has been stopped") from err
        return True

    def remove_pod(self, pod_uid: str) -> bool:
        """Forget the pod's devices (they become available) and rewrite the checkpoint."""
        with self._cond:
            keys = [k for k in self._allocations if k[0] == pod_uid]
            freed = [dev for k in keys for dev in self._allocations[k].device_ids]
            fresh = set(freed)
            self._freed = (freed + [d for d in self._freed if d not in fresh])[:4096]
            for k in keys:
                if self.keep_departed_in_checkpoint:
                    self._departed[k] = self._allocations[k]
                del self._allocations[k]
            self._pod_resources_version += 1
            for reuse_key in [rk for rk in self._reusable if rk[0] == pod_uid]:
                del self._reusable[reuse_key]
            known = self._pods.pop(pod_uid, None) is not None
            checkpoint = self._checkpoint_locked() if keys and not self.keep_departed_in_checkpoint else None
        self._write_checkpoint(checkpoint)
        with self._cond:
            self._cond.notify_all()
        return bool(keys) or known

    # ---------------------------------------------------------------- checkpoint

    def checkpoint_entries(self) -> list[CheckpointEntry]:
        """The checkpoint's ``PodDeviceEntries`` as they would be written now."""
        with self._lock:
            return self._checkpoint_entries_locked()

    def _checkpoint_entries_locked(self) -> list[CheckpointEntry]:
        # Each record's entry is made once (records are replaced, never changed): the kubelet spends
        # microseconds on what took this simulator milliseconds per write with a few hundred pods.
        made = self._entries_made
        entries = []
        departed = [(k, a) for k, a in self._departed.items() if k not in self._allocations]
        for key, a in [*self._allocations.items(), *departed]:
            known = made.get(key)
            if known is None or known[0] is not a:
                entry = CheckpointEntry(
                    pod_uid=a.pod_uid,
                    container_name=a.container_name,
                    resource_name=a.resource,
                    device_ids={n: list(v) for n, v in a.devices_per_numa.items()},
                    alloc_resp=a.response.SerializeToString(),
                )
                known = made[key] = (a, entry)
            entries.append(known[1])
        if len(made) > 2 * len(self._allocations) + 64:
            self._entries_made = {
                k: v for k, v in made.items() if (self._allocations.get(k) or self._departed.get(k)) is v[0]
            }
        return entries

    def _checkpoint_locked(self) -> _CheckpointData | None:
        """The checkpoint's content now (lock held), for :meth:`_write_checkpoint` once the lock is
        released: as in the kubelet, whose mutex covers taking the data but not writing the file."""
        if not self._write_enabled:
            return None
        # The healthy devices in natural order, sorted again only when a device list changed (each update
        # replaces its resource's dict): on 16 GPUs that is 10,000 IDs, sorted under the lock on every
        # allocation, which held up PodResources answers for hundreds of ms during a burst.
        made = self._registered_made
        if len(made[0]) != len(self._devices) or any(
            devs is not seen for devs, seen in zip(self._devices.values(), made[0], strict=False)
        ):
            registered = {
                res: sorted((i for i, d in devs.items() if d.healthy), key=_natural_key)
                for res, devs in self._devices.items()
            }
            made = self._registered_made = (tuple(self._devices.values()), registered)
        registered = made[1]
        self._checkpoint_taken += 1
        return _CheckpointData(self._checkpoint_taken, self._checkpoint_entries_locked(), registered)

    def _write_checkpoint(self, data: _CheckpointData | None) -> None:
        """Write ``data`` unless a newer state is on disk already (writers race outside the lock)."""
        if data is None:
            return
        wrote = False
        with self._checkpoint_file_lock:
            if data.sequence > self._checkpoint_written:
                try:
                    self._checkpoint_writer.write(self.checkpoint_path, data.entries, data.registered)
                    self._checkpoint_written = data.sequence
                    wrote = True
                except OSError as err:
                    logger.warning("cannot write %s: %s", self.checkpoint_path, err)
        with self._lock:
            self._checkpoint_writes += wrote
            self._checkpoint_done = max(self._checkpoint_done, data.sequence)

    def write_checkpoint(self) -> Path:
        """Write the V2 checkpoint now (it is also written on every update and allocation)."""
        with self._lock:
            data = self._checkpoint_locked()
        self._write_checkpoint(data)
        return self.checkpoint_path

    # ---------------------------------------------------------------- PodResources source

    def pod_resources_snapshot(self, namespace: str | None = None, name: str | None = None) -> list[PodSnapshot]:
        """Pods with their containers' devices, for the PodResources server (one pod when named, as ``Get``).

        Every pod: the same list (not to be changed) while no allocation or pod changed, which lets the
        server answer ``List`` from the message it made for it (the kubelet's answer costs it well under
        a millisecond; building it again in Python took this simulator ~10 ms with 250 pods)."""
        with self._lock:
            if name is None and self._pod_resources[0] == self._pod_resources_version:
                return self._pod_resources[1]
            wanted: set[str] | None = None
            if name is not None:
                wanted = {uid for uid, info in self._pods.items() if info.name == name and info.namespace == namespace}
            records: dict[str, list[AllocationRecord]] = {}
            for a in self._allocations.values():
                # The kubelet lists a pod's app containers and its sidecars, never its other init containers.
                if (wanted is None or a.pod_uid in wanted) and not a.init_container:
                    records.setdefault(a.pod_uid, []).append(a)
            made = self._pod_snapshots
            out = []
            for uid, held in records.items():
                info = self._pods.get(uid, _PodInfo(uid, "default"))
                known = made.get(uid)
                # A pod whose records (replaced, never changed) and names are the ones seen last time keeps
                # its snapshot, and so the message the server made for it.
                if (
                    known is None
                    or known[0] != (info.name, info.namespace)
                    or len(known[1]) != len(held)
                    or any(x is not y for x, y in zip(known[1], held, strict=True))
                ):
                    known = made[uid] = ((info.name, info.namespace), tuple(held), _pod_snapshot(uid, info, held))
                out.append(known[2])
            if len(made) > 2 * len(records) + 64 and name is None:
                self._pod_snapshots = {uid: made[uid] for uid in records}
            if name is None:
                self._pod_resources = (self._pod_resources_version, out)
            return out

    def allocatable_snapshot(self) -> list[DeviceSnapshot]:
        """Every healthy device of every resource, for ``GetAllocatableResources``."""
        with self._lock:
            return [
                DeviceSnapshot(res, d.id, d.numa_nodes)
                for res in sorted(self._devices)
                for d in sorted(self._devices[res].values(), key=lambda s: _natural_key(s.id))
                if d.healthy
            ]


def _pod_snapshot(uid: str, info: _PodInfo, records: list[AllocationRecord]) -> PodSnapshot:
    """One pod's devices as PodResources reports them, from its allocation records in allocation order."""
    containers: dict[str, list[DeviceSnapshot]] = {}
    for a in records:
        devs = containers.setdefault(a.container_name, [])
        nodes_of: dict[str, list[int]] = {}
        for n, ids in a.devices_per_numa.items():
            for i in ids:
                nodes_of.setdefault(i, []).append(n)
        for i in a.device_ids:
            numa = tuple(sorted(n for n in nodes_of.get(i, []) if n != NODE_WITHOUT_TOPOLOGY))
            devs.append(DeviceSnapshot(a.resource, i, numa))
    return PodSnapshot(
        uid=uid,
        name=info.name,
        namespace=info.namespace,
        containers=tuple(ContainerSnapshot(c, tuple(d)) for c, d in containers.items()),
    )


# --------------------------------------------------------------------------------------------
# process entry point


def main(argv: Sequence[str] | None = None) -> int:
    """Run a kubelet simulator until SIGTERM/SIGINT, logging registrations and device counts."""
    parser = argparse.ArgumentParser(prog="python -m simnode.kubelet", description="Kubelet device-manager simulator.")
    parser.add_argument("--plugin-dir", required=True, type=Path, help="device-plugin directory")
    parser.add_argument("--pod-resources-socket", type=Path, default=None, help="serve PodResources v1 here")
    parser.add_argument("--dial-timeout", type=float, default=DEFAULT_DIAL_TIMEOUT)
    parser.add_argument("--fill", choices=("random", "sorted"), default="random")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--status-interval", type=float, default=30.0, help="seconds between summaries")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        logger.info("received signal %d, stopping", signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    sim = KubeletSimulator(
        args.plugin_dir,
        pod_resources_socket=args.pod_resources_socket,
        dial_timeout=args.dial_timeout,
        fill=args.fill,
        seed=args.seed,
    )
    sim.start()
    next_status = time.monotonic() + args.status_interval
    try:
        # Wait in short slices: the signal may land on a gRPC thread, and Python runs the handler
        # on the main thread only once it wakes up.
        while not stop.wait(0.2):
            if time.monotonic() < next_status:
                continue
            next_status = time.monotonic() + args.status_interval
            for res in sim.resources():
                devs = sim.devices(res)
                healthy = sum(1 for d in devs.values() if d.healthy)
                logger.info("%s: %d devices, %d healthy", res, len(devs), healthy)
    finally:
        sim.stop()
    return 0


if __name__ == "__main__":
    # Run the importable module's main so that classes and logger names are the package's own.
    from simnode import kubelet as _kubelet

    raise SystemExit(_kubelet.main())
