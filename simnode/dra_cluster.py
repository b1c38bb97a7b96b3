"""A simulated DRA node: API server, the agent in ``--mode=dra``, the kubelet DRA stand-in, the claim
controller and the scheduler stand-in, driven one reconcile pass at a time.

``settle()`` runs passes (controller, scheduler, kubelet) until nothing changes: claims are
created from templates, allocated and written back, pods bound, claims prepared through the
agent's ``dra.sock``, containers started from the CDI edits; pods that ended are stopped and
their claims unprepared and released. As on a real node, a started pod's status update
(``Running`` with the container IDs) reaches the API server ``status_lag`` seconds after its
containers started (:data:`~simnode.cluster.STATUS_LAG_SECONDS` by default; 0 writes it at once),
and a pod being deleted has its containers stopped and its claims unprepared at once, its last
status and the DELETE with grace 0 following ``status_lag`` later (:mod:`simnode.kubelet_deletion`);
``settle()`` waits for those writes.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kubernetes import client as k8s
from kubernetes import config as k8s_config

from simnode.agent_process import SPEC_DIR, AgentProcess
from simnode.apiserver import ApiServerSimulator
from simnode.apiserver_rbac import SHIPPED, resolve_rules, shipped_account
from simnode.cluster import STATUS_LAG_SECONDS, RemoteApiServer
from simnode.dra_controller import ClaimController
from simnode.dra_kubelet import DRAKubeletSimulator, PrepareFailed
from simnode.dra_scheduler import DRAScheduler
from simnode.gpusim_state import sim_env
from simnode.kubelet_deletion import PodTerminator

log = logging.getLogger(__name__)

JSON = dict[str, Any]
NODE = "sim-node"
DRIVER = "vcuda.tencent.com"


def device_class(driver: str = DRIVER) -> JSON:
    """The DeviceClass that selects the driver's devices (named after the driver)."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": driver},
        "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{driver}"'}}]},
    }


def claim_template(
    name: str,
    *,
    namespace: str = "default",
    count: int = 1,
    cores: int | None = None,
    memory: str | None = None,
    match_attribute: str | None = None,
    tolerations: Sequence[JSON] = (),
    driver: str = DRIVER,
) -> JSON:
    """A ResourceClaimTemplate with one request ``gpu``: ``count`` devices, each ``cores``/``memory``."""
    exactly: JSON = {"deviceClassName": driver, "count": count}
    requests: JSON = {}
    if cores is not None:
        requests["cores"] = str(cores)
    if memory is not None:
        requests["memory"] = memory
    if requests:
        exactly["capacity"] = {"requests": requests}
    if tolerations:
        exactly["tolerations"] = list(tolerations)
    spec: JSON = {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}
    if match_attribute:
        spec["devices"]["constraints"] = [{"requests": ["gpu"], "matchAttribute": match_attribute}]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"spec": spec},
    }


def claim_pod(name: str, template: str, *, namespace: str = "default", containers: Sequence[str] = ("main",)) -> JSON:
    """An unscheduled pod whose containers use one claim made from ``template``."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": template}],
            "containers": [
                {"name": c, "image": "cuda:12", "resources": {"claims": [{"name": "gpu"}]}} for c in containers
            ],
        },
    }


class DRACluster:
    """Everything around one agent in DRA mode, under ``workdir``."""

    def __init__(
        self,
        workdir: Path,
        spec: str | Path = "t4-x1",
        *,
        agent_flags: Sequence[str] = (),
        health_quiet_period: str = "5m",
        api_process: bool = False,
        status_lag: float = STATUS_LAG_SECONDS,
        agent_rules: Sequence[Mapping[str, Any]] | str | None = SHIPPED,
        features_off: Sequence[str] = (),
        scheduler_features_off: Sequence[str] = (),
    ) -> None:
        self.workdir = workdir
        # agent_rules: the agent talks to the API server as the service account kube-system/gpu-manager-dra
        # that these rules bind (by default what deploy/dra/daemonset.yaml grants it, as on a real
        # cluster) and is refused (403) what they do not grant; None (explicit): it may do anything.
        # The stand-ins' own calls (kubelet, scheduler, claim controller) are not restricted.
        self.agent_rules = resolve_rules(agent_rules, "dra")
        self.spec = Path(spec) if isinstance(spec, Path) or "/" in str(spec) else SPEC_DIR / f"{spec}.json"
        # api_process: the API server in its own process (benchmarks: a real one is another machine,
        # its work must not compete with the stand-ins for this interpreter).
        # features_off: feature gates off on the API server (DRAConsumableCapacity on Kubernetes 1.34, or
        # 1.35 without it): it drops the fields they guard from what is written.
        if api_process and features_off:
            raise ValueError(f"features_off {list(features_off)!r} needs the API server in this process")
        self.api: Any = RemoteApiServer(workdir) if api_process else ApiServerSimulator(disabled_features=features_off)
        # scheduler_features_off: gates off in the scheduler only (DRAConsumableCapacity: it ignores
        # allowMultipleAllocations and capacity requests, though the API server keeps them).
        self._scheduler_consumable = "DRAConsumableCapacity" not in scheduler_features_off
        self.kubeconfig = workdir / "kubeconfig"
        self.agent_kubeconfig = self.kubeconfig
        # Unix socket paths are limited to 107 bytes: keep the kubelet's directories short.
        self.sockets_dir = Path(tempfile.mkdtemp(prefix="gm-dra-"))
        self.registry_dir = self.sockets_dir / "plugins_registry"
        self.plugin_dir = self.sockets_dir / "plugins" / DRIVER
        self.cdi_root = workdir / "cdi"
        self.vm_path = Path(tempfile.mkdtemp(prefix="gm-vm-"))
        self.checkpoint_dir = workdir / "checkpoint"
        self.cgroup_root = workdir / "cgroup"
        self._agent_flags = [f"--health-quiet-period={health_quiet_period}", *agent_flags]
        self.agent: AgentProcess | None = None
        self.kubelet: DRAKubeletSimulator | None = None
        self.controller: ClaimController | None = None
        self.scheduler: DRAScheduler | None = None
        self.client: Any = None
        self.prepare_errors: dict[str, dict[str, str]] = {}
        self.commands: dict[str, dict[str, Sequence[str]]] = {}
        self.base_env: dict[str, str] = {}
        self.status_lag = status_lag
        self._statuses: dict[str, list[JSON]] = {}  # pod UID -> container statuses once started
        self._status_timers: dict[str, threading.Timer] = {}  # pod UID -> its Running status on its way
        self.terminator = PodTerminator(
            self.api, NODE, stop_pod=self._stop_pod, known_statuses=self._known_statuses, lag=status_lag
        )

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> DRACluster:
        """API server with the DeviceClass, the kubelet stand-in, the agent; waits for registration and the slice."""
        self.start_api()
        self.kubelet = DRAKubeletSimulator(
            registry_dir=self.registry_dir, api_client=self.client, node=NODE, cdi_dirs=[self.cdi_root]
        )
        self.kubelet.start()
        self.controller = ClaimController(self.client, seed=1)
        self.scheduler = DRAScheduler(self.client, [NODE], consumable_capacity=self._scheduler_consumable)
        self.start_agent()
        return self

    def start_api(self) -> None:
        """The API server with the node and the DeviceClass, the harness's client and the agent's
        kubeconfig (its service account's, unless ``agent_rules`` is None)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        token = None
        if self.agent_rules is not None:
            token = self.api.add_service_account("kube-system", shipped_account("dra"), self.agent_rules)
        self.api.start()
        self.api.add_node(NODE)
        self.api.write_kubeconfig(self.kubeconfig)
        if token is not None:
            self.agent_kubeconfig = self.api.write_kubeconfig(self.workdir / "agent.kubeconfig", token=token)
        self.client = k8s_config.new_client_from_config(config_file=str(self.kubeconfig))  # type: ignore[no-untyped-call]
        self.resource.create_device_class(device_class())

    def agent_args(self) -> list[str]:
        """The agent's flags."""
        return [
            "--mode=dra",
            f"--kubeconfig={self.agent_kubeconfig}",
            f"--hostname-override={NODE}",
            f"--plugin-registry-path={self.registry_dir}",
            f"--dra-plugin-path={self.plugin_dir}",
            f"--cdi-root={self.cdi_root}",
            f"--virtual-manager-path={self.vm_path}",
            f"--checkpoint-path={self.checkpoint_dir}",
            f"--cgroup-root={self.cgroup_root}",
            *self._agent_flags,
        ]

    def start_agent(self, *, wait: bool = True, env: Mapping[str, str] | None = None) -> AgentProcess:
        """Start (or start again) the agent (``env``: more environment variables); wait for its
        registration and its ResourceSlice."""
        assert self.kubelet is not None
        before = self.kubelet.registrations(DRIVER)
        state = self.agent.state if self.agent is not None else None
        self.agent = AgentProcess(
            self.workdir, self.spec, state=state, extra_args=self.agent_args(), env=dict(env or {})
        )
        self.agent.start()
        if wait:
            self.kubelet.wait_registered(DRIVER, after=before, timeout=30)
            self.wait_slice(lambda s: s is not None)
        self.base_env = sim_env(self.spec, self.agent.state)
        return self.agent

    def stop(self) -> None:
        """Stop everything."""
        for timer in self._status_timers.values():
            timer.cancel()
        self.terminator.stop()
        if self.kubelet is not None:
            self.kubelet.kill_all()
            self.kubelet.stop()
        if self.agent is not None:
            self.agent.stop()
        self.api.stop()
        shutil.rmtree(self.vm_path, ignore_errors=True)
        shutil.rmtree(self.sockets_dir, ignore_errors=True)

    def __enter__(self) -> DRACluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- API helpers ----------------------------------------------------------------------------

    @property
    def resource(self) -> Any:
        """ResourceV1Api."""
        return k8s.ResourceV1Api(self.client)

    @property
    def core(self) -> Any:
        """CoreV1Api."""
        return k8s.CoreV1Api(self.client)

    def slice(self) -> JSON | None:
        """The node's ResourceSlice as JSON, or None."""
        items = json.loads(
            self.resource.list_resource_slice(field_selector=f"spec.nodeName={NODE}", _preload_content=False).data
        )["items"]
        return items[0] if items else None

    def wait_slice(self, predicate: Any, timeout: float = 20.0) -> JSON | None:
        """Wait until ``predicate(slice)`` holds; returns the slice."""
        deadline = time.monotonic() + timeout
        current = None
        while time.monotonic() < deadline:
            current = self.slice()
            if predicate(current):
                return current
            time.sleep(0.05)
        raise TimeoutError(f"ResourceSlice condition not met within {timeout:g} s; last: {json.dumps(current)[:2000]}")

    def add_template(self, template: JSON) -> None:
        """Create a ResourceClaimTemplate."""
        ns = template["metadata"].get("namespace", "default")
        self.resource.create_namespaced_resource_claim_template(ns, template)

    def create_pod(self, manifest: JSON, commands: Mapping[str, Sequence[str]] | None = None) -> JSON:
        """Create a pod; ``commands`` are the processes its containers run once started."""
        ns = manifest["metadata"].get("namespace", "default")
        created: JSON = json.loads(self.core.create_namespaced_pod(ns, manifest, _preload_content=False).data)
        if commands:
            self.commands[created["metadata"]["uid"]] = dict(commands)
        return created

    def pod(self, name: str, namespace: str = "default") -> JSON:
        """The pod as stored."""
        out: JSON = json.loads(self.core.read_namespaced_pod(name, namespace, _preload_content=False).data)
        return out

    def claim_of(self, pod_name: str, namespace: str = "default") -> JSON:
        """The ResourceClaim made for a pod's claim ``gpu``."""
        pod = self.pod(pod_name, namespace)
        name = next(s["resourceClaimName"] for s in pod["status"]["resourceClaimStatuses"] if s["name"] == "gpu")
        out: JSON = json.loads(
            self.resource.read_namespaced_resource_claim(name, namespace, _preload_content=False).data
        )
        return out

    def end_pod(self, name: str, namespace: str = "default") -> None:
        """The pod's containers finish (phase Succeeded)."""
        self.core.patch_namespaced_pod_status(
            name, namespace, {"status": {"phase": "Succeeded"}}, _content_type="application/merge-patch+json"
        )

    # -- reconcile ------------------------------------------------------------------------------

    def settle(self, passes: int = 10, *, wait_writes: bool = True) -> None:
        """Run controller, scheduler and kubelet passes until nothing changes, waiting for the kubelet's
        lagging status writes (``wait_writes=False``: return while they are still on their way)."""
        assert self.controller is not None and self.scheduler is not None
        for _ in range(passes):
            changed = self.controller.sync()
            changed += len(self.scheduler.schedule_once())
            changed += self._kubelet_pass()
            if not changed and wait_writes:
                changed = self._wait_status_writes()
            if not changed:
                return

    def _wait_status_writes(self) -> int:
        """Wait for the kubelet's lagging status writes and final DELETEs; how many there were."""
        timers = [t for t in self._status_timers.values() if t.is_alive()]
        for timer in timers:
            timer.join(self.status_lag + 10)
        pending = self.terminator.pending()
        self.terminator.wait_idle(self.status_lag + 10)
        return len(timers) + pending

    def _stop_pod(self, uid: str) -> None:
        """Stop the containers and unprepare the claims; a Running status not written yet never will be."""
        assert self.kubelet is not None
        timer = self._status_timers.pop(uid, None)
        if timer is not None:
            timer.cancel()
        self.kubelet.stop_pod(uid)

    def _known_statuses(self, uid: str) -> list[JSON]:
        return self._statuses.get(uid, [])

    def _publish_running(self, pod: JSON, statuses: list[JSON]) -> None:
        """The status update naming the started containers, ``status_lag`` from now, unless they were
        stopped meanwhile."""
        md = pod["metadata"]
        status = {"phase": "Running", "containerStatuses": statuses, "qosClass": "BestEffort"}

        def write() -> None:
            if self.terminator.stopped(md["uid"]):
                return
            try:
                self.core.patch_namespaced_pod_status(
                    md["name"],
                    md.get("namespace", "default"),
                    {"metadata": {"uid": md["uid"]}, "status": status},
                    _content_type="application/merge-patch+json",
                )
            except k8s.exceptions.ApiException as exc:
                if exc.status not in (404, 409, 422):  # gone, or another pod of that name
                    raise

        if self.status_lag <= 0:
            write()
            return
        timer = threading.Timer(self.status_lag, write)
        timer.daemon = True
        self._status_timers = {u: t for u, t in self._status_timers.items() if t.is_alive()}
        self._status_timers[md["uid"]] = timer
        timer.start()

    def _kubelet_pass(self) -> int:
        assert self.kubelet is not None
        changed = 0
        pods = json.loads(
            self.core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={NODE}", _preload_content=False).data
        )["items"]
        # Finished pods first: their claims are unprepared before new ones are prepared.
        for pod in pods:
            uid = pod["metadata"]["uid"]
            if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                running = any(k[0] == uid for k in self.kubelet.containers)
                # An Unprepare that failed is tried again the next pass.
                if (running or uid in self.kubelet.pods_to_unprepare()) and not self.kubelet.stop_pod(uid):
                    changed += 1
        for pod in pods:
            uid = pod["metadata"]["uid"]
            if pod["metadata"].get("deletionTimestamp"):  # stopped now, finished status_lag later
                if not self.terminator.stopped(uid):
                    self.terminator.handle("MODIFIED", pod)
                    changed += 1
                continue
            if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                continue
            if any(k[0] == uid for k in self.kubelet.containers):
                continue
            try:
                started = self.kubelet.start_pod(
                    pod, self.commands.get(uid), base_env=self.base_env, cgroup_root=self.cgroup_root
                )
            except PrepareFailed as exc:
                # The kubelet retries a failed Prepare; the errors stay visible until one succeeds.
                self.prepare_errors[uid] = exc.errors
                continue
            self.prepare_errors.pop(uid, None)
            statuses = []
            for c in pod["spec"]["containers"]:
                cid = f"{uid[:8]}{c['name']}".replace("-", "")
                run = started.get(c["name"])
                if run is not None and run.proc is None:
                    d = self.cgroup_root / "kubepods" / f"pod{uid}" / cid
                    d.mkdir(parents=True, exist_ok=True)
                statuses.append(
                    {
                        "name": c["name"],
                        "containerID": f"containerd://{cid}",
                        "ready": True,
                        "restartCount": 0,
                        "image": c.get("image", ""),
                        "imageID": "",
                        "state": {"running": {"startedAt": "2026-11-21T10:00:00Z"}},
                    }
                )
            self._statuses[uid] = statuses
            self._publish_running(pod, statuses)
            changed += 1
        # Pods deleted from the API server: stop what is left of them.
        known = {p["metadata"]["uid"] for p in pods}
        # As the kubelet's reconcile loop: claims still referenced by a pod that is gone (one whose
        # Prepare failed, or whose Unprepare did) are unprepared.
        for uid in ({k[0] for k in self.kubelet.containers} | self.kubelet.pods_to_unprepare()) - known:
            if not self.kubelet.stop_pod(uid):
                changed += 1
        return changed
