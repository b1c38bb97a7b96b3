"""Wiring and lifecycle of the agent: start order, health propagation, periodic checks, shutdown.

Start order: NVML inventory and topology tree; GPU health monitor; the
Kubernetes side (pod cache, annotation patcher, node labels); allocation state
(our checkpoint, else the kubelet's records); display gRPC and HTTP; then the
device-plugin servers and their registration loop (the servers listen before
Register is sent), or, with --mode=dra, DRA mode instead (gpumanager.dra: the
ResourceSlice, the kubelet's DRA sockets, claims in the same allocation state).
A failure of HTTP, display, the API server or node labels
is logged and reported on /healthz; it does not stop the device plugin.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import Message
from prometheus_client import CollectorRegistry

from gpumanager import __version__, names, recovery
from gpumanager.allocation import pods as podinfo
from gpumanager.allocation.allocator import AllocationError, Allocator, AllocatorSettings
from gpumanager.allocation.annotations import missing_annotations
from gpumanager.allocation.pods import Pod
from gpumanager.allocation.records import ContainerAllocation
from gpumanager.allocation.response import ResponseSettings
from gpumanager.api import deviceplugin_v1beta1_pb2 as dp_pb
from gpumanager.api import display_pb2
from gpumanager.config import Config, ConfigError, parse_node_labels
from gpumanager.device import nvml
from gpumanager.device.health import HealthMonitor, HealthState
from gpumanager.device.types import GPUInfo, NodeTopology
from gpumanager.device.usage import gpu_usage
from gpumanager.deviceplugin.devices import DeviceLayout
from gpumanager.deviceplugin.handlers import Handlers
from gpumanager.deviceplugin.manager import PluginManager
from gpumanager.deviceplugin.preferred import Preference
from gpumanager.deviceplugin.server import PluginServer
from gpumanager.deviceplugin.servicer import ResourceServicer
from gpumanager.dra import cdi
from gpumanager.dra.mode import DRAMode, DRASettings, make_publisher
from gpumanager.dra.publisher import SlicePublisher
from gpumanager.kube import cleanup, kubelet_checkpoint, nodelabels
from gpumanager.kube import client as kube_client
from gpumanager.kube.inventory_publisher import InventoryPublisher
from gpumanager.kube.owners import OwnerResolver
from gpumanager.kube.patcher import AnnotationPatcher
from gpumanager.kube.podresources import PodResourcesClient, PodResourcesUnavailableError
from gpumanager.kube.pods import PodCache
from gpumanager.metrics.calls import CallMetrics
from gpumanager.metrics.claims import ClaimCollector
from gpumanager.metrics.containers import usage_response
from gpumanager.metrics.display import DisplayServer, DisplayServicer
from gpumanager.metrics.http import QueryServer
from gpumanager.metrics.page import MetricsPage
from gpumanager.metrics.usage import ContainerUsage, UsageSampler
from gpumanager.topology import TopologyTree, build_tree, render_graph
from gpumanager.vmanager.manager import VirtualManager
from gpumanager.volume import VolumeError, build_vdriver

log = logging.getLogger(__name__)

# Flags of gpu-manager v1.1 that this version accepts but whose feature it does not have yet.
_NOT_YET_USED: tuple[str, ...] = ()
DEFAULT_VDRIVER = Path("/etc/gpu-manager/vdriver")
#: How often the driver mirror is checked again (an unchanged driver costs a few ms and changes nothing).
VOLUME_RECHECK_SECONDS = 300.0
#: How often shared containers' pids.config files are brought up to date.
PIDS_REFRESH_SECONDS = 1.0
# Flags kept only so existing manifests work.
_COMPAT_ONLY = ("container_runtime_endpoint", "runtime_request_timeout", "cgroup_driver")


class StartupError(RuntimeError):
    """The agent cannot start; ``exit_code`` is what the process should exit with."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class _NoApiServer:
    """Pod source used when no API server configuration exists: knows no pod, says why."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def synced(self) -> bool:
        return False

    def pods(self) -> list[Pod]:
        return []

    def get(self, uid: str) -> Pod | None:
        return None

    def find(self, namespace: str, name: str) -> Pod | None:
        return None

    def refresh(self) -> list[Pod]:
        raise RuntimeError(self.reason)


def load_extra_devices(path: str) -> tuple[str, ...]:
    """Device paths of ``extra-config.json``'s ``default`` entry; ConfigError names the file and problem."""
    if not path:
        return ()
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"--extra-config={path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"--extra-config={path}: must be a JSON object")
    default = data.get("default") or {}
    devices = default.get("devices") or [] if isinstance(default, dict) else None
    if not isinstance(devices, list) or not all(isinstance(d, str) and d.startswith("/") for d in devices):
        raise ConfigError(f"--extra-config={path}: default.devices must be a list of absolute paths")
    return tuple(devices)


class Agent:
    """The node agent: owns every component and their order of start and stop."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.node_name = config.resolved_node_name()
        self.gpus: list[GPUInfo] = []
        self.driver_version = ""
        self.topology = NodeTopology(levels=())
        self.tree: TopologyTree | None = None
        self.layout: DeviceLayout | None = None
        self.health: HealthMonitor | None = None
        self.plugins: PluginManager | None = None
        self.servicers: list[ResourceServicer] = []
        self.dra: DRAMode | None = None
        self._slices: SlicePublisher | None = None
        self.display: DisplayServer | None = None
        self.http: QueryServer | None = None
        self.pod_cache: PodCache | None = None
        self.api_client: Any = None
        self.pods: PodCache | _NoApiServer = _NoApiServer("not started")
        self.patcher: AnnotationPatcher | None = None
        self.inventory: InventoryPublisher | None = None
        self.allocator: Allocator | None = None
        self.vmanager: VirtualManager | None = None
        self.sampler: UsageSampler | None = None
        self.registry = CollectorRegistry()
        self.calls = CallMetrics(self.registry)
        self.component_errors: dict[str, str] = {}
        self._lock = threading.RLock()  # guards the tree and the allocation state
        self._nvml_started = False
        self._device_cache: dict[str, tuple[tuple[str, tuple[int, ...]], list[dp_pb.Device]]] = {}
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.started_at = 0.0

    # -- start ----------------------------------------------------------------------------------

    def start(self) -> None:
        """Start every component; raise StartupError when the device plugin cannot be served."""
        cfg = self.config
        self.started_at = time.monotonic()
        log.info("gpu-manager %s starting on node %s", __version__, self.node_name)
        self._log_flag_notes()
        try:
            extra_devices = load_extra_devices(cfg.extra_config)
            labels = parse_node_labels(cfg.node_labels)
        except ConfigError as exc:
            raise StartupError(str(exc), 2) from exc
        vdriver = self._start_volume()
        self._start_nvml()
        self._start_health()
        self._start_kube(labels)
        self._start_allocation(extra_devices, vdriver)
        self._start_display()
        self._start_http()
        if cfg.mode == "dra":
            self._start_dra(extra_devices, vdriver)
            return
        self._start_plugins()
        self._spawn("allocation-check", self._check_loop)
        self._spawn("pids-refresh", self._pids_loop)
        log.info(
            "serving %d GPUs: %s=%d, %s=%d devices in %s",
            len(self.gpus),
            names.VCORE_RESOURCE,
            self._layout().count(names.VCORE_RESOURCE),
            names.VMEMORY_RESOURCE,
            self._layout().count(names.VMEMORY_RESOURCE),
            cfg.device_plugin_path,
        )

    def _spawn(self, name: str, target: Callable[[], None]) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _log_flag_notes(self) -> None:
        defaults = Config()
        unused = [f for f in _NOT_YET_USED if getattr(self.config, f) != getattr(defaults, f)]
        if unused:
            log.warning(
                "flags accepted but not used by this version: %s",
                ", ".join("--" + f.replace("_", "-") for f in unused),
            )
        compat = [f for f in _COMPAT_ONLY if getattr(self.config, f) != getattr(defaults, f)]
        if compat:
            log.info(
                "%s: kept for compatibility; no container runtime connection is needed and both cgroup "
                "drivers are recognised",
                ", ".join("--" + f.replace("_", "-") for f in compat),
            )

    def _build_vdriver(self) -> tuple[str, str]:
        cfg = self.config
        result = build_vdriver(
            volume_config=Path(cfg.volume_config),
            driver_root=Path(cfg.driver_root),
            # DRA mode always has shares (a claim's consumed capacity): the mirror gets the interceptor.
            share_mode=cfg.share_mode or cfg.mode == "dra",
            interceptor=Path(cfg.vcuda_library) if cfg.share_mode or cfg.mode == "dra" else None,
            gpu_client=cfg.gpu_client_path,
            proc_root=Path(cfg.proc_root),
        )
        for warning in result.warnings:
            log.warning("driver mirror: %s", warning)
        for tree in result.removed_trees:
            log.info("driver mirror: removed unused tree %s", tree)
        if result.changed:
            log.info(
                "driver mirror %s: %s",
                result.driver_version.full if result.driver_version else "(no libcuda found)",
                ", ".join(f"{v.path} -> {v.tree.name}" + (" (new)" if v.built else "") for v in result.volumes),
            )
        self.component_errors.pop("volume", None)
        return (
            str(result.nvidia or DEFAULT_VDRIVER / "nvidia"),
            str(result.origin or DEFAULT_VDRIVER / "origin"),
        )

    def _start_volume(self) -> tuple[str, str]:
        """Build the driver mirror; returns the (share, exclusive) mount sources. Errors are reported, not fatal."""
        defaults = (str(DEFAULT_VDRIVER / "nvidia"), str(DEFAULT_VDRIVER / "origin"))
        if not self.config.volume_config:
            log.warning("--volume-config is not set: no driver mirror is built; containers mount %s", defaults)
            return defaults
        try:
            paths = self._build_vdriver()
        except VolumeError as exc:
            self._component_failed("volume", f"driver mirror not built: {exc}")
            return defaults
        self._spawn("volume-check", self._volume_loop)
        return paths

    def _volume_loop(self) -> None:
        while not self._stop.wait(VOLUME_RECHECK_SECONDS):
            try:
                self._build_vdriver()
            except VolumeError as exc:
                self._component_failed("volume", f"driver mirror check failed: {exc}")
            except Exception:
                log.exception("driver mirror check failed; trying again later")

    def _start_nvml(self) -> None:
        try:
            nvml.init(self.config.nvml_lib)
            self._nvml_started = True
            driver = nvml.driver_info()
            self.gpus = nvml.discover()
            self.topology = nvml.topology(self.gpus)
        except (nvml.NVMLUnavailableError, nvml.NVMLError) as exc:
            raise StartupError(str(exc), 3) from exc
        self.driver_version = driver.driver_version
        if not self.gpus:
            log.warning("NVML reports no GPU on this node; advertising no devices")
        log.info(
            "driver %s (CUDA %d.%d), %d GPUs",
            driver.driver_version,
            driver.cuda_driver_version // 1000,
            driver.cuda_driver_version % 1000 // 10,
            len(self.gpus),
        )
        for g in self.gpus:
            log.info(
                "GPU %d: %s %s minor=%d memory=%d MiB bus=%s numa=%s",
                g.index,
                g.name,
                g.uuid,
                g.minor,
                g.memory_total >> 20,
                g.pci_bus_id,
                g.numa_node,
            )
        self.tree = build_tree(self.gpus, self.topology)
        self.layout = DeviceLayout(self.gpus)
        for line in render_graph(self.tree).splitlines():
            log.info("topology %s", line)

    def _start_health(self) -> None:
        self.health = HealthMonitor(
            self.gpus,
            ignored_xids=self.config.ignored_xids,
            quiet_period=self.config.health_quiet_period,
            probe_period=self.config.health_probe_period,
        )
        self.health.add_listener(self._on_health_change)
        self.health.start()

    def _start_kube(self, labels: dict[str, str]) -> None:
        try:
            api = kube_client.api_client(self.config.kubeconfig)
        except kube_client.KubeUnavailableError as exc:
            self._component_failed("api-server", f"{exc}; serving without it (Allocate will refuse)")
            self.pods = _NoApiServer(str(exc))
            return
        self.api_client = api
        if self.config.mode == "dra":
            # Before the pod cache: the slice needs only the GPUs and their health, and the pod
            # cache's client types take a second or more to load.
            self._start_dra_slices()
        self.pod_cache = PodCache(api, self.node_name)
        self.pod_cache.add_listener(self._on_pod_event)
        self.pods = self.pod_cache
        self.pod_cache.start()
        self.patcher = AnnotationPatcher(api)
        self.patcher.start()
        if self.config.mode != "dra":  # the scheduler extender's view of each GPU (DRA has ResourceSlices)
            health = self.health
            self.inventory = InventoryPublisher(
                api,
                self.node_name,
                self.gpus,
                self.topology,
                lambda: {i: s.healthy for i, s in (health.snapshot() if health else {}).items()},
                share_mode=self.config.share_mode,
            )
            self.inventory.start()
        if labels:
            resolved = nodelabels.resolve(labels, self.gpus[0].name if self.gpus else "")
            self._spawn("node-labels", lambda: self._label_node(api, resolved))

    def _label_node(self, api: Any, labels: dict[str, str]) -> None:
        if not nodelabels.apply(api, self.node_name, labels):
            self._component_failed("node-labels", f"could not label node {self.node_name} with {labels}")

    def _start_allocation(self, extra_devices: tuple[str, ...], vdriver: tuple[str, str]) -> None:
        cfg = self.config
        settings = AllocatorSettings(
            share_mode=cfg.share_mode,
            response=ResponseSettings(
                vdriver_nvidia=vdriver[0],
                vdriver_origin=vdriver[1],
                virtual_manager_path=cfg.virtual_manager_path,
                extra_devices=extra_devices,
            ),
        )
        self.allocator = Allocator(
            gpus=self.gpus,
            tree=self._tree(),
            lock=self._lock,
            pods=self.pods,
            settings=settings,
            checkpoint_path=Path(cfg.checkpoint_path) / names.OWN_CHECKPOINT,
        )
        self.vmanager = VirtualManager(
            vm_path=Path(cfg.virtual_manager_path),
            cgroup_root=Path(cfg.cgroup_root),
            allocation=self.allocator.get,
            pod=self.pods.get,
            driver_version=self.driver_version,
        )
        self.sampler = UsageSampler(
            gpus=self.gpus,
            allocations=self._usage_allocations,
            pod=self.pods.get,
            cgroup_root=Path(cfg.cgroup_root),
            sample_period=float(cfg.sample_period),
        )
        self._recover()
        self.vmanager.resume(sorted({a.answered[0] for a in self.allocator.allocations()}))

    def _recover(self) -> None:
        allocator = self._allocator()
        path = Path(self.config.checkpoint_path) / names.OWN_CHECKPOINT
        existed = path.exists()
        try:
            count, problems = allocator.load()
        except AllocationError as exc:
            log.error("our checkpoint is unusable (%s); rebuilding from the kubelet's records", exc)
            count, problems, existed = 0, [], False
        for problem in problems:
            log.warning("checkpoint %s: skipped %s", path, problem)
        if existed:
            log.info("recovered %d container allocations from %s", count, path)
            return
        self._rebuild_from_kubelet()

    def _rebuild_from_kubelet(self) -> None:
        allocator = self._allocator()
        cp_path = Path(self.config.device_plugin_path) / names.KUBELET_CHECKPOINT
        try:
            from_cp = recovery.from_kubelet_checkpoint(kubelet_checkpoint.read(cp_path))
        except kubelet_checkpoint.KubeletCheckpointError as exc:
            log.warning("cannot use %s: %s", cp_path, exc)
            from_cp = []
        taken = allocator.adopt(from_cp, source=str(cp_path))
        from_pr: list[ContainerAllocation] = []
        try:
            entries = PodResourcesClient(Path(self.config.pod_resources_socket)).list_all()
        except PodResourcesUnavailableError as exc:
            log.info("PodResources not available for recovery: %s", exc)
        else:
            if entries and self.pod_cache is not None:
                self.pod_cache.wait_synced(10.0)
            from_pr = recovery.from_pod_resources(
                entries, find_pod=self.pods.find, layout=self._layout(), gpus=self.gpus
            )
        taken += allocator.adopt(from_pr, source="PodResources")
        log.info(
            "rebuilt %d container allocations from the kubelet (checkpoint: %d found, PodResources: %d found)",
            taken,
            len(from_cp),
            len(from_pr),
        )

    def _start_display(self) -> None:
        servicer = DisplayServicer(graph=self.graph_text, usages=self.usages, version=__version__)
        self.display = DisplayServer(servicer, Path(self.config.display_socket))
        try:
            self.display.start()
        except (OSError, RuntimeError) as exc:
            self._component_failed("display", f"cannot serve {self.config.display_socket}: {exc}")
            self.display = None

    def _start_http(self) -> None:
        page = MetricsPage(
            agent=self, registry=self.registry, sample=self._sample, legacy_metrics=self.config.legacy_metrics
        )
        routes: dict[str, Callable[[], Message]] = {
            "/graph": lambda: display_pb2.GraphResponse(graph=self.graph_text()),
            "/usage": self.usages,
            "/version": lambda: display_pb2.VersionResponse(version=__version__),
        }
        try:
            self.http = QueryServer(
                self.config.query_addr,
                self.config.query_port,
                routes=routes,
                metrics=page.render,
                health=self.healthz,
                ready=self.readyz,
            )
            self.http.start()
        except OSError as exc:
            self._component_failed("http", f"cannot listen on {self.config.query_addr}:{self.config.query_port}: {exc}")
            self.http = None

    def _start_plugins(self) -> None:
        layout = self._layout()
        options = dp_pb.DevicePluginOptions(pre_start_required=True, get_preferred_allocation_available=True)
        preference = Preference(self._tree(), layout, self._lock)
        owners = OwnerResolver(
            pod_resources=PodResourcesClient(Path(self.config.pod_resources_socket)),
            kubelet_checkpoint_path=Path(self.config.device_plugin_path) / names.KUBELET_CHECKPOINT,
            find_pod=self._find_pod,
        )
        handlers = Handlers(
            allocator=self._allocator(),
            layout=layout,
            owner=owners.owner,
            prepared=self._prepared,
            observe=self.calls.observe,
        )
        dp_dir = Path(self.config.device_plugin_path)
        servers = []
        for resource, sock, allocate, pre_start in (
            (names.VCORE_RESOURCE, names.VCORE_SOCKET, handlers.allocate_core, handlers.pre_start_core),
            (names.VMEMORY_RESOURCE, names.VMEMORY_SOCKET, handlers.allocate_memory, handlers.pre_start_memory),
        ):
            servicer = ResourceServicer(
                resource,
                devices=functools.partial(self._devices, resource),
                options=options,
                preference=functools.partial(preference.choose, resource),
                allocate=allocate,
                pre_start=pre_start,
            )
            self.servicers.append(servicer)
            servers.append(PluginServer(servicer, dp_dir / sock))
        self.plugins = PluginManager(
            servers,
            self.config.kubelet_socket,
            options_for=lambda _s: options,
            watch_period=self.config.kubelet_watch_period,
        )
        self.plugins.start()
        for server in servers:
            self._wait_serving(server.socket_path)

    def _dra_settings(self) -> DRASettings:
        cfg = self.config
        return DRASettings(
            driver=cfg.dra_driver_name,
            plugin_registry_path=cfg.plugin_registry_path,
            plugin_path=str(cfg.dra_socket_dir),
            cdi_root=cfg.cdi_root,
            sysfs_root=cfg.sysfs_root,
            watch_period=cfg.kubelet_watch_period,
            health_report_period=cfg.health_probe_period,
        )

    def _start_dra_slices(self) -> None:
        """Publish the ResourceSlice as early as possible: it needs only the GPUs and their health."""
        if self.api_client is None:
            return
        self._slices = make_publisher(
            self.api_client,
            settings=self._dra_settings(),
            node=self.node_name,
            gpus=self.gpus,
            topology=self.topology,
            health=self.health,
            report=self._report,
        )
        self._spawn("slice-first-sync", self._slices.start)

    def _start_dra(self, extra_devices: tuple[str, ...], vdriver: tuple[str, str]) -> None:
        """DRA mode: claims prepared into the same allocation state, limit files and driver mirror."""
        cfg = self.config
        allocator = self._allocator()
        self.dra = DRAMode(
            settings=self._dra_settings(),
            publisher=self._slices,
            node=self.node_name,
            gpus=self.gpus,
            topology=self.topology,
            health=self.health,
            allocator=allocator,
            api_client=self.api_client,
            pods=self.pods.pods,
            pod=self.pods.get,
            cdi_settings=cdi.CDISettings(
                root=Path(cfg.cdi_root),
                driver=cfg.dra_driver_name,
                vdriver_nvidia=vdriver[0],
                vdriver_origin=vdriver[1],
                virtual_manager_path=cfg.virtual_manager_path,
                extra_devices=extra_devices,
            ),
            vm_path=Path(cfg.virtual_manager_path),
            cgroup_root=Path(cfg.cgroup_root),
            driver_version=self.driver_version,
            observe=functools.partial(self.calls.observe, cfg.dra_driver_name),
            report=self._report,
        )
        self.registry.register(ClaimCollector(self.dra.claims, self.pods.pods))
        self.dra.start()
        self._wait_serving(self.dra.sockets.service_socket)
        self._spawn("dra-pids-refresh", self._dra_pids_loop)
        self._spawn("allocation-recycle", self._recycle_loop)
        log.info(
            "serving %d GPUs as DRA driver %s: ResourceSlice %s, %s (no device-plugin socket)",
            len(self.gpus),
            cfg.dra_driver_name,
            f"{self.node_name}-{cfg.dra_driver_name}",
            self.dra.sockets.service_socket,
        )

    def _recycle_loop(self) -> None:
        """DRA mode: container allocations left from device-plugin mode are freed when their pods end
        (claims are freed by NodeUnprepareResources; no directory is removed here)."""
        synced = self.pod_cache is not None and self.pod_cache.wait_synced(self.config.allocation_check_period)
        if not synced and self._stop.wait(self.config.allocation_check_period):
            return
        while True:
            try:
                gone = self._allocator().recycle()
                if gone:
                    log.info("released %d pods of device-plugin mode that are gone: %s", len(gone), ", ".join(gone))
            except Exception:
                log.exception("allocation recycle failed; trying again next period")
            if self._stop.wait(self.config.allocation_check_period):
                return

    def _dra_pids_loop(self) -> None:
        while not self._stop.wait(PIDS_REFRESH_SECONDS):
            try:
                if self.dra is not None:
                    self.dra.refresh_pids()
            except Exception:
                log.exception("pids.config refresh of claims failed; trying again")

    def _report(self, name: str, message: str | None) -> None:
        """A component's error (logged once), or its recovery (None)."""
        if message is None:
            self.component_errors.pop(name, None)
        elif self.component_errors.get(name) != message:
            self._component_failed(name, message)

    def _usage_allocations(self) -> list[ContainerAllocation]:
        mine = self._allocator().allocations()
        return mine + self.dra.container_allocations() if self.dra is not None else mine

    def _wait_serving(self, path: Path) -> None:
        with grpc.insecure_channel(f"unix://{path}") as channel:
            try:
                grpc.channel_ready_future(channel).result(timeout=self.config.wait_timeout)
            except grpc.FutureTimeoutError as exc:
                raise StartupError(
                    f"device-plugin server {path} not ready within --wait-timeout={self.config.wait_timeout:g}s", 1
                ) from exc

    def _component_failed(self, name: str, message: str) -> None:
        self.component_errors[name] = message
        log.error("%s", message)

    # -- events and periodic work -----------------------------------------------------------------

    def _find_pod(self, namespace: str, name: str) -> Pod | None:
        pod = self.pods.find(namespace, name)
        if pod is not None:
            return pod
        try:
            fresh = self.pods.refresh()
        except Exception as exc:
            log.warning("cannot look up pod %s/%s: %s", namespace, name, exc)
            return None
        for p in fresh:
            meta = p.get("metadata") or {}
            if meta.get("namespace") == namespace and meta.get("name") == name:
                return p
        return None

    def _prepared(self, alloc: ContainerAllocation) -> None:
        """After PreStartContainer's check: limit files, then the pod's annotations (not awaited)."""
        vmanager = self._vmanager()
        vmanager.prepare(alloc)
        self._annotate(alloc.pod_uid)

    def _annotate(self, pod_uid: str) -> None:
        pod = self.pods.get(pod_uid)
        if pod is None or self.patcher is None:
            return
        mine = self._allocator().allocations_of(pod_uid)
        wanted = missing_annotations(pod, mine)
        if wanted:
            meta = pod.get("metadata") or {}
            self.patcher.submit(str(meta.get("namespace", "")), str(meta.get("name", "")), pod_uid, wanted)

    def _on_pod_event(self, kind: str, pod: Pod) -> None:
        uid = podinfo.uid(pod)
        if self.allocator is None:
            return
        released = (kind == "DELETED" or podinfo.is_terminated(pod)) and self.allocator.release_pod(uid)
        if released and self.vmanager is not None and self.pods.synced():
            self.vmanager.gc(self._active_pod_dirs())

    def _active_pod_dirs(self) -> set[str]:
        """Pod directories to keep: those of allocations, and of every pod that may still run."""
        allocs = self._allocator().allocations()
        alive = {podinfo.uid(p) for p in self.pods.pods() if not podinfo.is_terminated(p)}
        return {a.pod_uid for a in allocs} | {a.answered[0] for a in allocs} | alive

    def check_allocations(self) -> None:
        """gpu-manager's periodic check: free pods that are gone, remove their directories,
        and annotate running pods whose annotations are missing or stale."""
        allocator = self._allocator()
        gone = allocator.recycle()
        self._clean_failed_pods()
        if self.pods.synced():
            self._vmanager().gc(self._active_pod_dirs())
        for uid in sorted({a.pod_uid for a in allocator.allocations()}):
            pod = self.pods.get(uid)
            if pod is not None and podinfo.phase(pod) == "Running":
                self._annotate(uid)
        if gone:
            log.info("periodic check released %d pods that are gone", len(gone))

    def _clean_failed_pods(self) -> None:
        """Pods whose admission or PreStart failed: free their GPUs; delete them when a controller owns them."""
        for pod in self.pods.pods():
            if podinfo.phase(pod) not in ("Failed", "Pending") or not podinfo.should_delete(pod):
                continue
            if not podinfo.is_gpu_pod(pod):
                continue
            self._allocator().release_pod(podinfo.uid(pod))
            if self.api_client is not None and cleanup.controller_owned(pod):
                cleanup.delete_pod(self.api_client, pod)

    def _check_loop(self) -> None:
        # First check as soon as the pod cache is complete: pods that ended while we were down are freed now.
        if self.pod_cache is not None and self.pod_cache.wait_synced(self.config.allocation_check_period):
            try:
                self.check_allocations()
            except Exception:
                log.exception("allocation check failed; trying again next period")
        while not self._stop.wait(self.config.allocation_check_period):
            try:
                self.check_allocations()
            except Exception:
                log.exception("periodic allocation check failed; trying again next period")

    def _pids_loop(self) -> None:
        """Keep every shared container's pids.config current (the library matches NVML's host PIDs)."""
        while not self._stop.wait(PIDS_REFRESH_SECONDS):
            try:
                self._vmanager().refresh_pids(self._allocator().allocations())
            except Exception:
                log.exception("pids.config refresh failed; trying again")

    # -- queries --------------------------------------------------------------------------------

    def _tree(self) -> TopologyTree:
        if self.tree is None:
            raise RuntimeError("the agent has not discovered its GPUs yet")
        return self.tree

    def _layout(self) -> DeviceLayout:
        if self.layout is None:
            raise RuntimeError("the agent has not discovered its GPUs yet")
        return self.layout

    def _allocator(self) -> Allocator:
        if self.allocator is None:
            raise RuntimeError("allocation is not started")
        return self.allocator

    def _vmanager(self) -> VirtualManager:
        if self.vmanager is None:
            raise RuntimeError("allocation is not started")
        return self.vmanager

    def _devices(self, resource: str) -> list[dp_pb.Device]:
        health = self.health.snapshot() if self.health is not None else {}
        healthy = {i: s.healthy for i, s in health.items()}
        key = (resource, tuple(sorted(i for i, ok in healthy.items() if not ok)))
        with self._lock:
            cached = self._device_cache.get(resource)
            if cached is not None and cached[0] == key:
                return cached[1]
        devices = self._layout().devices(resource, healthy)
        with self._lock:
            self._device_cache[resource] = (key, devices)
        return devices

    def tree_snapshot(self) -> list[tuple[int, int, int, int, int]]:
        """(index, allocatable cores, allocatable bytes, total bytes, available) per GPU."""
        with self._lock:
            return [
                (
                    leaf.index,
                    leaf.allocatable_cores,
                    leaf.allocatable_memory,
                    leaf.total_memory,
                    int(leaf.available),
                )
                for leaf in self._tree().leaves
            ]

    def graph_text(self) -> str:
        """The topology tree in gpu-manager's PrintGraph format, with processes and memory refreshed from NVML."""
        usages = {}
        for g in self.gpus:
            try:
                usages[g.index] = gpu_usage(g.index)
            except nvml.NVMLError as exc:
                log.debug("GPU %d usage unavailable: %s", g.index, exc)
        with self._lock:
            tree = self._tree()
            for index, usage in usages.items():
                tree.update_usage(index, usage.pids, usage.used_memory)
            return render_graph(tree)

    def _sample(self) -> list[ContainerUsage]:
        return self.sampler.sample() if self.sampler is not None else []

    def usages(self) -> display_pb2.UsageResponse:
        """PrintUsages / GET /usage."""
        return usage_response(self._sample())

    def readyz(self) -> tuple[bool, dict[str, object]]:
        """Readiness: registered with the kubelet (DRA mode: and no refusal, and the ResourceSlice published)."""
        alive, detail = self.healthz()
        if self.dra is not None:
            ok, dra = self.dra.ready()
            return alive and ok, {**detail, **dra}
        return alive and bool(detail.get("registered")), detail

    def healthz(self) -> tuple[bool, dict[str, object]]:
        """Liveness: the kubelet watch loop runs. Details name registration state and failed components."""
        if self.dra is not None:
            dra_detail = self.dra.healthz()
            dra_detail.update(
                gpus=len(self.gpus),
                unhealthy_gpus=[i for i, s in (self.health.snapshot() if self.health else {}).items() if not s.healthy],
                pods_synced=self.pods.synced(),
                errors=dict(self.component_errors),
            )
            return self.dra.sockets.alive(), dra_detail
        plugins_alive = self.plugins is not None and self.plugins.alive()
        registered = self.plugins is not None and self.plugins.status.registered
        unhealthy = [i for i, s in (self.health.snapshot() if self.health else {}).items() if not s.healthy]
        detail: dict[str, object] = {
            "registered": registered,
            "gpus": len(self.gpus),
            "unhealthy_gpus": unhealthy,
            "pods_synced": self.pods.synced(),
            "allocations": len(self.allocator.allocations()) if self.allocator else 0,
            "errors": dict(self.component_errors),
        }
        return plugins_alive, detail

    def _on_health_change(self, index: int, state: HealthState) -> None:
        with self._lock:
            self._tree().set_healthy(index, state.healthy)
        for servicer in self.servicers:
            servicer.notify()
        if self.inventory is not None:
            self.inventory.changed()

    # -- stop -----------------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop every component in reverse order and remove our sockets."""
        self._stop.set()
        if self.dra is not None:
            self.dra.stop()
        if self.plugins is not None:
            self.plugins.stop()
        if self.http is not None:
            self.http.stop()
        if self.display is not None:
            self.display.stop()
        if self.vmanager is not None:
            self.vmanager.stop()
        if self.inventory is not None:
            self.inventory.stop()
        if self.patcher is not None:
            self.patcher.stop()
        if self.pod_cache is not None:
            self.pod_cache.stop()
        if self.health is not None:
            self.health.stop()
        if self._nvml_started:
            nvml.shutdown()
            self._nvml_started = False
