"""DRA mode as one object the agent starts instead of the device-plugin servers.

It owns the claim preparer, the ResourceSlice publisher, the kubelet-facing sockets and
the health feed; it reads the agent's shared pieces (GPUs, topology, health monitor,
allocator, pod cache, driver mirror paths) and writes into the same allocation state.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpumanager import names
from gpumanager.allocation.allocator import Allocator
from gpumanager.allocation.claims import ClaimAllocation
from gpumanager.allocation.pods import Pod
from gpumanager.allocation.records import ContainerAllocation
from gpumanager.api import dra_v1_pb2_grpc, dra_v1beta1_pb2_grpc, pluginregistration_v1_pb2_grpc
from gpumanager.device.health import HealthMonitor, HealthState
from gpumanager.device.types import GPUInfo, NodeTopology
from gpumanager.deviceplugin.dirlock import DirectoryLock
from gpumanager.dra import cdi, consumers, devices, sharing
from gpumanager.dra import constants as c
from gpumanager.dra.claims import ClaimError, ClaimNotFound
from gpumanager.dra.plugin import DRAPluginSockets, socket_paths
from gpumanager.dra.prepare import ClaimPreparer, api_reader
from gpumanager.dra.publisher import SlicePublisher, gates_message
from gpumanager.dra.servicers import (
    DeviceHealthState,
    DRAPluginV1,
    DRAPluginV1beta1,
    HealthFeed,
    HealthServicer,
    RegistrationServicer,
    add_health_servicer,
)
from gpumanager.retry import Backoff
from gpumanager.vmanager import cgroups, files, restarts
from gpumanager.vmanager import claims as claim_files
from gpumanager.vmanager.unwritable import UnwritableFiles

if TYPE_CHECKING:
    from gpumanager.config import Config

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DRASettings:
    """Flags of DRA mode."""

    driver: str
    plugin_registry_path: str
    plugin_path: str
    cdi_root: str
    sysfs_root: str = "/sys"
    watch_period: float = 0.1
    #: How often the kubelet's health stream gets every device's health again (the GPU probe period).
    health_report_period: float = 1.0
    #: How long the kubelet may take to register the driver once its sockets are served before that is
    #: logged and reported (--wait-timeout); 0: never.
    registration_wait: float = 0.0
    #: How long a prepared claim must have been used by no pod of the node (seen so at each periodic check)
    #: before the API server is asked whether it is gone (two --allocation-check-period).
    leak_grace: float = 60.0
    #: How long the kubelet may refuse the driver's registration, or its sockets stay unserved, before the
    #: ResourceSlice is withdrawn (two passes of the sockets' watch, at least 1 s).
    withdraw_grace: float = 10.0

    @classmethod
    def from_config(cls, cfg: Config) -> DRASettings:
        """The settings the agent's flags give."""
        return cls(
            driver=cfg.dra_driver_name,
            plugin_registry_path=cfg.plugin_registry_path,
            plugin_path=str(cfg.dra_socket_dir),
            cdi_root=cfg.cdi_root,
            sysfs_root=cfg.sysfs_root,
            watch_period=cfg.kubelet_watch_period,
            health_report_period=cfg.health_probe_period,
            registration_wait=cfg.wait_timeout,
            leak_grace=2.0 * cfg.allocation_check_period,
            withdraw_grace=max(1.0, 2.0 * cfg.kubelet_watch_period),
        )


#: What NVML lists running on each GPU asked about (by the agent's index): the PIDs (0 for each process it shows
#: without one), or why that cannot be told.
GPUProcesses = Callable[[Sequence[int]], Mapping[int, tuple[int, ...] | str]]


def nvml_processes(indexes: Sequence[int]) -> dict[int, tuple[int, ...] | str]:
    """What NVML lists running on each GPU of ``indexes`` (compute and graphics processes), or why that cannot be
    told: NVML answers an error for the GPU, or does not answer within the bound of the agent's NVML reads (a GPU
    stuck in a reset; not asked again until that read returns). A lost GPU runs nothing: its processes' contexts
    end with the reset that brings it back."""
    from gpumanager.device import nvml, usage
    from gpumanager.metrics.bounded import DEADLINE, NVML

    def read(index: int) -> tuple[int, ...] | str:
        try:
            return usage.running_pids(index)
        except nvml.NVMLError as exc:
            return () if nvml.is_gpu_lost(exc) else f"NVML answers {exc}"

    got = NVML.per_gpu(list(indexes), read)
    return {i: got.get(i, f"NVML has not answered for it within {DEADLINE:g} s") for i in indexes}


def _rfc3339(unix: float) -> str:
    return datetime.datetime.fromtimestamp(unix, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def taints(health: HealthMonitor | None) -> dict[int, devices.Taint]:
    """The unhealthy GPUs as slice taints (cause and since when)."""
    if health is None:
        return {}
    now_mono, now_unix = time.monotonic(), time.time()
    out = {}
    for index, state in health.snapshot().items():
        if not state.healthy:
            out[index] = devices.Taint(state.reason or "unhealthy", _rfc3339(now_unix - (now_mono - state.since)))
    return out


def make_publisher(
    api_client: Any,
    *,
    settings: DRASettings,
    node: str,
    gpus: Sequence[GPUInfo],
    topology: NodeTopology,
    health: HealthMonitor | None,
    report: Callable[[str, str | None], None],
) -> SlicePublisher:
    """The node's ResourceSlice publisher (started early: the slice needs only the GPUs and their health)."""

    def content(generation: int) -> dict[str, Any]:
        return devices.slice_spec(
            node=node,
            driver=settings.driver,
            gpus=gpus,
            topology=topology,
            taints=taints(health),
            generation=generation,
            sysfs_root=Path(settings.sysfs_root),
        )

    return SlicePublisher(
        api_client,
        node=node,
        driver=settings.driver,
        content=content,
        on_error=lambda m: report("resourceslice", m),
        on_ok=lambda: report("resourceslice", None),
        on_gates=lambda gates: report(
            "resourceslice-fields", gates_message(c.slice_name(node, settings.driver), gates) or None
        ),
    )


def _processes(pids: Sequence[int]) -> str:
    """The processes NVML lists, as the log names them (0: a process NVML shows without its PID)."""
    seen = [pid for pid in pids if pid > 0]
    hidden = len(pids) - len(seen)
    parts = []
    if seen:
        parts.append(
            f"process{'es' if len(seen) > 1 else ''} {', '.join(map(str, seen[:3]))}{' ...' if len(seen) > 3 else ''}"
        )
    if hidden:
        parts.append(
            f"{hidden} process{'es' if hidden > 1 else ''} with no PID (of a PID namespace the agent does not see: "
            "it runs without hostPID?)"
        )
    return " and ".join(parts)


class DRAMode:
    """The DRA face of the agent."""

    def __init__(
        self,
        *,
        settings: DRASettings,
        node: str,
        gpus: Sequence[GPUInfo],
        topology: NodeTopology,
        health: HealthMonitor | None,
        allocator: Allocator,
        api_client: Any,
        pods: Callable[[], list[Pod]],
        pod: Callable[[str], Pod | None],
        cdi_settings: cdi.CDISettings,
        vm_path: Path,
        cgroup_root: Path,
        driver_version: str,
        observe: Callable[[str, float, bool], None],
        report: Callable[[str, str | None], None],
        publisher: SlicePublisher | None = None,
        pods_synced: Callable[[], bool] = lambda: True,
        proc_root: Path = Path("/proc"),
        gpu_processes: GPUProcesses | None = None,
        dir_lock: DirectoryLock | None = None,
    ) -> None:
        """``dir_lock``: the agent's lock on --dra-plugin-path, moved with the directory made again
        (:class:`DRAPluginSockets`)."""
        self.settings = settings
        self.node = node
        self.pool = node
        self._gpus = list(gpus)
        self._topology = topology
        self._health = health
        self._allocator = allocator
        self._pods = pods
        # Whether ``pods`` has listed the node's pods (before, it holds none: which containers use a
        # claim is not known, and their pids.config files are left as they are).
        self._pods_synced = pods_synced
        self._pod = pod
        self._vm = vm_path
        self._cgroups = cgroups.CgroupLocator(cgroup_root)
        self._report = report
        self._started_unix = time.time()
        self._last_pids: dict[str, list[int]] = {}
        self._unwritable = UnwritableFiles()  # claims' pids.config the refresh cannot write (reported)
        # Feature gates kube-scheduler has off, as seen at Prepare (claims allocated without the capacity
        # they ask for), and what was reported for it.
        self.scheduler_gates_off: frozenset[str] = frozenset()
        self._capacity_problem: str | None = None
        # Containers of pods that joined prepared claims later, using a share and another claim (reported).
        self._mixed: dict[tuple[str, str], str] = {}
        # The pods each claim was seen reserved for: which prepared claim a pod's claim name means.
        self.reservations = consumers.Reservations()
        self._asked: set[tuple[str, str, frozenset[str]]] = set()  # (namespace, name, pods) read for that
        # Prepared claims no pod of the node used at the last periodic checks: UID -> since when (monotonic).
        self._unused_since: dict[str, float] = {}
        # Prepared claim UID -> the pods seen naming it: a claim whose pod's cgroup is still there (a pod
        # force-deleted while the kubelet was down: its containers run until the kubelet is back) is not freed.
        self._users: dict[str, set[str]] = {}
        self._cgroup_root = cgroup_root
        self._proc_root = proc_root  # the host's /proc (hostPID): whether a claim's listed processes live
        # What runs on the GPUs (NVML): a whole-GPU claim's GPU is its own, so what runs there is its containers'.
        self._gpu_processes = gpu_processes
        self._kept_said: dict[str, str] = {}  # unused claim UID -> why it was last said kept
        self.leaked_freed = 0  # claims freed by :meth:`free_leaked` (gpu_manager_dra_leaked_claims_freed_total)
        read_pod: Callable[[str, str], dict[str, Any] | None] = sharing.no_pod
        if api_client is not None:
            api_read = api_reader(api_client)
            read_pod = sharing.api_pod_reader(api_client)

            def reader(namespace: str, name: str) -> dict[str, Any]:
                data = api_read(namespace, name)
                self.reservations.saw(data)
                return data

        else:

            def reader(namespace: str, name: str) -> dict[str, Any]:
                raise ClaimError(f"claim {namespace}/{name}: no API server is configured (--kubeconfig)")

        self._read_claim = reader

        self.preparer = ClaimPreparer(
            read_claim=reader,
            allocator=allocator,
            gpus=self._gpus,
            driver=settings.driver,
            pool=self.pool,
            cdi_settings=cdi_settings,
            vm_path=vm_path,
            driver_version=driver_version,
            sharing_check=sharing.SharingCheck(
                driver=settings.driver,
                pool=self.pool,
                gpus=self._gpus,
                pod_by_uid=pod,
                read_pod=read_pod,
                read_claim=reader,
                prepared=self._prepared_for,
            ),
            taints=self._taint_values,
            capacity_seen=self._capacity_seen,
            # A claim in doubt (a damaged checkpoint) found released is freed by the periodic check's rule: once
            # nothing of its containers runs.
            running=self._running,
        )
        self.publisher = publisher
        if publisher is None and api_client is not None:
            self.publisher = make_publisher(
                api_client, settings=settings, node=node, gpus=gpus, topology=topology, health=health, report=report
            )
        self.feed = HealthFeed(self.pool, self.health_states, settings.health_report_period)
        self._reconciler: threading.Thread | None = None  # the background check of restored claims
        # Since when (monotonic) the kubelet refuses the driver or its sockets are not served (None: they are),
        # and why the ResourceSlice is withdrawn for it ('' while it is not).
        self._unserving_since: float | None = None
        self.slice_withdrawn = ""
        self._serving_lock = threading.Lock()
        self._stopping = threading.Event()
        reg_sock, dra_sock = socket_paths(settings.plugin_registry_path, settings.plugin_path, settings.driver)
        v1 = DRAPluginV1(self.preparer, observe)
        v1beta1 = DRAPluginV1beta1(self.preparer, observe)
        health_servicer = HealthServicer(self.feed)
        self.sockets = DRAPluginSockets(
            registration_socket=reg_sock,
            service_socket=dra_sock,
            register_registration=lambda s: pluginregistration_v1_pb2_grpc.add_RegistrationServicer_to_server(
                RegistrationServicer(settings.driver, str(dra_sock), self._on_registration), s
            ),
            register_services=[
                lambda s: dra_v1_pb2_grpc.add_DRAPluginServicer_to_server(v1, s),
                lambda s: dra_v1beta1_pb2_grpc.add_DRAPluginServicer_to_server(v1beta1, s),
                lambda s: add_health_servicer(health_servicer, s),
            ],
            watch_period=settings.watch_period,
            dir_lock=dir_lock,
            registration_wait=settings.registration_wait,
            on_overdue=self._registration_overdue,
            on_pass=self.check_serving,
        )

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        """Restore claim files, publish the slice, serve the sockets; then, in the background, check the
        claims the checkpoint could not vouch for against the API server (which may hang: the
        kubelet is served meanwhile)."""
        self.preparer.restore_local()
        self._name_other_pools()
        self._reconciler = threading.Thread(
            target=self._reconcile, args=(self._allocator.claims_in_doubt,), name="dra-reconcile", daemon=True
        )
        if self.publisher is not None:
            self.publisher.start()
        else:
            self._report("resourceslice", "no API server (--kubeconfig): the ResourceSlice cannot be published")
        self.sockets.start()
        if self._health is not None:
            self._health.add_listener(self.on_health_change)
        self._reconciler.start()

    def _name_other_pools(self) -> None:
        """Said once at the start: the prepared claims whose results name another pool than this node's
        (the node's name when they were prepared: the node was renamed). Nothing about them changes:
        they stay prepared, their GPUs held and their limits enforced, until the kubelet unprepares
        them; new claims are prepared from this node's pool only."""
        other = {
            f"{claim.key} ({claim.uid}): pool {', '.join(repr(p) for p in pools)}": claim
            for claim in self._allocator.claims()
            if (pools := sorted({d.pool for d in claim.devices if d.pool != self.pool}))
        }
        if not other:
            return
        log.warning(
            "%d prepared claims were recorded under another pool than this node's (%r), the node's name when "
            "they were prepared (the node was renamed?): %s; they stay prepared, their GPUs held and their limits "
            "enforced, until the kubelet unprepares them; new claims must name pool %r",
            len(other),
            self.pool,
            "; ".join(sorted(other)),
            self.pool,
        )

    def _reconcile(self, verify_recovered: bool) -> None:
        """Check the restored claims; then, with backoff, try again the claims whose rebuild could not
        ask the API server, until each is rebuilt or removed, and the claims whose check did not conclude
        (still in doubt), until each is kept or freed (or the mode stops)."""
        try:
            stale = self.preparer.reconcile(verify_recovered=verify_recovered)
        except Exception:
            log.exception("checking the restored claims against the API server failed")
            stale = []
        if stale:
            log.info("removed the files of %d claims that are not prepared", len(stale))
        delay = Backoff()
        while self.preparer.unreadable() or self.preparer.unchecked():
            if delay.wait(self._stopping):
                return
            try:
                left = self.preparer.retry_unreadable()
            except Exception:
                log.exception("rebuilding the claims the API server could not be asked about failed")
                continue
            if left:
                log.info("%d claims with files but no record still wait for the API server", left)

    def reconciled(self, timeout: float | None = None) -> bool:
        """Wait for the background check of the restored claims; whether it is done."""
        if self._reconciler is None:
            return True
        self._reconciler.join(timeout)
        return not self._reconciler.is_alive()

    def stop(self) -> None:
        """Stop serving (prepared claims and their files stay: containers still use them)."""
        self._stopping.set()
        self.feed.close()
        if self.publisher is not None:
            self.publisher.stop()
        self.sockets.stop()

    def _on_registration(self, registered: bool, error: str) -> None:
        self.sockets.on_status(registered, error)
        self._report("dra-registration", None if registered else f"kubelet refused the DRA registration: {error}")
        self.check_serving()

    def _serving_problem(self) -> str:
        """Why the kubelet cannot call the driver now ('' when it can, or may: registered or waiting for it)."""
        if self.sockets.unserved:
            return f"the DRA sockets cannot be served ({self.sockets.unserved})"
        if self.sockets.state.last_error:
            return f"the kubelet refuses to register DRA driver {self.settings.driver}: {self.sockets.state.last_error}"
        return ""

    def check_serving(self) -> None:
        """Withdraw the ResourceSlice while the kubelet refuses the driver's registration or its sockets cannot be
        served, once that has lasted ``withdraw_grace`` seconds (a kubelet restart serves and registers them again
        sooner); publish it again once they are served and no refusal stands. Each change is logged. Called after
        each pass of the sockets' watch and at each registration status."""
        problem = self._serving_problem()
        name = c.slice_name(self.node, self.settings.driver)
        with self._serving_lock:
            if not problem:
                self._unserving_since = None
                if not self.slice_withdrawn:
                    return
                log.info(
                    "publishing ResourceSlice %s again: the DRA driver is served and not refused now (it was withdrawn "
                    "because %s)",
                    name,
                    self.slice_withdrawn.partition(" withdrawn: ")[2],
                )
                self.slice_withdrawn = ""
                if self.publisher is not None:
                    self.publisher.release()
                return
            now = time.monotonic()
            if self._unserving_since is None:
                self._unserving_since = now
            if self.slice_withdrawn or now - self._unserving_since < self.settings.withdraw_grace:
                return
            self.slice_withdrawn = f"ResourceSlice {name} withdrawn: {problem}"
            log.warning(
                "withdrawing ResourceSlice %s: %s (for %.0f s), so no claim can be prepared here; none of this node's "
                "GPUs is offered until the driver is served and registered again",
                name,
                problem,
                now - self._unserving_since,
            )
            if self.publisher is not None:
                self.publisher.hold(self.slice_withdrawn)

    def not_registered(self, within: str = "") -> str:
        """Why the kubelet has not registered the driver (what /readyz and the overdue line say); ``within``
        follows the driver's name."""
        sockets = self.sockets
        driver = self.settings.driver
        if sockets.state.last_error:
            return f"the kubelet refused to register DRA driver {driver}{within}: {sockets.state.last_error}"
        return (
            f"not registered with the kubelet as DRA driver {driver}{within}: no registration through "
            f"{sockets.registration_socket} has completed (the kubelet's plugin watcher finds that socket only in "
            "its plugins_registry directory, /var/lib/kubelet/plugins_registry by default, which "
            f"--plugin-registry-path must name); serving {sockets.service_socket} and waiting for the kubelet"
        )

    def _registration_overdue(self) -> None:
        """The kubelet has not registered the driver within --wait-timeout of serving its sockets: said once
        (a refusal was said when it came), reported until it registers the driver."""
        if self.sockets.state.last_error:
            return
        self._report(
            "dra-registration", self.not_registered(f" within --wait-timeout={self.settings.registration_wait:g}s")
        )

    def on_health_change(self, index: int, state: HealthState) -> None:
        """A GPU's health changed: taint or untaint it, tell the kubelet's health stream."""
        if self.publisher is not None:
            self.publisher.changed()
        self.feed.changed()

    # -- views ----------------------------------------------------------------------------------

    def health_states(self) -> list[DeviceHealthState]:
        """Every device's health for the kubelet's health stream."""
        snapshot = self._health.snapshot() if self._health is not None else {}
        now_mono, now_unix = time.monotonic(), time.time()
        out = []
        for g in self._gpus:
            state = snapshot.get(g.index)
            healthy = state is None or state.healthy
            updated = now_unix - (now_mono - state.since) if state is not None else self._started_unix
            out.append(
                DeviceHealthState(
                    c.device_name(g.index), healthy, "" if healthy else (state.reason if state else ""), updated
                )
            )
        return out

    def _taint_values(self) -> dict[int, str]:
        """The unhealthy taint's value on each tainted GPU, by minor (as the slice publishes it)."""
        minors = {g.index: g.minor for g in self._gpus}
        return {minors[i]: devices.taint_value(t.reason) for i, t in taints(self._health).items() if i in minors}

    def claims(self) -> list[ClaimAllocation]:
        """Prepared claims."""
        return self._allocator.claims()

    def _prepared_for(self, namespace: str, name: str, pod_uid: str) -> ClaimAllocation | None:
        """The prepared claim ``namespace/name`` seen reserved for pod ``pod_uid`` (None: none was)."""
        reserved = self.reservations.snapshot()
        return next(
            (
                c
                for c in self._allocator.claims()
                if c.namespace == namespace and c.name == name and pod_uid in reserved.get(c.uid, ())
            ),
            None,
        )

    def reserved(self) -> consumers.Reserved:
        """Claim UID -> the pods it was seen reserved for (what :func:`consumers.consumers` joins by)."""
        return self.reservations.snapshot()

    def container_allocations(self) -> list[ContainerAllocation]:
        """Containers using prepared claims, as allocations (for /usage and the container metrics)."""
        return consumers.container_allocations(self.claims(), self._pods(), self.reserved())

    def _tell_apart(self, claims: Sequence[ClaimAllocation], pods: Sequence[Pod]) -> None:
        """Where several prepared claims have one name (one deleted and made again while still prepared)
        and a pod using that name was never seen reserved in one of them (it joined after the Prepare, or
        the agent restarted), read the claim of that name the API server has now: the pods it is reserved
        for are its own; with exactly one other claim of that name prepared, the rest are that one's."""
        reserved = self.reservations.snapshot()
        wanted = consumers.unowned(claims, pods, reserved)
        keys = {(ns, name, frozenset(uids)) for (ns, name), uids in wanted.items()}
        self._asked &= keys
        for (namespace, name), uids in wanted.items():
            key = (namespace, name, frozenset(uids))
            if key in self._asked:
                continue
            try:
                data: dict[str, Any] | None = self._read_claim(namespace, name)
            except ClaimNotFound:
                data = None
            except ClaimError as exc:
                log.debug("cannot tell which claim %s/%s pods %s use: %s", namespace, name, uids, exc)
                continue
            self._asked.add(key)
            current = consumers.reserved_pods(data)[0] if data is not None else ""
            group = [c for c in claims if (c.namespace, c.name) == (namespace, name)]
            rest = [c for c in group if c.uid != current]
            now = self.reservations.snapshot().get(current, frozenset())
            left = {u for u in uids if u not in now}
            if left and len(rest) == 1 and len(group) == len(rest) + 1:
                self.reservations.add(rest[0].uid, left)
                log.info(
                    "claims %s/%s %s are prepared: pods %s use %s (the API server's claim of that name, %s, is "
                    "reserved for other pods)",
                    namespace,
                    name,
                    ", ".join(c.uid for c in group),
                    ", ".join(sorted(left)),
                    rest[0].uid,
                    current,
                )
            elif left:
                log.warning(
                    "claims %s/%s %s are prepared; which of them pods %s use is not known: their containers' "
                    "processes are in neither's pids.config",
                    namespace,
                    name,
                    ", ".join(c.uid for c in group),
                    ", ".join(sorted(left)),
                )

    def refresh_pids(self) -> int:
        """Rewrite pids.config of every shared claim whose containers' processes changed.

        A file that cannot be written (a full disk, a read-only file system) is reported once and tried
        again at the next refresh; the other claims' files are still brought up to date. Until the pod
        cache has listed the node's pods nothing is written: the files keep the PIDs written before (by
        this agent before a restart), which an empty list of pods would wipe.
        """
        from gpumanager.allocation import pods as podinfo

        if not self._pods_synced():
            return 0
        written = 0
        live: set[str] = set()
        refreshed: set[Path] = set()
        pods = self._pods()
        claims = self.claims()
        self.reservations.prune({c.uid for c in claims})
        self._tell_apart(claims, pods)
        reserved = self.reserved()
        self._report_mixed(claims, pods, reserved)
        for claim in claims:
            if not claim.shared:
                continue
            live.add(claim.uid)
            directory = claim_files.claim_dir(self._vm, claim.uid)
            path = directory / names.PIDS_CONFIG_FILE
            refreshed.add(path)
            pids: set[int] = set()
            users = consumers.consumers(claim, pods, claims, reserved)
            for pod, container in users:
                # A container that restarted is followed to its new cgroup before its status names it.
                pids.update(restarts.container_pids(self._cgroups, pod, container))
            if claim.per_request:
                self._write_request_pids(claim, users)
            if not users:
                # No pod the cache shows uses it (the agent restarted after its pod was force-deleted while the
                # kubelet was down, say): the processes the file lists that still run are kept in it.
                pids = set(self._alive(self._listed_pids(claim, requests=False)))
            ordered = sorted(pids)
            if self._last_pids.get(claim.uid) == ordered:
                continue
            if not directory.is_dir():
                continue
            try:
                claim_files.write_pids(self._vm, claim.uid, ordered)
            except FileNotFoundError:  # unprepared since it was looked at: its directory is not made again
                continue
            except OSError as exc:
                used_by = ", ".join(f"pod {podinfo.uid(pod)} container {container}" for pod, container in users)
                self._unwritable.failed(path, exc, f"claim {claim.key} ({claim.uid}; used by {used_by or 'none'})")
                continue
            self._unwritable.written(path)
            self._last_pids[claim.uid] = ordered
            written += 1
        for uid in [u for u in self._last_pids if u.partition("/")[0] not in live]:  # "<uid>/<request>" too
            del self._last_pids[uid]
        self._unwritable.forget_all_but(refreshed)
        return written

    def _in_use(self, claims: Sequence[ClaimAllocation], pods: Sequence[Pod]) -> set[str]:
        """UIDs of the prepared claims that a pod of the node that has not finished names (in
        ``spec.resourceClaims``, its generated claims, or the claim of its extended resources): the one of
        that name seen reserved for the pod, or, where that is not known, every prepared claim of the name."""
        from gpumanager.allocation import pods as podinfo

        reserved = self.reserved()
        used: set[str] = set()
        for pod in pods:
            if podinfo.is_terminated(pod):
                continue
            meta = pod.get("metadata") or {}
            namespace, uid = str(meta.get("namespace", "")), podinfo.uid(pod)
            named = set(consumers.claim_names(pod).values())
            ext = (pod.get("status") or {}).get("extendedResourceClaimStatus")
            if isinstance(ext, dict) and ext.get("resourceClaimName"):
                named.add(str(ext["resourceClaimName"]))
            for name in named:
                owner = consumers.owner(uid, namespace, name, claims, reserved)
                users = (
                    [owner] if owner is not None else [c for c in claims if (c.namespace, c.name) == (namespace, name)]
                )
                for claim in users:
                    used.add(claim.uid)
                    self._users.setdefault(claim.uid, set()).add(uid)
        return used

    def _say_kept(self, uid: str, text: str) -> None:
        """Log why an unused claim is kept, once while the reason stays the same."""
        if self._kept_said.get(uid) != text:
            log.info("%s", text)
        self._kept_said[uid] = text

    def _running(self, claim: ClaimAllocation) -> tuple[list[str], list[str]]:
        """What still runs of the containers that used ``claim``: the pods seen naming it whose cgroup is still there,
        the processes its pids.config files list that are alive (after a restart of the agent the pods seen before
        are not known; a share claim's files still name their processes), and the processes NVML lists on the whole
        GPUs it holds (a whole GPU is the claim's alone: what runs there is its containers', whatever PID NVML shows
        it under; a whole-GPU claim has no pids.config). Then the GPUs of which NVML cannot tell what runs there."""
        out = []
        for uid in sorted(self._users.get(claim.uid, ())):
            try:
                if cgroups.pod_cgroups(self._cgroup_root, uid):
                    out.append(f"the cgroup of pod {uid} is still there")
            except OSError:  # cannot be looked at: as the allocation check, taken for gone
                continue
        alive = self._alive(self._listed_pids(claim))
        if alive:
            shown = ", ".join(map(str, alive[:3])) + (" ..." if len(alive) > 3 else "")
            out.append(f"process {shown} of its pids.config is alive")
        unknown = []
        for index, found in self._on_whole_gpus(claim).items():
            if isinstance(found, str):
                unknown.append(f"GPU {index}: {found}")
            elif found:
                out.append(f"NVML lists {_processes(found)} on GPU {index}, which the claim holds whole")
        return out, unknown

    def _on_whole_gpus(self, claim: ClaimAllocation) -> Mapping[int, tuple[int, ...] | str]:
        """What NVML lists running on the GPUs ``claim`` holds whole (not by admin access, which takes a GPU other
        claims hold too), by the agent's index; nothing for a share claim, whose GPU is shared."""
        if self._gpu_processes is None or claim.shared:
            return {}
        by_minor = {g.minor: g.index for g in self._gpus}
        owned = sorted({by_minor[d.minor] for d in claim.devices if d.whole and not d.admin and d.minor in by_minor})
        return self._gpu_processes(owned) if owned else {}

    def _alive(self, pids: list[int]) -> list[int]:
        return [pid for pid in pids if (self._proc_root / str(pid)).exists()]

    def _listed_pids(self, claim: ClaimAllocation, *, requests: bool = True) -> list[int]:
        """The PIDs the claim's pids.config files (its own and, with ``requests``, its requests') list; none
        from a file that cannot be read."""
        try:
            top = claim_files.claim_dir(self._vm, claim.uid)
        except ValueError:
            return []
        paths = [top / names.PIDS_CONFIG_FILE]
        if requests:
            paths.extend(top.glob(f"{claim_files.REQUEST_DIR_PREFIX}*/{names.PIDS_CONFIG_FILE}"))
        listed: set[int] = set()
        for path in paths:
            try:
                listed.update(pid for pid in files.read_pids(path) if pid > 0)
            except OSError:
                continue
        return sorted(listed)

    def free_leaked(self) -> list[str]:
        """Free the prepared claims the kubelet will never unprepare (its DRA state lost, or their pod
        force-deleted while it was down); returns their UIDs. Run at each periodic check.

        A claim no pod of the node that has not finished names, at every check for ``leak_grace`` seconds, is
        looked up on the API server; it is freed (its GPUs' capacity, its CDI spec and directory) only when the
        answer is positive: 404, or a claim of that name with another UID, no pod names it still, and no pod seen
        using it has its cgroup left (containers of a pod force-deleted while the kubelet was down run until the
        kubelet is back; after a restart of the agent, such pods are not known), no process its pids.config lists is
        alive, and NVML lists no process on a GPU it holds whole (nor fails to tell: the claim is then kept). An error
        or a timeout frees nothing (and the other claims wait for the next check). Nothing is looked at until
        the pod cache has listed the node's pods."""
        if not self._pods_synced():
            return []
        now = time.monotonic()
        claims = [c for c in self.claims() if not c.in_doubt]  # in doubt: the restart's check frees those
        # The pods seen using a claim in doubt are noted too: their cgroups keep it from that check (_running).
        used = self._in_use(self.claims(), self._pods())
        self._unused_since = {c.uid: self._unused_since.get(c.uid, now) for c in claims if c.uid not in used}
        prepared = {c.uid for c in self.claims()}
        self._users = {uid: pods for uid, pods in self._users.items() if uid in prepared}
        self._kept_said = {uid: text for uid, text in self._kept_said.items() if uid in self._unused_since}
        freed: list[str] = []
        for claim in claims:
            since = self._unused_since.get(claim.uid)
            if since is None or now - since < self.settings.leak_grace:
                continue
            try:
                data = self._read_claim(claim.namespace, claim.name)
            except ClaimNotFound:
                why = "the API server no longer has it (404)"
            except ClaimError as exc:
                self._say_kept(
                    claim.uid,
                    f"claim {claim.key} ({claim.uid}) is used by no pod of this node; whether the API server still "
                    f"has it cannot be told now ({exc}): kept, asked again at the next check",
                )
                break  # the API server does not answer: the others would wait as long, for nothing
            else:
                current = consumers.reserved_pods(data)[0]
                if not current or current == claim.uid:  # it has it (a pod may come for it): asked again later
                    self._unused_since[claim.uid] = time.monotonic()
                    continue
                why = f"the API server's claim of that name is another one (UID {current})"
            if claim.uid in self._in_use(self.claims(), self._pods()):  # a pod came meanwhile
                self._unused_since.pop(claim.uid, None)
                continue
            running, unknown = self._running(claim)
            if running:
                self._say_kept(
                    claim.uid,
                    f"claim {claim.key} ({claim.uid}): {why}, but the containers that used it may still run (until "
                    f"the kubelet stops them): {'; '.join(running)}; kept, looked at again at the next check",
                )
                continue
            if unknown:
                self._say_kept(
                    claim.uid,
                    f"claim {claim.key} ({claim.uid}): {why}, but whether the containers that used it still run "
                    f"processes on the GPUs it holds whole cannot be told: {'; '.join(unknown)}; kept, looked at again "
                    "at the next check",
                )
                continue
            if self.preparer.free_gone(claim, why):
                self._unused_since.pop(claim.uid, None)
                self.leaked_freed += 1
                freed.append(claim.uid)
        return freed

    def _capacity_seen(self, problem: str | None) -> None:
        """A prepared claim that asks for capacity was allocated without it (``problem``: the scheduler
        ignores consumable capacity), or with it (None): reported under ``scheduler-capacity`` from the
        first such claim until one is allocated its capacity (the report logs the first; each later one
        is logged here)."""
        if problem is not None and self._capacity_problem is not None:
            log.warning("%s", problem)
            return
        if problem is None and self._capacity_problem is None:
            return
        self._capacity_problem = problem
        self.scheduler_gates_off = frozenset() if problem is None else frozenset({"DRAConsumableCapacity"})
        self._report("scheduler-capacity", problem)

    def gates_off(self) -> frozenset[str]:
        """DRA feature gates seen off: on the API server (it dropped the slice's fields) or in the
        scheduler (it allocated claims without the capacity they ask for)."""
        published = self.publisher.gates_off if self.publisher is not None else frozenset()
        return published | self.scheduler_gates_off

    def _report_mixed(
        self, claims: Sequence[ClaimAllocation], pods: Sequence[Pod], reserved: consumers.Reserved
    ) -> None:
        """Report the containers that use a prepared share and another prepared claim of the driver.

        The check at Prepare refuses such a claim, but the kubelet prepares a claim once per node: a pod
        that joins prepared claims later is started from its cache without a call. Its container then
        runs with one claim's ``/etc/vcuda`` (the runtime's last mount wins), not held to the other's
        share. Nothing can refuse it now: it is reported (logged, and under ``claim-sharing`` in /healthz)
        while the pod runs."""
        from gpumanager.allocation import pods as podinfo

        found: dict[tuple[str, str], str] = {}
        for pod in pods:
            if podinfo.is_terminated(pod):
                continue
            meta = pod.get("metadata") or {}
            namespace, uid = str(meta.get("namespace", "")), podinfo.uid(pod)
            for container, names_used in consumers.container_claims(pod).items():
                if len(names_used) < 2:
                    continue
                held = [c for n in names_used if (c := consumers.owner(uid, namespace, n, claims, reserved))]
                shares = [c for c in held if c.shared]
                if len(held) < 2 or not shares:
                    continue
                found[(uid, container)] = (
                    f"container {container} of pod {namespace}/{meta.get('name')} uses claims "
                    f"{', '.join(c.key for c in held)} of driver {self.settings.driver}, prepared before the pod "
                    f"joined them (the kubelet did not ask again): it runs with one claim's limits and is not held "
                    f"to the share of {', '.join(c.key for c in shares)}; a container with a share can use no "
                    "other claim of this driver"
                )
        if found != self._mixed:  # logged by the report, whenever what it says changes
            self._report("claim-sharing", "; ".join(sorted(found.values())) or None)
        self._mixed = found

    def _write_request_pids(self, claim: ClaimAllocation, users: Sequence[tuple[Pod, str]]) -> None:
        """Each request's pids.config of a claim whose shares belong to several requests: the PIDs of
        the containers that name that request (an error is logged; the next refresh tries again)."""
        from gpumanager.allocation import pods as podinfo

        by_request: dict[str, set[int]] = {request: set() for request in claim.share_requests}
        for pod, container in users:
            named = consumers.requests_named(pod, container, claim.name)
            if not podinfo.container_ids(pod).get(container):
                continue
            found = restarts.container_pids(self._cgroups, pod, container)
            # A container that uses all of the claim (refused at Prepare when its pod was seen then)
            # counts against every request: never against none.
            for request in list(by_request) if None in named else named:
                if request in by_request:
                    by_request[str(request)].update(found)
        for request, pids in by_request.items():
            ordered = sorted(pids)
            key = f"{claim.uid}/{request}"
            if self._last_pids.get(key) == ordered:
                continue
            try:
                claim_files.write_pids(self._vm, claim.uid, ordered, request)
            except FileNotFoundError:  # unprepared since it was looked at
                continue
            except OSError as exc:
                log.error("claim %s (%s) request %s: cannot write pids.config: %s", claim.key, claim.uid, request, exc)
                continue
            self._last_pids[key] = ordered

    def healthz(self) -> dict[str, object]:
        """Details for /healthz."""
        state = self.sockets.state
        return {
            "mode": "dra",
            "driver": self.settings.driver,
            "registered": state.registered,
            "registration_error": state.last_error,
            "claims": len(self.claims()),
            # Prepared claims freed because the API server no longer has them and no pod uses them, though the
            # kubelet never unprepared them (:meth:`free_leaked`).
            "leaked_claims_freed": self.leaked_freed,
            # Why the ResourceSlice is withdrawn ('' when it is not): the kubelet refuses the driver, or its sockets
            # cannot be served (:meth:`check_serving`).
            "slice_withdrawn": self.slice_withdrawn,
            "slice_published": bool(self.publisher and self.publisher.published.is_set()),
            # Feature gates the API server or the scheduler has off (:meth:`gates_off`).
            "feature_gates_off": sorted(self.gates_off()),
        }

    def ready(self) -> tuple[bool, dict[str, object]]:
        """/readyz: registered with the kubelet, no refusal reported, and the slice published."""
        detail = self.healthz()
        ok = bool(detail["registered"]) and not detail["registration_error"] and bool(detail["slice_published"])
        return ok, detail

    def not_ready(self) -> str:
        """What /readyz says is missing in DRA mode ('' when ready)."""
        problems = []
        state = self.sockets.state
        if not state.registered or state.last_error:
            problems.append(self.not_registered())
        if self.slice_withdrawn:
            problems.append(self.slice_withdrawn)
        elif not (self.publisher and self.publisher.published.is_set()):
            problems.append("the ResourceSlice is not published yet")
        return "; ".join(problems)
