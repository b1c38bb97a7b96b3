"""Wiring and lifecycle of the agent: start order, supervision, shutdown.

Start order, fastest path to the kubelet first (only what registration needs is imported
before it):

1. NVML: inventory (a lost GPU is kept, Unhealthy); health watching.
2. The device-plugin servers listen and register with the kubelet; ListAndWatch is served.
3. In the background, once registered and the kubelet has the first full ListAndWatch of both
   resources (bounded): the topology tree and the allocation state from our checkpoint and
   the kubelet's (local files only); the kubelet's calls wait (bounded) for it.
4. Then the driver mirror, display and HTTP, then the API-server side (the Kubernetes client
   is loaded only now), recovery from PodResources, the periodic loops. Allocate waits
   (bounded) for this; registration and ListAndWatch never do.

With --mode=dra, DRA mode replaces step 2 (gpumanager.dra: the ResourceSlice, the
kubelet's DRA sockets, claims in the same allocation state); it needs the API server, so
it starts in the background once that is connected.

A failure of HTTP, display, the API server or node labels is logged and reported on
/healthz and /readyz; it does not stop the device plugin. Stopping takes well under two
seconds in every state: sockets first, then every loop told to stop, none waited for long.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from gpumanager import __version__, deferred, names
from gpumanager.config import Config, ConfigError, parse_node_labels
from gpumanager.device import discovery, inventory, nvml
from gpumanager.device.health import SAVED_FILE, HealthMonitor
from gpumanager.device.propagation import HealthPropagation
from gpumanager.device.types import GPUInfo, NodeTopology
from gpumanager.deviceplugin.devicelists import DeviceLists
from gpumanager.deviceplugin.devices import DeviceLayout
from gpumanager.deviceplugin.dirlock import DirectoryLock
from gpumanager.deviceplugin.late import LateHandlers
from gpumanager.deviceplugin.manager import PluginManager
from gpumanager.deviceplugin.resources import vcuda_plugins
from gpumanager.deviceplugin.servicer import ResourceServicer
from gpumanager.faults import stall_point
from gpumanager.flagchecks import check_directory, load_extra_devices, log_compat_flags, nvml_library
from gpumanager.kube.podsource import PodSourceProxy

if TYPE_CHECKING:
    # Loaded after registration (in the background start): not on the kubelet's path.
    from gpumanager.allocation.allocator import Allocator
    from gpumanager.allocation.check import AllocationCheck
    from gpumanager.allocation.pods import Pod
    from gpumanager.allocation.records import ContainerAllocation
    from gpumanager.allocation.response import ResponseSettings
    from gpumanager.deviceplugin.replaced import ReplacedGPUs
    from gpumanager.dra.mode import DRAMode
    from gpumanager.dra.publisher import SlicePublisher
    from gpumanager.kube.connection import ApiConnection
    from gpumanager.memory import QuietTrim
    from gpumanager.metrics.query import QueryEndpoints
    from gpumanager.recovery import Recovery
    from gpumanager.vmanager.ahead import AheadOfStart
    from gpumanager.vmanager.manager import VirtualManager
    from gpumanager.vmanager.refresh import ClaimPidsRefresher, PidsRefresher
    from gpumanager.volume.keeper import MirrorKeeper

log = logging.getLogger(__name__)

#: How long after the agent began Allocate waits for its start (allocation state, API server, driver mirror).
#: The kubelet calls Allocate without a deadline and fails the pod's admission for good on any error, so an
#: early refusal fails pods a slow start (a slow disk, a long journal, the first driver mirror) would have
#: served; but the kubelet admits pods one at a time meanwhile, and its health check calls its sync loop
#: stuck after 5 minutes: well within that.
ALLOCATE_WAIT_SECONDS = 60.0
#: PreStartContainer's wait for the allocation state: the kubelet gives the call 30 s, then fails the
#: container's start (retried, with backoff).
PRE_START_WAIT_SECONDS = 25.0
#: GetPreferredAllocation's wait for the allocation state: without an answer the kubelet chooses itself.
PREFERRED_WAIT_SECONDS = 5.0
#: How long the background start waits for the pod cache before Allocate asks the API server directly.
POD_CACHE_WAIT_SECONDS = 5.0
#: How long the background start waits for the first registration with the kubelet and the kubelet's
#: first full ListAndWatch of both resources.
REGISTRATION_FIRST_SECONDS = 1.0
#: How long DRA mode's start waits for its first ResourceSlice write before it goes on.
SLICE_FIRST_SECONDS = 1.0
#: How long a stop waits for a step of the background start in progress (a component being started).
STOP_WAITS_FOR_START_SECONDS = 1.0
#: How long a stop waits for the work the last kubelet calls left for after their answers.
DEFERRED_DRAIN_SECONDS = 0.5


#: Seconds the start waits for a driver whose kernel module is not loaded yet (being installed) before
#: it exits 3: below what the DaemonSet's liveness probe allows a start (15 s + 6 x 10 s), so a driver
#: loaded meanwhile is used without a restart and the crash-loop backoff that follows it.
DRIVER_WAIT_SECONDS = 45.0


class StartupError(RuntimeError):
    """The agent cannot start; ``exit_code`` is what the process should exit with."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _pod_cgroup_gone(cgroup_root: Path, pod_uid: str) -> bool:
    """Whether no cgroup of pod ``pod_uid`` is left under ``cgroup_root`` (the kubelet removes it once the
    pod's containers have stopped)."""
    from gpumanager.vmanager.cgroups import pod_cgroups

    try:
        return not pod_cgroups(cgroup_root, pod_uid)
    except OSError:
        return True


def _ignore(*_args: object) -> None:
    """A callback that does nothing (a part not used in this mode)."""


class Agent:
    """The node agent: owns every component and their order of start and stop."""

    def __init__(self, config: Config, *, held_locks: Sequence[int] = ()) -> None:
        """``held_locks``: the descriptors of the socket directories the command line locked (the lock of
        --device-plugin-path is moved to that directory when it is made again)."""
        self.config = config
        self._held_locks = tuple(held_locks)
        # Device-plugin mode: the lock of --virtual-manager-path, moved with the directory made again.
        self._vm_lock: DirectoryLock | None = None
        self.node_name = config.resolved_node_name()
        self.gpus: list[GPUInfo] = []
        self.lost: list[int] = []  # at start (the health propagation follows those that come back)
        self.replaced: dict[int, str] = {}  # at start: GPU index -> the UUID the saved inventory had there
        self.was: dict[int, GPUInfo] = {}  # at start: the saved inventory (GPU index -> the GPU saved there)
        self.replaced_gpus: ReplacedGPUs | None = None  # starts from answers naming a GPU since replaced
        self.driver_version = ""
        self.topology = NodeTopology(levels=())
        self.layout: DeviceLayout | None = None
        self.health: HealthMonitor | None = None
        self.propagation: HealthPropagation | None = None
        self.plugins: PluginManager | None = None
        self.servicers: list[ResourceServicer] = []
        self.device_lists: DeviceLists | None = None
        self.pods = PodSourceProxy()
        self.allocator: Allocator | None = None
        self.recovery: Recovery | None = None
        # The kubelet's calls until the allocation state is loaded (after registration).
        self.handlers = LateHandlers(
            ALLOCATE_WAIT_SECONDS, pre_start_seconds=PRE_START_WAIT_SECONDS, prefer_seconds=PREFERRED_WAIT_SECONDS
        )
        self.vmanager: VirtualManager | None = None
        self.mirror: MirrorKeeper | None = None
        self.refresher: PidsRefresher | None = None
        self.claim_refresher: ClaimPidsRefresher | None = None
        self.trimmer: QuietTrim | None = None
        self.api: ApiConnection | None = None
        self.check: AllocationCheck | None = None
        self.ahead: AheadOfStart | None = None  # pods' directories and sockets before their start
        self.query: QueryEndpoints | None = None
        self.dra: DRAMode | None = None
        self._slices: SlicePublisher | None = None
        self.component_errors: dict[str, str] = {}
        self.ready = threading.Event()  # the background start is done: Allocate may proceed
        self._nvml_started = False
        self._stopping = threading.Event()
        # Held while a component is being started in the background and while the agent stops: a
        # component is either started before the stop looks (and stopped by it) or never started.
        self._lifecycle = threading.Lock()
        self.started_at = 0.0

    # -- start ----------------------------------------------------------------------------------

    def start(self) -> None:
        """Serve the device plugin as early as possible; the rest comes up in the background.

        Raises StartupError when the device plugin cannot be served.
        """
        cfg = self.config
        self.started_at = time.monotonic()
        log.info("gpu-manager %s starting on node %s", __version__, self.node_name)
        log_compat_flags(cfg)
        if not Path(cfg.cgroup_root).is_dir():  # the host's cgroup file system not mounted there: said once
            log.warning(
                "--cgroup-root=%s does not exist or is no directory: no container's processes can be found, so "
                "per-container usage stays empty (mount the host's /sys/fs/cgroup there)",
                cfg.cgroup_root,
            )
        try:
            extra_devices = load_extra_devices(cfg.extra_config)
            self._labels = parse_node_labels(cfg.node_labels)
            check_directory("--virtual-manager-path", cfg.virtual_manager_path)
            check_directory("--checkpoint-path", cfg.checkpoint_path)
            if cfg.mode == "dra":  # the directories of its sockets and its CDI specs
                check_directory("--plugin-registry-path", cfg.plugin_registry_path)
                check_directory("--dra-plugin-path", str(cfg.dra_socket_dir))
                # where every claim's CDI spec goes: one that cannot be a directory prepares no claim
                check_directory("--cdi-root", cfg.cdi_root)
            elif Path(cfg.device_plugin_path).exists() and not Path(cfg.device_plugin_path).is_dir():
                # (a directory it cannot write fails the start below, with the errno)
                raise ConfigError(f"--device-plugin-path={cfg.device_plugin_path}: exists and is not a directory")
        except ConfigError as exc:
            raise StartupError(str(exc), 2) from exc
        self._extra_devices = extra_devices
        # A stop may come while a step runs (the start runs beside the signal handling): none is
        # started after it, and one in progress is stopped by it.
        steps = [self._start_nvml, self._start_health]
        if cfg.mode != "dra":
            steps.append(self._start_plugins)
        for step in steps:
            if not self._unless_stopping(step):
                log.info("stopping: the start goes no further")
                return
        threading.Thread(target=self._start_background, name="start-background", daemon=True).start()

    def _start_nvml(self) -> None:
        try:
            stall_point("start-nvml")
            nvml.init(nvml_library(self.config), wait_for_driver=DRIVER_WAIT_SECONDS, stopping=self._stopping)
            self._nvml_started = True
            node = discovery.discover(Path(self.config.checkpoint_path))
        except nvml.NVMLLibraryError as exc:
            raise StartupError(f"--nvml-lib={self.config.nvml_lib}: {exc}", 2) from exc
        except (nvml.NVMLUnavailableError, nvml.NVMLError) as exc:
            raise StartupError(str(exc), 3) from exc
        self.gpus, self.lost, self.topology = node.gpus, node.lost, node.topology
        self.replaced = node.replaced
        self.was = node.was
        self.driver_version = node.driver.driver_version
        self.layout = DeviceLayout(self.gpus)

    def _start_allocation(self) -> None:
        """Topology tree, allocation state (local files only), the kubelet calls' handlers."""
        from gpumanager.allocation.allocator import Allocator, AllocatorSettings
        from gpumanager.deviceplugin.replaced import FILE as replaced_file
        from gpumanager.deviceplugin.replaced import ReplacedGPUs, renumbered
        from gpumanager.recovery import Recovery, report_gpus_gone
        from gpumanager.topology import build_tree, empty_tree, render_graph
        from gpumanager.vmanager.manager import VirtualManager
        from gpumanager.volume.keeper import MirrorKeeper

        cfg = self.config
        stall_point("start-allocation")
        assert self.layout is not None
        if not self.lost:
            inventory.save(Path(cfg.checkpoint_path) / inventory.FILE, self.gpus, self.topology)
        # The allocator owns the tree from here on (its lock guards it).
        tree = build_tree(self.gpus, self.topology) if self.gpus else empty_tree()
        for index in self.lost:
            tree.set_healthy(index, False)
        for line in render_graph(tree).splitlines():
            log.info("topology %s", line)
        self.mirror = MirrorKeeper(
            volume_config=cfg.volume_config,
            driver_root=cfg.driver_root,
            # DRA mode always has shares (a claim's consumed capacity): the mirror gets the interceptor.
            share_mode=cfg.share_mode or cfg.mode == "dra",
            interceptor=cfg.vcuda_library,
            gpu_client=cfg.gpu_client_path,
            proc_root=cfg.proc_root,
            report=self._mirror_state,
        )
        allocator = Allocator(
            gpus=self.gpus,
            tree=tree,
            pods=self.pods,
            settings=AllocatorSettings(share_mode=cfg.share_mode, response=self._response_settings()),
            checkpoint_path=Path(cfg.checkpoint_path) / names.OWN_CHECKPOINT,
            share_problem=lambda: self.mirror.share_problem if self.mirror else "",
        )
        allocator.renumbered = renumbered(self.was, self.gpus)
        self.allocator = allocator
        if self.propagation is not None:
            self.propagation.attach_allocator(allocator)
        recovery = self.recovery = Recovery(
            allocator,
            kubelet_checkpoint_path=Path(cfg.device_plugin_path) / names.KUBELET_CHECKPOINT,
            layout=self.layout,
            gpus=self.gpus,
            vm_path=Path(cfg.virtual_manager_path),
        )
        recovery.from_disk()
        if self.lost and allocator.renumbered and all(i in self.was for i in self.lost):
            # The records taken over follow their GPUs' minors of now (written again as such): the inventory
            # says so too (the lost GPUs as saved, with the minors they are counted with), or the next start
            # would move them again.
            inventory.save(Path(cfg.checkpoint_path) / inventory.FILE, self.gpus, self.topology)
        guard = self.replaced_gpus = ReplacedGPUs(
            self.was,
            self.gpus,
            self.lost,
            allocator.allocations,
            pod_name=self._pod_name,
            state_path=Path(cfg.checkpoint_path) / replaced_file,
            renumbered=allocator.renumbered_from,
            wait_limit=cfg.replaced_gpu_wait,
        )
        affected = guard.note_held(allocator.allocations())  # each logged with what its next start does
        guard.note_answered(recovery.kubelet_answers)
        report_gpus_gone([a for a in allocator.allocations() if a.key not in affected], self.gpus, self.lost)
        problem = allocator.probe_checkpoint()
        if problem:
            self._component_failed("checkpoint", f"{problem}; serving existing allocations, refusing new ones")
        allocator.start_compactor()
        self.vmanager = VirtualManager(
            vm_path=Path(cfg.virtual_manager_path),
            cgroup_root=Path(cfg.cgroup_root),
            allocation=allocator.get,
            pod=self.pods.get,
            driver_version=self.driver_version,
            dir_lock=self._vm_lock,
        )
        # The pods that hold allocations (an agent restart) get their vcuda.sock back now, not once the
        # API server answered: the upstream library kills a process whose registration finds no one
        # listening, while a registration made now waits for the pod cache (bounded).
        self.vmanager.resume(sorted({a.answered[0] for a in allocator.allocations()}))
        if self.plugins is not None:
            self._attach_handlers(allocator)

    def _response_settings(self) -> ResponseSettings:
        from gpumanager.allocation.response import ResponseSettings

        assert self.mirror is not None
        return ResponseSettings(
            vdriver_nvidia=self.mirror.nvidia,
            vdriver_origin=self.mirror.origin,
            virtual_manager_path=self.config.virtual_manager_path,
            extra_devices=self._extra_devices,
        )

    def _start_health(self) -> None:
        self.health = HealthMonitor(
            self.gpus,
            ignored_xids=self.config.ignored_xids,
            quiet_period=self.config.health_quiet_period,
            probe_period=self.config.health_probe_period,
            lost=self.lost,
            report=self._report,
            saved=Path(self.config.checkpoint_path) / SAVED_FILE,  # GPUs out for an XID stay out across a restart
            shares=self.config.share_mode or self.config.mode == "dra",  # DRA claims always carry shares
        )
        # The kubelet hears first: prepared lists, then the allocator (whose lock an Allocate may hold).
        self.propagation = HealthPropagation(self.health, self.gpus, self.lost)
        self.propagation.listen()
        self.health.add_listener(lambda _index, _state: self.api.gpu_health_changed() if self.api else None)
        self.health.start()

    def _start_plugins(self) -> None:
        cfg = self.config
        assert self.layout is not None and self.propagation is not None
        lists = self.device_lists = DeviceLists(self.layout, self.gpus, unhealthy=self.lost)
        # Health changes reach the lists from now on (the servicers are woken once they exist).
        self.propagation.attach_device_lists(lists, self.servicers)
        dp_dir = Path(cfg.device_plugin_path)
        vm_dir = Path(cfg.virtual_manager_path)
        dp_lock = DirectoryLock(dp_dir, f"--device-plugin-path={dp_dir}", self._held_locks)
        try:
            same = vm_dir.samefile(dp_dir)
        except OSError:
            same = False
        # One lock per directory (the command line locked it once): the pods' directory made again is
        # locked before anything is written there, as the sockets' is.
        self._vm_lock = dp_lock if same else DirectoryLock(vm_dir, f"--virtual-manager-path={vm_dir}", self._held_locks)
        self.plugins, servicers = vcuda_plugins(
            lists,
            self.handlers,
            dp_dir,
            cfg.kubelet_socket,
            watch_period=cfg.kubelet_watch_period,
            dir_lock=dp_lock,
            also_follow=[] if same else [self._vm_lock],
        )
        self.servicers.extend(servicers)
        try:
            # The servers listen when this returns; registration runs in the manager's thread.
            self.plugins.start()
        except (OSError, RuntimeError) as exc:
            raise StartupError(f"cannot serve the device plugin in --device-plugin-path={dp_dir}: {exc}", 2) from exc

    def _attach_handlers(self, allocator: Allocator) -> None:
        """The kubelet's Allocate, PreStartContainer and GetPreferredAllocation, now that the state is loaded."""
        from gpumanager.deviceplugin.handlers import Handlers
        from gpumanager.deviceplugin.preferred import Preference
        from gpumanager.kube.kubelet_checkpoint import KubeletRecords
        from gpumanager.kube.owners import OwnerResolver
        from gpumanager.kube.podresources import PodResourcesClient

        cfg = self.config
        assert self.layout is not None
        owners = OwnerResolver(
            pod_resources=PodResourcesClient(Path(cfg.pod_resources_socket)),
            kubelet_checkpoint_path=Path(cfg.device_plugin_path) / names.KUBELET_CHECKPOINT,
            find_pod=self.pods.lookup,
        )
        # Asked only when a request's only room is that of an allocation freed before its start.
        allocator.set_holder_lookup(lambda ids: owners.owner(names.VCORE_RESOURCE, ids))
        # Asked only when a request names the IDs of a started container whose pod runs: whether the kubelet
        # forgot that container (it started before the kubelet's last restart, or this agent's start, and the
        # kubelet's checkpoint read then does not list it). Read here from what recovery read at start, and
        # again at each registration with a restarted kubelet; never per Allocate.
        records = KubeletRecords(Path(cfg.device_plugin_path) / names.KUBELET_CHECKPOINT, names.VCORE_RESOURCE)
        assert self.recovery is not None

        def started() -> list[tuple[str, str]]:
            return [a.key for a in allocator.allocations() if a.started]

        records.note_restart(started(), listed=self.recovery.kubelet_listed)
        assert self.plugins is not None
        self.plugins.on_kubelet_restart(lambda: records.note_restart(started()))
        allocator.set_kubelet_records(records.holds)
        handlers = Handlers(
            allocator=allocator,
            layout=self.layout,
            owner=owners.owner,
            prepared=self._prepared,
            observe=self._observe_call,
            ready=self._wait_ready,
            replaced=self.replaced_gpus,
        )
        self.handlers.attach(handlers, Preference(allocator.clone_tree, self.layout, preview=allocator.preview).choose)

    # -- the background part of the start --------------------------------------------------------

    def _start_background(self) -> None:
        # Registration and the kubelet's first lists first: loading the allocation state and the
        # Kubernetes client would compete with them for the interpreter.
        if self.plugins is not None:
            self.plugins.wait_listed(REGISTRATION_FIRST_SECONDS)
        if self.config.mode == "dra":
            try:
                self._start_dra_slices()
            except Exception as exc:
                log.exception("cannot start publishing the ResourceSlice")
                self._component_failed("resourceslice", f"cannot start publishing the ResourceSlice: {exc}")
        try:
            if not self._unless_stopping(self._start_allocation):
                return
        except Exception as exc:
            log.exception("cannot load the allocation state")
            self._component_failed("allocation", f"cannot load the allocation state: {exc}")
            self.handlers.fail(f"the allocation state could not be loaded: {exc}")
            self._withdraw_slices("the allocation state could not be loaded")
            self.ready.set()
            return
        try:
            self._unless_stopping(self._start_mirror)
            self._unless_stopping(self._start_query)
            try:
                if self.config.mode == "dra":
                    # The kubelet's sockets first: the pod cache's wait below is Allocate's, not theirs.
                    if self.api is None:
                        self._start_api_client()
                    self._start_dra()
            finally:
                self._start_kube()  # waits on the API server: not under the lock (the stop interrupts it)
        except Exception as exc:  # a bug, not an operator's error (those are reported where they happen)
            serving = "the DRA driver" if self.config.mode == "dra" else "the device plugin"
            message = f"the start did not complete: {exc!r}; {serving} goes on serving what was started"
            self.component_errors["start"] = message
            log.exception("%s", message)
        finally:
            self.ready.set()
        if not self._unless_stopping(self._start_loops):
            return
        self._label_node()
        if self.config.mode == "dra":
            if self.dra is None:  # why is logged above (and on /healthz, /readyz)
                log.error("DRA driver %s is not serving claims (the error above says why)", self.config.dra_driver_name)
            else:
                log.info("DRA driver %s started in %.0f ms", self.config.dra_driver_name, self._since_start_ms())
            return
        log.info(
            "serving %d GPUs: %s=%d, %s=%d devices in %s (started in %.0f ms)",
            len(self.gpus),
            names.VCORE_RESOURCE,
            self.layout.count(names.VCORE_RESOURCE) if self.layout else 0,
            names.VMEMORY_RESOURCE,
            self.layout.count(names.VMEMORY_RESOURCE) if self.layout else 0,
            self.config.device_plugin_path,
            self._since_start_ms(),
        )

    def _since_start_ms(self) -> float:
        return (time.monotonic() - self.started_at) * 1000

    def _unless_stopping(self, start: Callable[[], None]) -> bool:
        """Run one step of the background start unless the agent is stopping (False then). The stop
        waits for a step in progress, so whatever the step starts is seen, and stopped, by it."""
        with self._lifecycle:
            if self._stopping.is_set():
                return False
            start()
            return True

    def _start_mirror(self) -> None:
        assert self.mirror is not None and self.allocator is not None
        if self.config.volume_config and not self.mirror.build():
            self._component_failed("volume", f"driver mirror not built: {self.mirror.error}")
        self.allocator.set_response_settings(self._response_settings())
        self.mirror.start()

    def _start_query(self) -> None:
        """Display gRPC and HTTP (/metrics, /healthz, /readyz); prometheus_client is loaded here."""
        from gpumanager.metrics.query import QueryEndpoints

        assert self.allocator is not None
        self.query = QueryEndpoints(self, self.allocator, self._component_failed)
        self.query.start()

    def _start_kube(self) -> None:
        """The API-server side: pod cache, allocation check, recovery (the client is built here, or was
        already in DRA mode)."""
        from gpumanager.allocation.check import AllocationCheck
        from gpumanager.kube.podresources import PodResourcesClient

        assert self.allocator is not None and self.vmanager is not None and self.recovery is not None
        allocator, vmanager = self.allocator, self.vmanager
        api = self.api or self._start_api_client()
        if api is None:
            return
        device_plugin = self.config.mode != "dra"
        # DRA mode: allocations left from device-plugin mode are only freed when their pods end
        # (claims are freed by NodeUnprepareResources; no directory is removed by this check).
        self.check = AllocationCheck(
            allocator,
            self.pods,
            period=float(self.config.allocation_check_period),
            annotate=self._annotate if device_plugin else _ignore,
            delete_failed=api.delete_failed if device_plugin else _ignore,
            collect_dirs=vmanager.gc if device_plugin else _ignore,
            wait_synced=self.pods.wait_synced,
            stopped=functools.partial(_pod_cgroup_gone, Path(self.config.cgroup_root)),
        )
        dra = self.config.mode == "dra"
        listener = self.check.on_pod_event
        if device_plugin:
            from gpumanager.vmanager.ahead import AheadOfStart

            ahead = AheadOfStart(vmanager.prepare_ahead, gone=self.check.collect_pod)
            with self._lifecycle:
                if self._stopping.is_set():
                    return
                self.ahead = ahead
            ahead.start()
            check = self.check

            def listener(kind: str, pod: Pod) -> None:
                check.on_pod_event(kind, pod)
                ahead.on_pod_event(kind, pod)

        cache = api.connect(listener)
        if cache is None:
            if dra and "dra" in self.component_errors:  # which logged it, saying what it costs
                self.component_errors["api-server"] = api.error
            else:
                self._component_failed("api-server", f"{api.error}; serving without it (Allocate will refuse)")
            self.pods.fail(api.error)
        else:
            self.pods.attach(cache)
            if not dra:  # the scheduler extender's view of each GPU (DRA mode has ResourceSlices)
                health = self.health
                api.publish_inventory(
                    self.gpus,
                    self.topology,
                    lambda: {i: s.healthy for i, s in (health.snapshot() if health else {}).items()},
                    share_mode=self.config.share_mode,
                )
            if not cache.wait_synced(POD_CACHE_WAIT_SECONDS):
                log.warning("the pod cache is not synced yet; Allocate will ask the API server directly")
        pod_resources = PodResourcesClient(Path(self.config.pod_resources_socket))
        if not self.recovery.from_pod_resources(pod_resources, self.pods.lookup):
            threading.Thread(
                target=self.recovery.retry_pod_resources,
                args=(pod_resources, self.pods.lookup, self._stopping),
                name="pod-resources-recovery",
                daemon=True,
            ).start()
        # Again: the kubelet's PodResources may have named allocations the checkpoints did not hold.
        vmanager.resume(sorted({a.answered[0] for a in allocator.allocations()}))

    def _start_api_client(self) -> ApiConnection | None:
        """The API connection and its client (the Kubernetes package is loaded here, the slowest part of
        the start); None when the agent is stopping. A client that cannot be built leaves
        ``api.error`` set for the pod cache's start to report."""
        from gpumanager.kube.connection import ApiConnection

        api = ApiConnection(kubeconfig=self.config.kubeconfig, node_name=self.node_name)
        with self._lifecycle:
            if self._stopping.is_set():
                return None
            self.api = api
        api.client()
        return api

    def _start_dra_slices(self) -> None:
        """DRA mode publishes its ResourceSlice first, before the allocation state, the endpoints and the
        pod cache load: the slice needs only the GPUs and their health, and the scheduler waits on it."""
        from gpumanager.dra.mode import DRASettings, make_publisher

        api = self._start_api_client()
        api_client = api.client() if api is not None else None
        if api_client is None:
            return

        publisher = make_publisher(
            api_client,
            settings=DRASettings.from_config(self.config),
            node=self.node_name,
            gpus=self.gpus,
            topology=self.topology,
            health=self.health,
            report=self._report,
        )
        with self._lifecycle:
            if self._stopping.is_set():
                return
            self._slices = publisher
        threading.Thread(target=publisher.start, name="slice-first-sync", daemon=True).start()
        # The first write goes out before the rest of the start competes with it for the interpreter;
        # an API server that does not answer is not waited for long (the publisher keeps retrying).
        publisher.published.wait(SLICE_FIRST_SECONDS)

    def _start_dra(self) -> None:
        """DRA mode: claims prepared into the same allocation state, limit files and driver mirror."""
        # Loaded before the lifecycle lock is taken (a stop waits on the lock, not on imports).
        import gpumanager.dra.mode
        import gpumanager.metrics.claims  # noqa: F401
        from gpumanager.dra.plugin import socket_paths

        cfg = self.config
        if self.api is None or self.api.api is None:
            why = self.api.error if self.api is not None and self.api.error else "no API client"
            self._component_failed(
                "dra", f"DRA mode needs the API server ({why}): the DRA driver is not registered, no claim is prepared"
            )
            return
        stall_point("start-dra")
        try:
            if not self._unless_stopping(self._start_dra_mode):
                return
        except (OSError, RuntimeError) as exc:  # a directory broken since start() checked it; a bind refused
            reg_sock, dra_sock = socket_paths(cfg.plugin_registry_path, str(cfg.dra_socket_dir), cfg.dra_driver_name)
            self._component_failed(
                "dra",
                f"cannot serve the DRA driver on {dra_sock} (--dra-plugin-path) and {reg_sock} "
                f"(--plugin-registry-path): {exc}; not serving claims",
            )
            # Made but not serving: not the agent's DRA driver (the start's last line, /readyz, the stop).
            with self._lifecycle:
                dra, self.dra = self.dra, None
            if dra is not None:
                dra.stop()
            self._withdraw_slices("the DRA driver cannot be served")
            return
        from gpumanager.dra.constants import slice_name

        assert self.dra is not None
        # The kubelet registers the driver when it finds the registration socket: not waited for here. The
        # sockets' watch says once when it has not within --wait-timeout (/readyz tells it meanwhile).
        log.info(
            "serving %d GPUs as DRA driver %s: ResourceSlice %s, %s (no device-plugin socket)",
            len(self.gpus),
            cfg.dra_driver_name,
            slice_name(self.node_name, cfg.dra_driver_name),
            self.dra.sockets.service_socket,
        )

    def _withdraw_slices(self, why: str) -> None:
        """DRA mode serves no claim: the ResourceSlice published first in the start is deleted, so that no
        claim is placed on GPUs that cannot be prepared."""
        if self.config.mode == "dra" and self._slices is not None:
            self._slices.withdraw(why)

    def _start_dra_mode(self) -> None:
        from gpumanager.dra import cdi
        from gpumanager.dra.mode import DRAMode, DRASettings, nvml_processes
        from gpumanager.metrics.claims import ClaimCollector, DRAStateCollector, FeatureGateCollector

        cfg = self.config
        assert self.allocator is not None and self.health is not None and self.mirror is not None
        assert self.api is not None and self.api.api is not None
        self.dra = DRAMode(
            settings=DRASettings.from_config(self.config),
            publisher=self._slices,
            node=self.node_name,
            gpus=self.gpus,
            topology=self.topology,
            health=self.health,
            allocator=self.allocator,
            api_client=self.api.api,
            pods=self.pods.pods,
            pods_synced=self.pods.synced,
            pod=self.pods.get,
            cdi_settings=cdi.CDISettings(
                root=Path(cfg.cdi_root),
                driver=cfg.dra_driver_name,
                vdriver_nvidia=self.mirror.nvidia,
                vdriver_origin=self.mirror.origin,
                virtual_manager_path=cfg.virtual_manager_path,
                extra_devices=self._extra_devices,
            ),
            vm_path=Path(cfg.virtual_manager_path),
            cgroup_root=Path(cfg.cgroup_root),
            proc_root=Path(cfg.proc_root),
            gpu_processes=nvml_processes,
            driver_version=self.driver_version,
            dir_lock=DirectoryLock(cfg.dra_socket_dir, f"--dra-plugin-path={cfg.dra_socket_dir}", self._held_locks),
            observe=functools.partial(self._observe_call, cfg.dra_driver_name),
            report=self._report,
        )
        if self.query is not None:
            self.query.registry.register(ClaimCollector(self.dra.claims, self.pods.pods, self.gpus, self.dra.reserved))
            self.query.registry.register(FeatureGateCollector(self.dra.gates_off))
            dra = self.dra
            self.query.registry.register(DRAStateCollector(lambda: dra.leaked_freed, lambda: bool(dra.slice_withdrawn)))
        self.dra.start()

    def _report(self, name: str, message: str | None) -> None:
        """A component's error (logged once), or its recovery (None)."""
        if message is None:
            self.component_errors.pop(name, None)
        elif self.component_errors.get(name) != message:
            self._component_failed(name, message)

    def _start_loops(self) -> None:
        assert self.allocator is not None and self.vmanager is not None
        if self.check is not None:
            if self.dra is not None:  # claims the kubelet never unprepares, freed once the API server says gone
                self.check.also(self.dra.free_leaked)
            self.check.start()
        from gpumanager.vmanager.refresh import ClaimPidsRefresher, PidsRefresher

        self.refresher = PidsRefresher(self.vmanager, self.allocator.allocations)
        self.refresher.start()
        if self.dra is not None:
            self.claim_refresher = ClaimPidsRefresher(self.dra.refresh_pids)
            self.claim_refresher.start()
        from gpumanager.memory import QuietTrim, settle_after_start

        settle_after_start()  # what lives now lives for good: full collections skip it from now on
        # What the start and each burst of allocation changes freed goes back once it is quiet.
        self.trimmer = QuietTrim()
        self.trimmer.start()
        self.allocator.add_listener(self.trimmer.poke)
        self.trimmer.poke()

    def _label_node(self) -> None:
        if self.api is None or not self._labels:
            return
        # Labels the API server did not take at start go on being tried; once applied, the error goes.
        problem = self.api.label_node(
            self._labels,
            self.gpus[0].name if self.gpus else "",
            on_result=lambda message: self._report("node-labels", message or None),
        )
        if problem:
            self._component_failed("node-labels", problem)

    def _mirror_state(self, error: str) -> None:
        """After each build of the driver mirror: its error ('' when built) in the probes' bodies (the
        keeper logs it; a start-time failure is logged by the start)."""
        if error:
            self.component_errors["volume"] = f"driver mirror not built: {error}"
        else:
            self.component_errors.pop("volume", None)

    def _component_failed(self, name: str, message: str) -> None:
        self.component_errors[name] = message
        log.error("%s", message)

    # -- callbacks ------------------------------------------------------------------------------

    def _wait_ready(self) -> str:
        """Allocate waits (bounded) for the background start; '' when it may proceed."""
        if self.ready.is_set() or self.ready.wait(self.handlers.remaining()):  # is_set: no lock once started
            return "the agent is stopping" if self._stopping.is_set() else ""
        return f"the agent is still starting (API server, driver mirror) {ALLOCATE_WAIT_SECONDS:g} s after it began"

    def _prepared(self, alloc: ContainerAllocation) -> None:
        """After PreStartContainer's check: limit files, then the pod's annotations (not awaited)."""
        assert self.vmanager is not None and self.allocator is not None
        for each in self.allocator.holding_same_ids(alloc):  # the kubelet does not say which of them starts
            self.vmanager.prepare(each)
        deferred.later(self._annotate, alloc.pod_uid)  # the patcher's thread wakes once the call is answered

    def _pod_name(self, pod_uid: str) -> tuple[str, str] | None:
        """(namespace, name) of the pod of that UID in the pod cache, or None."""
        pod: Pod | None = self.pods.get(pod_uid)
        meta = pod.get("metadata") if isinstance(pod, dict) else None
        if not isinstance(meta, dict) or not isinstance(meta.get("name"), str):
            return None
        return str(meta.get("namespace") or "default"), str(meta["name"])

    def _annotate(self, pod_uid: str) -> None:
        if self.api is None or self.allocator is None:
            return
        pod: Pod | None = self.pods.get(pod_uid)
        self.api.annotate(pod, self.allocator.allocations_of(pod_uid))

    def _observe_call(self, resource: str, call: str, seconds: float, ok: bool) -> None:
        if self.query is not None:
            self.query.calls.observe(resource, call, seconds, ok)

    # -- signals and stop ---------------------------------------------------------------------------

    def recheck(self) -> None:
        """SIGHUP: check allocations and the driver mirror now (the agent keeps running)."""
        log.info("re-checking allocations and the driver mirror now")
        if self.check is not None:
            self.check.wake()
        if self.mirror is not None:
            self.mirror.wake()

    def stop(self) -> None:
        """Stop every component, our sockets first; nothing is waited for long (well under 2 s in all)."""
        self._stopping.set()
        # Kubelet calls waiting for the start are answered now (a stop is not to wait out their waits).
        self.handlers.fail("the agent is stopping")
        self.ready.set()
        # A step of the background start in progress finishes first (its components are then
        # stopped here); one that hangs is not waited for beyond the bound.
        locked = self._lifecycle.acquire(timeout=STOP_WAITS_FOR_START_SECONDS)
        try:
            self._stop_components()
        finally:
            if locked:
                self._lifecycle.release()

    def _stop_components(self) -> None:
        if self.plugins is not None:
            self.plugins.stop()
        # What the last calls left for after their answers (log lines, annotations to queue).
        deferred.drain(DEFERRED_DRAIN_SECONDS)
        if self.dra is not None:
            self.dra.stop()
        elif self._slices is not None:
            self._slices.stop()
        if self.query is not None:
            self.query.stop()
        for loop in (self.ahead, self.check, self.refresher, self.mirror, self.claim_refresher, self.trimmer):
            if loop is not None:
                loop.stop()
        if self.vmanager is not None:
            self.vmanager.stop()
        if self.api is not None:
            self.api.stop()
        if self.allocator is not None:
            self.allocator.close()
        stall_point("stop")
        if self.health is not None:
            self.health.stop(timeout=0.6)
        if self._nvml_started:
            nvml.shutdown()
            self._nvml_started = False
