"""Wiring and lifecycle of the agent: start order, health propagation, shutdown.

Start order: NVML inventory and topology tree, GPU health monitor, display
gRPC and HTTP, then the device-plugin servers and their registration loop (the
servers listen before Register is sent). A failure of the HTTP or display
server, or of the API server connection, is logged and reported on /healthz;
it does not stop the device plugin.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
from google.protobuf.message import Message
from prometheus_client import CollectorRegistry

from gpumanager import __version__, names
from gpumanager.api import deviceplugin_v1beta1_pb2 as dp_pb
from gpumanager.api import display_pb2
from gpumanager.config import Config
from gpumanager.device import nvml
from gpumanager.device.health import HealthMonitor, HealthState
from gpumanager.device.types import GPUInfo, NodeTopology
from gpumanager.device.usage import gpu_usage
from gpumanager.deviceplugin.devices import DeviceLayout
from gpumanager.deviceplugin.manager import PluginManager
from gpumanager.deviceplugin.preferred import Preference
from gpumanager.deviceplugin.server import PluginServer
from gpumanager.deviceplugin.servicer import ResourceServicer
from gpumanager.kube import client as kube_client
from gpumanager.metrics.collector import AgentCollector
from gpumanager.metrics.display import DisplayServer, DisplayServicer
from gpumanager.metrics.http import QueryServer
from gpumanager.topology import TopologyTree, build_tree, render_graph

log = logging.getLogger(__name__)

# Flags of gpu-manager v1.1 that this version accepts but whose feature it does not have yet.
_NOT_YET_USED = (
    "extra_config",
    "volume_config",
    "node_labels",
    "virtual_manager_path",
    "checkpoint_path",
    "share_mode",
    "allocation_check_period",
    "sample_period",
    "cgroup_driver",
    "pod_resources_socket",
)
# Flags kept only so existing manifests work: we need no container runtime connection.
_COMPAT_ONLY = ("container_runtime_endpoint", "runtime_request_timeout")


class StartupError(RuntimeError):
    """The agent cannot start; ``exit_code`` is what the process should exit with."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class Agent:
    """The node agent: owns every component and their order of start and stop."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.node_name = config.resolved_node_name()
        self.gpus: list[GPUInfo] = []
        self.topology = NodeTopology(levels=())
        self.tree: TopologyTree | None = None
        self.layout: DeviceLayout | None = None
        self.health: HealthMonitor | None = None
        self.plugins: PluginManager | None = None
        self.servicers: list[ResourceServicer] = []
        self.display: DisplayServer | None = None
        self.http: QueryServer | None = None
        self.registry = CollectorRegistry()
        self.component_errors: dict[str, str] = {}
        self.api_server_version = ""
        self._lock = threading.RLock()  # guards the tree
        self._nvml_started = False
        self._device_cache: dict[str, tuple[tuple[str, tuple[int, ...]], list[dp_pb.Device]]] = {}
        self.started_at = 0.0

    # -- start ----------------------------------------------------------------------------------

    def start(self) -> None:
        """Start every component; raise StartupError when the device plugin cannot be served."""
        cfg = self.config
        self.started_at = time.monotonic()
        log.info("gpu-manager %s starting on node %s", __version__, self.node_name)
        self._log_flag_notes()
        self._start_nvml()
        self._start_health()
        self._start_display()
        self._start_http()
        self._start_plugins()
        threading.Thread(target=self._probe_api_server, name="kube-probe", daemon=True).start()
        log.info(
            "serving %d GPUs: %s=%d, %s=%d devices in %s",
            len(self.gpus),
            names.VCORE_RESOURCE,
            self._layout().count(names.VCORE_RESOURCE),
            names.VMEMORY_RESOURCE,
            self._layout().count(names.VMEMORY_RESOURCE),
            cfg.device_plugin_path,
        )

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
                "%s: kept for compatibility; no container runtime connection is needed",
                ", ".join("--" + f.replace("_", "-") for f in compat),
            )

    def _start_nvml(self) -> None:
        try:
            nvml.init(self.config.nvml_lib)
            self._nvml_started = True
            driver = nvml.driver_info()
            self.gpus = nvml.discover()
            self.topology = nvml.topology(self.gpus)
        except (nvml.NVMLUnavailableError, nvml.NVMLError) as exc:
            raise StartupError(str(exc), 3) from exc
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

    def _start_display(self) -> None:
        servicer = DisplayServicer(graph=self.graph_text, usages=display_pb2.UsageResponse, version=__version__)
        self.display = DisplayServer(servicer, Path(self.config.display_socket))
        try:
            self.display.start()
        except (OSError, RuntimeError) as exc:
            self._component_failed("display", f"cannot serve {self.config.display_socket}: {exc}")
            self.display = None

    def _start_http(self) -> None:
        self.registry.register(AgentCollector(self))
        routes: dict[str, Callable[[], Message]] = {
            "/graph": lambda: display_pb2.GraphResponse(graph=self.graph_text()),
            "/usage": display_pb2.UsageResponse,
            "/version": lambda: display_pb2.VersionResponse(version=__version__),
        }
        try:
            self.http = QueryServer(
                self.config.query_addr,
                self.config.query_port,
                routes=routes,
                registry=self.registry,
                health=self.healthz,
            )
            self.http.start()
        except OSError as exc:
            self._component_failed("http", f"cannot listen on {self.config.query_addr}:{self.config.query_port}: {exc}")
            self.http = None

    def _start_plugins(self) -> None:
        layout = self._layout()
        options = dp_pb.DevicePluginOptions(pre_start_required=True, get_preferred_allocation_available=True)
        preference = Preference(self._tree(), layout, self._lock)
        dp_dir = Path(self.config.device_plugin_path)
        servers = []
        for resource, sock in (
            (names.VCORE_RESOURCE, names.VCORE_SOCKET),
            (names.VMEMORY_RESOURCE, names.VMEMORY_SOCKET),
        ):
            servicer = ResourceServicer(
                resource,
                devices=functools.partial(self._devices, resource),
                options=options,
                preference=functools.partial(preference.choose, resource),
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

    def _wait_serving(self, path: Path) -> None:
        with grpc.insecure_channel(f"unix://{path}") as channel:
            try:
                grpc.channel_ready_future(channel).result(timeout=self.config.wait_timeout)
            except grpc.FutureTimeoutError as exc:
                raise StartupError(
                    f"device-plugin server {path} not ready within --wait-timeout={self.config.wait_timeout:g}s", 1
                ) from exc

    def _probe_api_server(self) -> None:
        try:
            api = kube_client.api_client(self.config.kubeconfig)
            self.api_server_version = kube_client.probe(api)
        except Exception as exc:
            self._component_failed("api-server", f"Kubernetes API server not reachable: {exc}; serving without it")
            return
        self.component_errors.pop("api-server", None)
        log.info("Kubernetes API server %s reachable", self.api_server_version)

    def _component_failed(self, name: str, message: str) -> None:
        self.component_errors[name] = message
        log.error("%s", message)

    # -- queries --------------------------------------------------------------------------------

    def _tree(self) -> TopologyTree:
        if self.tree is None:
            raise RuntimeError("the agent has not discovered its GPUs yet")
        return self.tree

    def _layout(self) -> DeviceLayout:
        if self.layout is None:
            raise RuntimeError("the agent has not discovered its GPUs yet")
        return self.layout

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

    def healthz(self) -> tuple[bool, dict[str, object]]:
        """Liveness: the kubelet watch loop runs. Details name registration state and failed components."""
        plugins_alive = self.plugins is not None and self.plugins.alive()
        registered = self.plugins is not None and self.plugins.status.registered
        detail: dict[str, object] = {
            "registered": registered,
            "gpus": len(self.gpus),
            "unhealthy_gpus": [i for i, s in (self.health.snapshot() if self.health else {}).items() if not s.healthy],
            "errors": dict(self.component_errors),
        }
        return plugins_alive, detail

    def _on_health_change(self, index: int, state: HealthState) -> None:
        with self._lock:
            self._tree().set_healthy(index, state.healthy)
        for servicer in self.servicers:
            servicer.notify()

    # -- stop -----------------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop every component in reverse order and remove our sockets."""
        if self.plugins is not None:
            self.plugins.stop()
        if self.http is not None:
            self.http.stop()
        if self.display is not None:
            self.display.stop()
        if self.health is not None:
            self.health.stop()
        if self._nvml_started:
            nvml.shutdown()
            self._nvml_started = False
