"""Several simulated GPU nodes in one cluster: pods go from creation to a running container.

One API-server simulator; per node a kubelet simulator (device-plugin registration,
PodResources), the real agent process on its own simulated GPUs (its own ``GPUSIM_STATE``) and
a *node loop* doing what the kubelet does with the API server:

* node status: every ``node_status_period`` (10 s, the kubelet's ``nodeStatusUpdateFrequency``)
  the node's capacity and allocatable of the two extended resources are set from the devices
  the plugins report (allocatable: the healthy ones);
* admission of each pod bound to the node, one at a time in arrival order (the kubelet's sync loop): the resource check
  against allocatable (``OutOf<resource>``; the pod's effective requests, its init containers counted as
  the kubelet counts them), then Allocate for every resource of every container, the init containers
  first, in order (an ordinary init container's devices reusable by the later containers of the pod:
  :meth:`~simnode.kubelet.KubeletSimulator.admit_pod`, as the single-node harness does; a container's
  resources in random order, as the kubelet ranges over its limits, a Go map; the
  kubelet simulator's seed is printed, ``SIMNODE_KUBELET_SEED`` repeats it; the agent's refusal
  makes the pod ``Failed`` with reason ``UnexpectedAdmissionError``, as the kubelet does); then, in
  the pod's own worker thread while the next pod is admitted (the kubelet's pod workers),
  PreStartContainer (in random order too) for each container in the same order, then a cgroup and a PID
  per container (an ordinary init container has run to completion: no process, its status terminated,
  ``Completed``; a sidecar runs on beside the app containers); the status
  update (``Running`` with the container IDs) reaches the API server ``status_lag`` seconds
  after the containers started (:data:`~simnode.cluster.STATUS_LAG_SECONDS` by default, as the
  single-node harness; 0 publishes it at once);
* a pod being deleted (a real API server deletes gracefully): its containers stop at once and its
  devices are given back; its last status (containers terminated, a terminal phase) and the
  DELETE with grace 0 follow ``status_lag`` later (:mod:`simnode.kubelet_deletion`); a pod deleted
  or ended otherwise gives its devices back too.

The scheduling is done by :class:`~simnode.scheduler.SchedulerStandIn` configured with
``deploy/scheduler/default-scheduler.yaml``; with ``extender=True`` the real
``gpu-manager-extender`` process is started and the configuration points at it, without it
the stand-in only counts the node totals (as a cluster without gpu-admission does). It offers the
nodes in random order and breaks ties at random, from a seed it prints (``SIMNODE_SCHEDULER_SEED``
or ``seed`` repeats it), and binds the pods concurrently, while each node admits them one at a time.
"""

from __future__ import annotations

import itertools
import logging
import queue
import shutil
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

from kubernetes import client

from gpumanager import names
from gpumanager.kube.gpu_inventory import ANNOTATION, decode
from gpumanager.kube.reflector import Reflector
from simnode.agent_process import SPEC_DIR, AgentProcess
from simnode.apiserver import ApiServerSimulator
from simnode.apiserver_client import HttpPodApi
from simnode.apiserver_objects import pod_manifest
from simnode.apiserver_rbac import SHIPPED, resolve_rules, shipped_account
from simnode.cgroup_files import make_cgroup
from simnode.cluster import STATUS_LAG_SECONDS
from simnode.extender_process import ExtenderProcess
from simnode.gpusim_state import repo_root
from simnode.kubelet import KubeletSimError, KubeletSimulator, admission_order
from simnode.kubelet_deletion import PodTerminator
from simnode.scheduler import SchedulerStandIn, load_configuration, parse_quantity, pod_requests, profile_names
from simnode.simhost import install_sim_driver, volume_conf

log = logging.getLogger(__name__)

DEFAULT_SCHEDULER_CONFIG = Path(__file__).resolve().parent.parent / "deploy" / "scheduler" / "default-scheduler.yaml"
GPU_RESOURCES = (names.VCORE_RESOURCE, names.VMEMORY_RESOURCE)
_pids = itertools.count(50000)


def pending_pod(
    name: str,
    containers: Sequence[tuple[int, int]],
    *,
    namespace: str = "default",
    node_selector: Mapping[str, str] | None = None,
    node: str | None = None,
    annotations: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """A pod to schedule: containers ``c0, c1, ...`` asking (vcuda-core, vcuda-memory blocks).

    ``node`` binds it at creation (the scheduler is not involved, as with ``spec.nodeName``).
    """
    specs = []
    for i, (cores, blocks) in enumerate(containers):
        limits = {}
        if cores:
            limits[names.VCORE_RESOURCE] = str(cores)
        if blocks:
            limits[names.VMEMORY_RESOURCE] = str(blocks)
        specs.append({"name": f"c{i}", "limits": limits, "requests": limits})
    pod = pod_manifest(
        name, namespace=namespace, node=node, containers=specs, annotations=dict(annotations or {}), phase="Pending"
    )
    if node_selector:
        pod["spec"]["nodeSelector"] = dict(node_selector)
    return pod


@dataclass
class Refusal:
    """A pod the node refused at admission."""

    pod: str
    reason: str
    message: str


@dataclass
class _Admitted:
    uid: str
    key: str
    cgroups: list[Path] = field(default_factory=list)
    statuses: list[dict[str, Any]] = field(default_factory=list)


class SimNode:
    """One node: kubelet simulator, agent process, and the node loop (see the module docstring)."""

    def __init__(
        self,
        name: str,
        spec: Path,
        workdir: Path,
        kubeconfig: Path,
        api: client.ApiClient,
        *,
        agent_flags: Sequence[str] = (),
        node_status_period: float = 10.0,
        status_lag: float = STATUS_LAG_SECONDS,
    ) -> None:
        self.name = name
        self.spec = spec
        self.workdir = workdir
        self.kubeconfig = kubeconfig
        self.vm_path = Path(tempfile.mkdtemp(prefix="gm-vm-"))
        self.cgroup_root = workdir / "cgroup"
        self.pod_resources_socket = workdir / "pod-resources" / "kubelet.sock"
        self.kubelet = KubeletSimulator(
            workdir / "device-plugins", pod_resources_socket=self.pod_resources_socket, fill="random"
        )
        # As on a real node: shares mount a driver mirror that holds the interceptor.
        workdir.mkdir(parents=True, exist_ok=True)
        install_sim_driver(workdir / "host")
        mirror = [
            f"--volume-config={volume_conf(workdir / 'vdriver', workdir / 'volume.conf')}",
            f"--driver-root={workdir / 'host'}",
            f"--vcuda-library={repo_root() / 'vcuda' / 'build' / 'libcuda-control.so'}",
        ]
        self.agent = AgentProcess(
            workdir,
            spec,
            extra_args=[
                f"--kubeconfig={kubeconfig}",
                f"--hostname-override={name}",
                "--share-mode=true",
                *mirror,
                f"--virtual-manager-path={self.vm_path}",
                f"--checkpoint-path={workdir / 'checkpoint'}",
                f"--pod-resources-socket={self.pod_resources_socket}",
                f"--cgroup-root={self.cgroup_root}",
                *agent_flags,
            ],
        )
        self._core = client.CoreV1Api(api)
        self._status_period = node_status_period
        self.pods = Reflector(
            f"kubelet-{name}", self._core.list_pod_for_all_namespaces, field_selector=f"spec.nodeName={name}"
        )
        self.pods.add_listener(self._on_pod)
        self._work: queue.Queue[tuple[str, dict[str, Any]] | None] = queue.Queue()
        self._admitted: dict[str, _Admitted] = {}
        self._ended: dict[str, list[dict[str, Any]]] = {}  # container statuses of pods stopped
        self._rejected: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._workers: list[threading.Thread] = []  # pod workers starting containers
        self.refusals: list[Refusal] = []
        self.running = 0
        self._last_status: dict[str, Any] = {}
        self.status_lag = status_lag
        self._status_timers: list[threading.Timer] = []
        self.terminator = PodTerminator(
            HttpPodApi(self._core), name, stop_pod=self._forget, known_statuses=self._known_statuses, lag=status_lag
        )

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the kubelet, the agent, and the node loop; returns once the plugins registered."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.kubelet.start()
        self.agent.start()
        for resource in GPU_RESOURCES:
            self.kubelet.wait_for_registration(resource, timeout=60, with_devices=True)
        self.sync_status()
        self.pods.start()
        for target, label in ((self._status_loop, "status"), (self._admit_loop, "admit")):
            thread = threading.Thread(target=target, name=f"node-{self.name}-{label}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        """Stop the node loop, the agent and the kubelet."""
        self._stop.set()
        self._work.put(None)
        for thread in self._threads:
            thread.join(timeout=10)
        with self._lock:
            workers, self._workers = self._workers, []
        for worker in workers:
            worker.join(timeout=10)
        with self._lock:
            timers, self._status_timers = self._status_timers, []
        for timer in timers:
            timer.cancel()
        self.terminator.stop()
        self.pods.stop()
        self.agent.stop()
        self.kubelet.stop()
        shutil.rmtree(self.vm_path, ignore_errors=True)

    # -- node status ------------------------------------------------------------------------------

    def device_counts(self) -> tuple[dict[str, str], dict[str, str]]:
        """(capacity, allocatable) of the GPU resources, from what the plugins report."""
        capacity, allocatable = {}, {}
        for resource in GPU_RESOURCES:
            devices = self.kubelet.devices(resource)
            capacity[resource] = str(len(devices))
            allocatable[resource] = str(sum(1 for d in devices.values() if d.healthy))
        return capacity, allocatable

    def sync_status(self) -> None:
        """Patch the node's capacity and allocatable when they changed."""
        capacity, allocatable = self.device_counts()
        status = {"capacity": capacity, "allocatable": allocatable}
        if status == self._last_status:
            return
        self._core.patch_node_status(
            self.name, {"status": status}, _content_type="application/merge-patch+json", _preload_content=False
        )
        self._last_status = status

    def _status_loop(self) -> None:
        while not self._stop.wait(self._status_period):
            try:
                self.sync_status()
            except Exception as exc:
                log.warning("node %s: status update failed: %s", self.name, exc)

    # -- pods -------------------------------------------------------------------------------------

    def _on_pod(self, kind: str, pod: dict[str, Any], _prev: dict[str, Any] | None) -> None:
        self._work.put((kind, pod))

    def _admit_loop(self) -> None:
        while not self._stop.is_set():
            item = self._work.get()
            if item is None:
                return
            kind, pod = item
            uid = str(pod["metadata"]["uid"])
            phase = (pod.get("status") or {}).get("phase")
            try:
                if kind == "DELETED" or pod["metadata"].get("deletionTimestamp"):
                    self.terminator.handle(kind, pod)
                elif phase in ("Succeeded", "Failed"):
                    self._forget(uid)
                elif uid not in self._admitted and uid not in self._rejected and phase == "Pending":
                    self._admit(pod)
            except Exception:
                log.exception("node %s: handling pod %s failed", self.name, uid)

    def _known_statuses(self, uid: str) -> list[dict[str, Any]]:
        with self._lock:
            admitted = self._admitted.get(uid)
            return list(admitted.statuses if admitted is not None else self._ended.get(uid, []))

    def _publish(self, md: Mapping[str, Any], status: dict[str, Any], *, running: bool = False) -> None:
        """The kubelet's status update, written ``status_lag`` seconds from now to that very pod;
        ``running``: the containers' start, skipped when they were stopped meanwhile."""
        uid, name, namespace = str(md["uid"]), str(md["name"]), str(md.get("namespace", "default"))
        body = {"metadata": {"uid": uid}, "status": status}

        def write() -> None:
            if running:
                with self._lock:
                    if uid not in self._admitted:
                        return
            try:
                self._core.patch_namespaced_pod_status(
                    name, namespace, body, _content_type="application/merge-patch+json", _preload_content=False
                )
            except client.exceptions.ApiException as exc:
                if exc.status not in (404, 409, 422):  # gone, or another pod of that name
                    log.warning("node %s: status of pod %s/%s not written: %s", self.name, namespace, name, exc)
                return
            if running:
                self.running += 1

        if self.status_lag <= 0:
            write()
            return
        timer = threading.Timer(self.status_lag, write)
        timer.daemon = True
        with self._lock:
            self._status_timers = [t for t in self._status_timers if t.is_alive()] + [timer]
        timer.start()

    def _forget(self, uid: str) -> None:
        with self._lock:
            admitted = self._admitted.pop(uid, None)
            if admitted is not None and admitted.statuses:
                self._ended[uid] = admitted.statuses
        self.kubelet.remove_pod(uid)
        if admitted is not None:
            for path in admitted.cgroups:
                shutil.rmtree(path.parent, ignore_errors=True)

    def _reject(self, pod: dict[str, Any], reason: str, message: str) -> None:
        md = pod["metadata"]
        key = f"{md.get('namespace', 'default')}/{md['name']}"
        log.info("node %s rejects pod %s: %s: %s", self.name, key, reason, message)
        self.refusals.append(Refusal(key, reason, message))
        with self._lock:
            self._rejected.add(str(md["uid"]))
        self.kubelet.remove_pod(str(md["uid"]))
        self._publish(md, {"phase": "Failed", "reason": reason, "message": message})

    def _used(self, exclude: str) -> dict[str, Decimal]:
        used: dict[str, Decimal] = {}
        for other in self.pods.objects():
            uid = str(other["metadata"]["uid"])
            if uid == exclude or uid not in self._admitted:
                continue
            for r, v in pod_requests(other).items():
                used[r] = used.get(r, Decimal(0)) + v
        return used

    def _admit(self, pod: dict[str, Any]) -> None:
        md = pod["metadata"]
        uid, name, namespace = str(md["uid"]), str(md["name"]), str(md.get("namespace", "default"))
        _, allocatable = self.device_counts()
        used = self._used(uid)
        requests = pod_requests(pod)  # init containers and sidecars counted as the kubelet's admission does
        for resource in GPU_RESOURCES:
            asked = requests.get(resource, Decimal(0))
            have = Decimal(allocatable[resource]) - used.get(resource, Decimal(0))
            if asked > have:
                self._reject(
                    pod,
                    f"OutOf{resource}",
                    f"Pod was rejected: Node didn't have enough resource: {resource}, requested: {asked}, "
                    f"used: {used.get(resource, 0)}, capacity: {allocatable[resource]}",
                )
                return
        try:
            # Init containers first, as the kubelet's device manager does (see KubeletSimulator.admit_pod).
            for _ in self.kubelet.admit_pod(pod, GPU_RESOURCES):
                pass
        except KubeletSimError as exc:
            self._reject(pod, "UnexpectedAdmissionError", f"Allocate failed due to {exc}, which is unexpected")
            return
        with self._lock:
            admitted = self._admitted[uid] = _Admitted(uid, f"{namespace}/{name}")
            # Admitted, the pod is handed to its own pod worker, which starts its containers; the sync
            # loop goes on to the next pod at once.
            worker = threading.Thread(target=self._start_pod, args=(pod, admitted), name=f"pod-{name}", daemon=True)
            self._workers = [w for w in self._workers if w.is_alive()] + [worker]
        worker.start()

    def _start_pod(self, pod: dict[str, Any], admitted: _Admitted) -> None:
        """The pod worker: for each container, init containers first, PreStartContainer for its resources, then
        its cgroup and PID (none for an init container run to completion), then the status update; stops
        where the pod was removed meanwhile."""
        md = pod["metadata"]
        uid = admitted.uid
        init_statuses: list[dict[str, Any]] = []
        statuses: list[dict[str, Any]] = []
        try:
            # Init containers one after the other, each run to completion (its process gone) before the next
            # starts; a sidecar runs on beside the app containers, as these do.
            for c, ordinary_init in admission_order(pod):
                limits = (c.get("resources") or {}).get("limits") or {}
                wanted = [r for r in GPU_RESOURCES if int(parse_quantity(limits.get(r, 0)))]
                for resource in self.kubelet.limits_order(wanted):
                    try:
                        self.kubelet.pre_start(resource, pod_uid=uid, container_name=c["name"])
                    except KubeletSimError as exc:
                        self._prestart_failed(pod, c["name"], str(exc))
                        return
                cid = f"{uid.replace('-', '')[:16]}{c['name']}"
                directory = self.cgroup_root / "kubepods" / f"pod{uid}" / cid
                now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
                status = {
                    "name": c["name"],
                    "containerID": f"containerd://{cid}",
                    "ready": True,
                    "restartCount": 0,
                    "image": c.get("image", ""),
                    "imageID": "",
                    "state": {"running": {"startedAt": now}},
                }
                with self._lock:
                    if self._admitted.get(uid) is not admitted:
                        return  # removed while it started
                    if ordinary_init:
                        done = {"exitCode": 0, "reason": "Completed", "containerID": status["containerID"]}
                        status["state"] = {"terminated": {**done, "startedAt": now, "finishedAt": now}}
                        init_statuses.append(status)
                        continue
                    make_cgroup(directory, [next(_pids)])
                    admitted.cgroups.append(directory)
                    if any(i is c for i in (pod["spec"].get("initContainers") or [])):
                        init_statuses.append(status)  # a sidecar
                    else:
                        admitted.statuses.append(status)
                    statuses = list(admitted.statuses)
        except Exception:
            log.exception("node %s: starting pod %s failed", self.name, admitted.key)
            return
        published: dict[str, Any] = {"phase": "Running", "containerStatuses": statuses, "qosClass": "BestEffort"}
        if init_statuses:
            published["initContainerStatuses"] = init_statuses
        self._publish(md, published, running=True)

    def _prestart_failed(self, pod: dict[str, Any], container: str, message: str) -> None:
        md = pod["metadata"]
        key = f"{md.get('namespace', 'default')}/{md['name']}"
        self.refusals.append(Refusal(key, "PreStartContainer", message))
        status = {
            "name": container,
            "ready": False,
            "restartCount": 0,
            "image": "",
            "imageID": "",
            "state": {"waiting": {"reason": "CreateContainerError", "message": message}},
        }
        init = any(c.get("name") == container for c in pod["spec"].get("initContainers") or [])
        self._publish(md, {"initContainerStatuses" if init else "containerStatuses": [status]})


class MultiNodeCluster:
    """N simulated nodes, one API server, the scheduler stand-in, and (optionally) the extender."""

    def __init__(
        self,
        workdir: Path,
        nodes: Sequence[tuple[str, str | Path]],
        *,
        extender: bool = True,
        extender_flags: Sequence[str] = (),
        agent_flags: Sequence[str] = (),
        scheduler_config: Path = DEFAULT_SCHEDULER_CONFIG,
        node_status_period: float = 0.5,
        scheduler_backoff: tuple[float, float] = (1.0, 10.0),
        unschedulable_timeout: float = 300.0,
        seed: int | None = None,
        bookmark_interval: float = 60.0,
        status_lag: float = STATUS_LAG_SECONDS,
        agent_rules: Sequence[Mapping[str, Any]] | str | None = SHIPPED,
        extender_rules: Sequence[Mapping[str, Any]] | str | None = SHIPPED,
    ) -> None:
        self.workdir = workdir
        self.api = ApiServerSimulator(bookmark_interval=bookmark_interval)
        self.kubeconfig = workdir / "kubeconfig"
        # The agents and the extender talk to the API server as the service accounts their shipped
        # manifests bind (deploy/daemonset.yaml, deploy/extender.yaml), refused (403) what those rules
        # do not grant, as on a real cluster; None (explicit): unrestricted. The node loops and the
        # scheduler stand-in (kubelet and scheduler) are not restricted.
        self.agent_rules = resolve_rules(agent_rules, "device-plugin")
        self.extender_rules = resolve_rules(extender_rules, "extender")
        self.agent_kubeconfig = self.kubeconfig
        self.extender_kubeconfig = self.kubeconfig
        self._node_specs = [(n, Path(s) if "/" in str(s) else SPEC_DIR / f"{s}.json") for n, s in nodes]
        self._agent_flags = list(agent_flags)
        self._status_period = node_status_period
        self._status_lag = status_lag
        self.with_extender = extender
        self.extender: ExtenderProcess | None = None
        self._extender_flags = list(extender_flags)
        self._scheduler_config = scheduler_config
        self._backoff = scheduler_backoff
        self._unschedulable_timeout = unschedulable_timeout
        self._seed = seed
        self.nodes: dict[str, SimNode] = {}
        self.scheduler: SchedulerStandIn | None = None
        self._core_api: client.CoreV1Api | None = None

    def start(self) -> MultiNodeCluster:
        """Start everything; returns when every node is registered and the scheduler runs."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.api.start()
        self.api.write_kubeconfig(self.kubeconfig)
        if self.agent_rules is not None:
            token = self.api.add_service_account("kube-system", shipped_account("device-plugin"), self.agent_rules)
            self.agent_kubeconfig = self.api.write_kubeconfig(self.workdir / "agent.kubeconfig", token=token)
        if self.extender_rules is not None:
            token = self.api.add_service_account("kube-system", shipped_account("extender"), self.extender_rules)
            self.extender_kubeconfig = self.api.write_kubeconfig(self.workdir / "extender.kubeconfig", token=token)
        api = self.api.client()
        for name, spec in self._node_specs:
            self.api.add_node(name, labels={"nvidia-device-enable": "enable"})
            self.nodes[name] = SimNode(
                name,
                spec,
                self.workdir / name,
                self.agent_kubeconfig,
                api,
                agent_flags=self._agent_flags,
                node_status_period=self._status_period,
                status_lag=self._status_lag,
            )
        with ThreadPoolExecutor(max_workers=len(self.nodes) or 1) as pool:
            for started in [pool.submit(node.start) for node in self.nodes.values()]:
                started.result()
        if self.with_extender:
            self.start_extender()
        self.start_scheduler()
        return self

    def start_extender(self) -> ExtenderProcess:
        """Start (or start again) the extender process on the same port."""
        port = self.extender.port if self.extender is not None else None
        self.extender = ExtenderProcess(
            self.workdir, self.extender_kubeconfig, extra_args=self._extender_flags, port=port
        )
        return self.extender.start()

    def start_scheduler(self) -> SchedulerStandIn:
        """Start the scheduler stand-in with the configuration (pointed at our extender, if any)."""
        _, extenders = load_configuration(
            self._scheduler_config, url_prefix=self.extender.url_prefix if self.extender is not None else None
        )
        self.scheduler = SchedulerStandIn(
            self.api.client(),
            extenders if self.with_extender else (),
            scheduler_name=profile_names(self._scheduler_config),
            initial_backoff=self._backoff[0],
            max_backoff=self._backoff[1],
            unschedulable_timeout=self._unschedulable_timeout,
            seed=self._seed,
        )
        return self.scheduler.start()

    def stop(self) -> None:
        """Stop everything."""
        if self.scheduler is not None:
            self.scheduler.stop()
        if self.extender is not None:
            self.extender.stop()
        for node in self.nodes.values():
            node.stop()
        self.api.stop()

    def __enter__(self) -> MultiNodeCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- pods -------------------------------------------------------------------------------------

    def create(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        """Create a pod (as a user or controller would)."""
        return self.api.create_pod(manifest)

    def delete(self, name: str, namespace: str = "default") -> None:
        """DELETE the pod through the API: a running pod is deleted gracefully (its node finishes it)."""
        try:
            self._core().delete_namespaced_pod(name, namespace, _preload_content=False)
        except client.exceptions.ApiException as exc:
            if exc.status != 404:
                raise

    def _core(self) -> client.CoreV1Api:
        if self._core_api is None:
            self._core_api = client.CoreV1Api(self.api.client())
        return self._core_api

    def pod(self, name: str, namespace: str = "default") -> dict[str, Any]:
        """The pod as stored now (KeyError when gone)."""
        found = self.api.get_pod(namespace, name)
        if found is None:
            raise KeyError(f"pod {namespace}/{name} is gone")
        return found

    def wait_phase(self, name: str, phases: Sequence[str] = ("Running",), timeout: float = 60.0) -> dict[str, Any]:
        """Wait until the pod is in one of ``phases``; returns it."""
        deadline = time.monotonic() + timeout
        while True:
            pod = self.pod(name)
            if (pod.get("status") or {}).get("phase") in phases:
                return pod
            if time.monotonic() > deadline:
                why = self.scheduler.stats.messages.get(f"default/{name}", "") if self.scheduler else ""
                raise TimeoutError(f"pod {name} is {pod.get('status', {}).get('phase')} after {timeout:g} s; {why}")
            time.sleep(0.05)

    def wait_unschedulable(self, name: str, timeout: float = 30.0) -> str:
        """Wait until the scheduler has recorded the pod as unschedulable; returns the message."""
        deadline = time.monotonic() + timeout
        while True:
            for cond in (self.pod(name).get("status") or {}).get("conditions") or []:
                if cond.get("type") == "PodScheduled" and cond.get("reason") == "Unschedulable":
                    return str(cond.get("message", ""))
            if time.monotonic() > deadline:
                raise TimeoutError(f"pod {name} was not found unschedulable within {timeout:g} s")
            time.sleep(0.05)

    def refusals(self) -> list[Refusal]:
        """Every admission refusal on every node."""
        return [r for node in self.nodes.values() for r in node.refusals]

    def over_committed(self) -> dict[str, list[int]]:
        """Node -> minors of GPUs whose live pods' annotations ask more than the GPU has."""
        capacity: dict[str, dict[int, int]] = {}
        for node_obj in self.api.nodes():
            text = (node_obj["metadata"].get("annotations") or {}).get(ANNOTATION)
            if text:
                capacity[node_obj["metadata"]["name"]] = {g.minor: g.memory for g in decode(text).gpus}
        cores: dict[tuple[str, int], int] = {}
        memory: dict[tuple[str, int], int] = {}
        for pod in self.api.pods():
            node = str((pod.get("spec") or {}).get("nodeName") or "")
            if not node or (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                continue
            ann = pod["metadata"].get("annotations") or {}
            for i, c in enumerate(pod["spec"].get("containers") or []):
                raw = ann.get(f"{names.PREDICATE_GPU_IDX_PREFIX}{i}")
                if not raw:
                    continue
                limits = (c.get("resources") or {}).get("limits") or {}
                c_cores = int(parse_quantity(limits.get(names.VCORE_RESOURCE, 0)))
                c_mem = int(parse_quantity(limits.get(names.VMEMORY_RESOURCE, 0))) * names.MEMORY_BLOCK_BYTES
                for minor in (int(m) for m in raw.split(",")):
                    key = (node, minor)
                    cores[key] = cores.get(key, 0) + min(c_cores, 100)
                    whole = c_cores >= 100
                    memory[key] = memory.get(key, 0) + (capacity.get(node, {}).get(minor, 0) if whole else c_mem)
        found: dict[str, list[int]] = {}
        for (node, minor), used in sorted(cores.items()):
            total = capacity.get(node, {}).get(minor)
            if used > 100 or (total is not None and memory[(node, minor)] > total):
                found.setdefault(node, []).append(minor)
        return found
