"""A whole simulated GPU node: API server, kubelet (with PodResources), the agent process, cgroups.

``SimCluster`` plays what a cluster does around the agent: it creates pods as
gpu-admission would have annotated them (or not), admits them through the
kubelet simulator (GetPreferredAllocation, Allocate, PreStartContainer for both
resources), then gives each container a cgroup with a PID, so the agent finds
its processes, and marks the pod Running with the container IDs. As on a real
node, that status update reaches the API server a while after the containers
started (``status_lag``, :data:`STATUS_LAG_SECONDS` by default; 0 publishes it
at once). A pod being deleted is finished as the kubelet does
(:mod:`simnode.kubelet_deletion`): its containers stop at once, its device IDs are
free, and its last status and the DELETE with grace 0 follow ``status_lag`` later.
"""

from __future__ import annotations

import itertools
import json
import logging
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client as k8s_client
from kubernetes import config as k8s_config

from gpumanager import names
from simnode.agent_process import SPEC_DIR, AgentProcess
from simnode.apiserver import ApiServerSimulator
from simnode.apiserver_client import HttpPodApi
from simnode.apiserver_objects import pod_manifest
from simnode.apiserver_rbac import SHIPPED, resolve_rules, shipped_account
from simnode.cgroup_files import make_cgroup
from simnode.gpusim_state import repo_root
from simnode.kubelet import AllocationError, AllocationRecord, KubeletSimError, KubeletSimulator, PluginRPCError
from simnode.kubelet_deletion import PodTerminator
from simnode.simhost import install_sim_driver, volume_conf

log = logging.getLogger(__name__)

NODE = "sim-node"
#: How long after its containers start the kubelet's status update naming their IDs reaches the API
#: server: the kubelet notices a started container at its next PLEG relist (every second) and its
#: status manager writes the pod after that, later still on a busy node.
STATUS_LAG_SECONDS = 2.0
#: What the agent logs once its background start (API server, driver mirror) is done.
STARTED_MARK = "devices in "
_pid_counter = itertools.count(40000)


@dataclass
class PodRun:
    """A pod the cluster admitted: its manifest and what the kubelet recorded per container."""

    manifest: dict[str, Any]
    core: dict[str, AllocationRecord] = field(default_factory=dict)
    memory: dict[str, AllocationRecord] = field(default_factory=dict)
    pids: dict[str, int] = field(default_factory=dict)
    statuses: list[dict[str, Any]] = field(default_factory=list)  # containerStatuses, once started
    init_statuses: list[dict[str, Any]] = field(default_factory=list)  # initContainerStatuses, once started
    sandbox: str = ""  # the ID of its sandbox (the pause container), whose cgroup is beside its containers'

    @property
    def uid(self) -> str:
        """The pod UID."""
        return str(self.manifest["metadata"]["uid"])

    @property
    def name(self) -> str:
        """The pod name."""
        return str(self.manifest["metadata"]["name"])

    @property
    def namespace(self) -> str:
        """The pod namespace."""
        return str(self.manifest["metadata"].get("namespace", "default"))


def gpu_pod(
    name: str,
    containers: Sequence[tuple[str, int, int]],
    *,
    namespace: str = "default",
    annotations: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """A pod manifest on the simulated node with (name, vcuda-core, vcuda-memory blocks) containers."""
    specs = []
    for cname, cores, blocks in containers:
        limits: dict[str, str] = {}
        if cores:
            limits[names.VCORE_RESOURCE] = str(cores)
        if blocks:
            limits[names.VMEMORY_RESOURCE] = str(blocks)
        specs.append({"name": cname, "limits": limits, "requests": limits})
    return pod_manifest(name, namespace=namespace, node=NODE, containers=specs, annotations=dict(annotations or {}))


def admission_annotations(gpus: Sequence[Sequence[int]], predicate_time: int) -> dict[str, str]:
    """What gpu-admission writes: one ``predicate-gpu-idx-<i>`` per container, time, node, assigned=false."""
    out = {f"{names.PREDICATE_GPU_IDX_PREFIX}{i}": ",".join(map(str, g)) for i, g in enumerate(gpus) if g}
    out[names.PREDICATE_TIME] = str(predicate_time)
    out[names.PREDICATE_NODE] = NODE
    out[names.GPU_ASSIGNED] = "false"
    return out


def _start_error(exc: KubeletSimError) -> str:
    """The message of a container whose start failed in GetDeviceRunContainerOptions, as its status shows it."""
    if isinstance(exc, PluginRPCError):
        desc = exc.details
        if exc.code is not None:
            code = "".join(part.capitalize() for part in exc.code.name.split("_"))
            desc = f"rpc error: code = {code} desc = {exc.details}"
        return f"device plugin PreStartContainer rpc failed with err: {desc}"
    return str(exc)


class RemoteApiServer(HttpPodApi):
    """The API-server simulator in its own process, driven over HTTP with the real client.

    For benchmarks: a real API server is another machine, so its work must not compete
    with the kubelet simulator for this process's interpreter.
    """

    def __init__(self, workdir: Path) -> None:
        self._workdir = workdir
        self._kubeconfig = workdir / "apiserver.kubeconfig"
        self._proc: subprocess.Popen[bytes] | None = None
        self._accounts: list[dict[str, Any]] = []
        super().__init__(None)

    def add_service_account(
        self, namespace: str, name: str, rules: Sequence[Mapping[str, Any]], *, token: str | None = None
    ) -> str:
        """As :meth:`simnode.apiserver.ApiServerSimulator.add_service_account`, before :meth:`start`."""
        if self._proc is not None:
            raise RuntimeError("service accounts are added to the API-server process before it starts")
        token = token or f"sa-{namespace}-{name}-{uuid.uuid4().hex}"
        self._accounts.append({"namespace": namespace, "name": name, "token": token, "rules": list(rules)})
        return token

    def start(self) -> None:
        """Start the process and wait for its kubeconfig."""
        accounts = self._workdir / "apiserver.accounts.json"
        accounts.write_text(json.dumps(self._accounts))
        self._proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "simnode.apiserver",
                f"--kubeconfig={self._kubeconfig}",
                f"--node={NODE}",
                f"--service-accounts={accounts}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while not self._kubeconfig.exists():
            if time.monotonic() > deadline or self._proc.poll() is not None:
                raise RuntimeError("the API-server simulator process did not start")
            time.sleep(0.05)
        time.sleep(0.1)
        api = k8s_config.new_client_from_config(config_file=str(self._kubeconfig))  # type: ignore[no-untyped-call]
        self.core = k8s_client.CoreV1Api(api)

    def stop(self) -> None:
        """Stop the process."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            self._proc.wait(10)

    def add_node(self, name: str, labels: Mapping[str, str] | None = None) -> None:
        """The node is registered when the process starts."""

    def write_kubeconfig(self, path: Path, *, token: str | None = None) -> Path:
        """Copy the kubeconfig to ``path`` (with ``token``, a service account's, as its user)."""
        if token is None:
            shutil.copyfile(self._kubeconfig, path)
            return path
        config = json.loads(self._kubeconfig.read_text())
        for user in config["users"]:
            user["user"] = {"token": token}
        path.write_text(json.dumps(config, indent=2) + "\n")
        return path


class SimCluster:
    """Everything around one agent, under ``workdir``."""

    def __init__(
        self,
        workdir: Path,
        spec: str | Path = "h100-nvlink-x8",
        *,
        agent_flags: Sequence[str] = (),
        agent_env: Mapping[str, str] | None = None,
        agent_python: str | None = None,
        pod_resources: bool = True,
        fill: str = "random",
        seed: int | None = None,
        api_process: bool = False,
        kubelet_checkpoint: bool = True,
        driver_mirror: bool = True,
        status_lag: float = STATUS_LAG_SECONDS,
        agent_rules: Sequence[Mapping[str, Any]] | str | None = SHIPPED,
    ) -> None:
        self.workdir = workdir
        # agent_rules: the agent talks to the API server as the service account kube-system/gpu-manager
        # that these rules bind (by default what deploy/daemonset.yaml grants it, as on a real cluster)
        # and is refused (403) what they do not grant; None (explicit): it may do anything. The
        # harness's own calls (admin, kubelet, scheduler) are not restricted.
        self.agent_rules = resolve_rules(agent_rules, "device-plugin")
        self.status_lag = status_lag
        self._status_timers: list[threading.Timer] = []
        # The kubelet's sync loop handles pod additions one at a time (HandlePodAdditions), the device
        # manager's Allocate calls inside each admission: admissions of this node never overlap.
        self._admission = threading.Lock()
        self.spec = Path(spec) if isinstance(spec, Path) or "/" in str(spec) else SPEC_DIR / f"{spec}.json"
        self.api: Any = RemoteApiServer(workdir) if api_process else ApiServerSimulator()
        self.kubeconfig = workdir / "kubeconfig"
        self.agent_kubeconfig = self.kubeconfig
        # Unix socket paths are limited to 107 bytes: keep <vm>/<pod uid>/vcuda.sock short.
        self.vm_path = Path(tempfile.mkdtemp(prefix="gm-vm-"))
        self.checkpoint_dir = workdir / "checkpoint"
        self.cgroup_root = workdir / "cgroup"
        self.pod_resources_socket = workdir / "pod-resources" / "kubelet.sock"
        self.kubelet = KubeletSimulator(
            workdir / "device-plugins",
            pod_resources_socket=self.pod_resources_socket if pod_resources else None,
            fill=fill,  # type: ignore[arg-type]
            seed=seed,
            write_checkpoint=kubelet_checkpoint,
        )
        self._agent_flags = list(agent_flags)
        self._agent_env = dict(agent_env or {})
        self._agent_python = agent_python  # the interpreter that runs the agent (None: this one)
        # As on a real node: the share-mode answer mounts a driver mirror holding the interceptor.
        self._mirror = driver_mirror
        self.agent: AgentProcess | None = None
        self.runs: dict[str, PodRun] = {}
        self._slow: set[str] = set()  # pods whose containers are slow to stop (slow_stop)
        self._stalled: set[str] = set()  # of those, the ones the kubelet is stopping
        self.terminator = PodTerminator(
            self.api, NODE, stop_pod=self._stop_pod, known_statuses=self._known_statuses, lag=status_lag
        )

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self, *, wait: bool = True, agent: bool = True) -> SimCluster:
        """Start the API server, the kubelet and (unless ``agent=False``) the agent; wait for registration."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        token = None
        if self.agent_rules is not None:
            token = self.api.add_service_account("kube-system", shipped_account("device-plugin"), self.agent_rules)
        self.api.start()
        self.api.add_node(NODE, labels={"nvidia-device-enable": "enable"})
        self.api.write_kubeconfig(self.kubeconfig)
        if token is not None:
            self.agent_kubeconfig = self.api.write_kubeconfig(self.workdir / "agent.kubeconfig", token=token)
        self.terminator.start()
        if self._mirror:
            install_sim_driver(self.workdir / "host")
            volume_conf(self.workdir / "vdriver", self.workdir / "volume.conf")
        self.kubelet.start()
        if agent:
            self.start_agent(wait=wait)
        return self

    def agent_args(self) -> list[str]:
        """The agent's flags (after the harness's own)."""
        return [
            f"--kubeconfig={self.agent_kubeconfig}",
            f"--hostname-override={NODE}",
            "--share-mode=true",
            f"--virtual-manager-path={self.vm_path}",
            f"--checkpoint-path={self.checkpoint_dir}",
            f"--pod-resources-socket={self.pod_resources_socket}",
            f"--cgroup-root={self.cgroup_root}",
            *self._mirror_flags(),
            *self._agent_flags,
        ]

    def _mirror_flags(self) -> list[str]:
        if not self._mirror:
            return []
        return [
            f"--volume-config={self.workdir / 'volume.conf'}",
            f"--driver-root={self.workdir / 'host'}",
            f"--vcuda-library={repo_root() / 'vcuda' / 'build' / 'libcuda-control.so'}",
        ]

    def start_agent(self, *, wait: bool = True, env: Mapping[str, str] | None = None) -> AgentProcess:
        """Start (or start again) the agent process."""
        merged = {**self._agent_env, **(env or {})}
        state = self.agent.state if self.agent is not None else None
        # The log file is shared by every agent started here: count what earlier ones wrote.
        started = self.agent.log_text().count(STARTED_MARK) if self.agent is not None else 0
        agent = self.agent = AgentProcess(
            self.workdir, self.spec, state=state, extra_args=self.agent_args(), env=merged, python=self._agent_python
        )
        launched = time.monotonic()
        agent.start()
        if wait:
            for resource in (names.VCORE_RESOURCE, names.VMEMORY_RESOURCE):
                self.kubelet.wait_for_registration(resource, since=launched, timeout=30, with_devices=True)
            # The agent registers first and connects to the API server in the background: wait for that.
            deadline = time.monotonic() + 60
            while agent.log_text().count(STARTED_MARK) <= started:
                if time.monotonic() > deadline or (agent.proc is not None and agent.proc.poll() is not None):
                    raise TimeoutError(f"the agent did not finish starting:\n{agent.log_text()[-3000:]}")
                time.sleep(0.05)
        return agent

    def stop(self) -> None:
        """Stop everything."""
        for timer in self._status_timers:
            timer.cancel()
        if self.agent is not None:
            self.agent.stop()
        self.terminator.stop()
        self.kubelet.stop()
        self.api.stop()
        shutil.rmtree(self.vm_path, ignore_errors=True)

    def __enter__(self) -> SimCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- pods -------------------------------------------------------------------------------------

    def create(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        """Create a pod in the API server (it is Pending, bound to this node)."""
        created: dict[str, Any] = self.api.create_pod(manifest)
        self.runs[str(created["metadata"]["uid"])] = PodRun(created)
        return created

    def admit(self, manifest: Mapping[str, Any], *, create: bool = True) -> PodRun:
        """Admission as the kubelet does it: Allocate for each GPU container, in order, init containers first
        (whose devices later containers of the pod may reuse), each container's resources in the order the
        kubelet ranges over its limits (a Go map: random, unless the kubelet's fill is "sorted").

        A refused allocation or a failed Allocate fails the admission as in the kubelet: the pod turns
        Failed (``UnexpectedAdmissionError``; the status reaches the API server ``status_lag`` later) and is
        never admitted again, the devices its earlier containers got are free for the next admission, and
        the :class:`KubeletSimError` is raised.

        Admissions are serialised, as the kubelet's sync loop admits one pod at a time: a call made while
        another admission runs (another thread) waits for it, however long its Allocate takes."""
        pod = self.create(manifest) if create else dict(manifest)
        with self._admission:
            return self._admit(pod)

    def _admit(self, pod: Mapping[str, Any]) -> PodRun:
        run = self.runs[str(pod["metadata"]["uid"])]
        try:
            for record in self.kubelet.admit_pod(pod, (names.VCORE_RESOURCE, names.VMEMORY_RESOURCE)):
                held = run.core if record.resource == names.VCORE_RESOURCE else run.memory
                held[record.container_name] = record
        except KubeletSimError as exc:
            self._admission_failed(run, exc)
            raise
        return run

    def restart_kubelet(self) -> float:
        """The kubelet restarts (:meth:`KubeletSimulator.restart`) and admits every pod of the node again at
        once, before a device plugin can register again. A running container needs nothing (kubelet 1.27 on);
        a pod admitted whose containers had not started finds its resource without healthy devices and fails
        its admission (:meth:`admit`). A kubelet whose ``kubelet_internal_checkpoint`` was removed or damaged
        knows no devices of any container afterwards: a running container runs on (no Allocate), but its next
        start fails (:meth:`restart_container`). Returns the monotonic time ``kubelet.sock`` was re-created."""
        admitted = {run.uid for run in self.runs.values() if self.kubelet.allocations(run.uid)}
        created = self.kubelet.restart()
        for run in list(self.runs.values()):
            held = [*run.core.values(), *run.memory.values()]
            if run.statuses or not held or run.uid not in admitted:
                continue  # started, without devices, or already failed or gone
            resource = held[0].resource
            if resource in self.kubelet.resources():
                failed = AllocationError(f"no healthy devices present; cannot allocate unhealthy devices {resource}")
            else:
                failed = AllocationError(f"cannot allocate unregistered device {resource}")
            self._admission_failed(run, failed)
        return created

    def _admission_failed(self, run: PodRun, exc: KubeletSimError) -> None:
        """The kubelet rejects the pod: it is not active any more, so its devices are dropped before the next
        admission (UpdateAllocatedDevices), and its status says Failed a while later."""
        self.kubelet.remove_pod(run.uid)
        status = {
            "reason": "UnexpectedAdmissionError",
            "message": f"Allocate failed due to {exc}, which is unexpected",
        }
        log.info("pod %s/%s failed admission: %s", run.namespace, run.name, status["message"])
        self._phase_later(run, "Failed", status)

    def start_containers(self, run: PodRun, *, publish_status: bool = True) -> None:
        """PreStartContainer for each GPU container (init containers first; each container's resources in the
        kubelet's order), then cgroups with a PID; the pod's status (Running, with the container IDs) follows
        ``status_lag`` seconds later.

        A failing PreStartContainer raises :class:`KubeletSimError`: the kubelet fails that start only and
        tries it again later with a backoff (10 s, doubling up to 5 min), calling PreStartContainer again;
        call this again to play that. Meanwhile the container waits (``CreateContainerConfigError``, the
        error in its message), as the pod's status says ``status_lag`` later.

        ``publish_status=False``: the containers run (their cgroups exist) but the kubelet's status
        update, which names their IDs, has not reached the API server yet; see publish_status().
        """
        for name in dict.fromkeys([*run.core, *run.memory]):
            held = {names.VCORE_RESOURCE: run.core, names.VMEMORY_RESOURCE: run.memory}
            for res in self.kubelet.limits_order(r for r, by_name in held.items() if name in by_name):
                try:
                    self.kubelet.pre_start(res, pod_uid=run.uid, container_name=name)
                except KubeletSimError as exc:
                    self._start_failed(run, name, exc)
                    raise
        # Init containers ran to completion one after the other (their processes gone); sidecars run on
        # beside the app containers, as these do.
        init_statuses = []
        for c in run.manifest["spec"].get("initContainers") or []:
            cid = f"{run.uid[:8]}{c['name']}".replace("-", "")
            if c.get("restartPolicy") == "Always":
                init_statuses.append(self._running_status(run, c["name"], cid))
                continue
            finished = {"exitCode": 0, "reason": "Completed", "containerID": f"containerd://{cid}"}
            state = {
                "terminated": {**finished, "startedAt": "2026-11-21T09:59:58Z", "finishedAt": "2026-11-21T09:59:59Z"}
            }
            init_statuses.append(
                {
                    "name": c["name"],
                    "containerID": f"containerd://{cid}",
                    "ready": True,
                    "restartCount": 0,
                    "image": "cuda",
                    "imageID": "",
                    "state": state,
                }
            )
        statuses = []
        for c in run.manifest["spec"]["containers"]:
            cid = f"{run.uid[:8]}{c['name']}".replace("-", "")
            statuses.append(self._running_status(run, c["name"], cid))
        run.statuses = statuses
        run.init_statuses = init_statuses
        if not publish_status:
            return
        if self.status_lag <= 0:
            self.publish_status(run)
            return
        timer = threading.Timer(self.status_lag, self._publish_late, args=(run,))
        timer.daemon = True
        self._status_timers = [t for t in self._status_timers if t.is_alive()] + [timer]
        timer.start()

    def _running_status(self, run: PodRun, name: str, cid: str) -> dict[str, Any]:
        """A started container: its cgroup with a fresh PID, and its status."""
        self._sandbox(run)
        pid = next(_pid_counter)
        run.pids[name] = pid
        make_cgroup(self.cgroup_root / "kubepods" / f"pod{run.uid}" / cid, [pid])
        return {
            "name": name,
            "containerID": f"containerd://{cid}",
            "ready": True,
            "restartCount": 0,
            "image": "cuda",
            "imageID": "",
            "state": {"running": {"startedAt": "2026-11-21T10:00:00Z"}},
        }

    def _sandbox(self, run: PodRun) -> None:
        """The pod's sandbox, made before its first container as the runtime does: the pause container's
        cgroup beside the containers' (``kubepods/pod<uid>/<sandbox id>``), an ID no status names."""
        pod_dir = self.cgroup_root / "kubepods" / f"pod{run.uid}"
        if not pod_dir.is_dir():
            run.sandbox = uuid.uuid5(uuid.NAMESPACE_OID, run.uid).hex
            make_cgroup(pod_dir / run.sandbox, [next(_pid_counter)])

    def restart_container(self, run: PodRun, name: str, *, publish_status: bool = True) -> str:
        """The container ``name`` exits and the kubelet starts it again, as on a node: its cgroup goes with the
        old process, PreStartContainer is called for its resources again, and the new container has a new
        ID, a new cgroup with a fresh PID (``run.pids``). The pod's status naming the new ID (restartCount
        one more, the old one's end as ``lastState``) reaches the API server ``status_lag`` later; until then
        it names the old ID. ``publish_status=False``: not at all until :meth:`publish_status`. Returns the
        new container ID. A failing PreStartContainer (or the kubelet's own check before it) raises
        :class:`KubeletSimError`: the container is not made, and the status says it waits
        (``CreateContainerConfigError``, the error as its message) with the old one's end as ``lastState``."""
        statuses = run.statuses if any(s["name"] == name for s in run.statuses) else run.init_statuses
        index = next((i for i, s in enumerate(statuses) if s["name"] == name), None)
        if index is None:
            raise KeyError(f"pod {run.namespace}/{run.name} has no started container {name}")
        old = statuses[index]
        held = {names.VCORE_RESOURCE: run.core, names.VMEMORY_RESOURCE: run.memory}
        if old.get("containerID"):
            old_cid = str(old["containerID"]).split("://", 1)[-1]
            shutil.rmtree(self.cgroup_root / "kubepods" / f"pod{run.uid}" / old_cid, ignore_errors=True)
            ended = {
                "terminated": {
                    "exitCode": 1,
                    "reason": "Error",
                    "containerID": old["containerID"],
                    "startedAt": "2026-11-21T10:00:00Z",
                    "finishedAt": "2026-11-21T10:05:00Z",
                }
            }
        else:  # its last start failed: the kubelet tries again, the container that ran last still ended
            ended = dict(old.get("lastState") or {})
        try:
            for res in self.kubelet.limits_order(r for r, by_name in held.items() if name in by_name):
                self.kubelet.pre_start(res, pod_uid=run.uid, container_name=name)
        except KubeletSimError as exc:
            # The new container is never created: the status says it waits (CreateContainerConfigError, the
            # kubelet's error as its message), its old one's end as lastState; the pod stays Running.
            statuses[index] = {
                "name": name,
                "ready": False,
                "restartCount": int(old.get("restartCount", 0)),
                "image": "cuda",
                "imageID": "",
                "state": {"waiting": {"reason": "CreateContainerConfigError", "message": _start_error(exc)}},
                "lastState": ended,
            }
            if publish_status:
                self._later(lambda: self._publish_late(run))
            raise
        restarts = int(old.get("restartCount", 0)) + 1
        cid = f"{run.uid[:8]}{name}r{restarts}".replace("-", "")
        status = self._running_status(run, name, cid)
        status["restartCount"] = restarts
        status["lastState"] = ended
        statuses[index] = status
        if publish_status:
            self._later(lambda: self._publish_late(run))
        return cid

    def _start_failed(self, run: PodRun, container: str, exc: KubeletSimError) -> None:
        """The container's start failed in GetDeviceRunContainerOptions: it waits, with the error as its
        message, until the kubelet's next try."""
        message = _start_error(exc)
        waiting = {
            "name": container,
            "ready": False,
            "restartCount": 0,
            "image": "cuda",
            "imageID": "",
            "state": {"waiting": {"reason": "CreateContainerConfigError", "message": message}},
        }
        init = any(c.get("name") == container for c in run.manifest["spec"].get("initContainers") or [])
        status = {"initContainerStatuses" if init else "containerStatuses": [waiting]}
        self._phase_later(run, "Pending", status)

    def _phase_later(self, run: PodRun, phase: str, status: Mapping[str, Any], lag: float | None = None) -> None:
        """The pod's phase and ``status`` fields written by the status manager (see _later; ``lag`` instead of
        ``status_lag``), unless the pod went away or was replaced by another of its name meanwhile."""

        def publish() -> None:
            try:
                current = self.api.get_pod(run.namespace, run.name)
                if current is not None and current["metadata"].get("uid") == run.uid:
                    self.api.set_pod_phase(run.namespace, run.name, phase, **status)
            except Exception as err:  # the pod went away meanwhile
                log.info("status update of pod %s/%s not written: %s", run.namespace, run.name, err)

        self._later(publish, lag)

    def _later(self, publish: Callable[[], None], lag: float | None = None) -> None:
        """A status update the kubelet's status manager writes ``status_lag`` (or ``lag``) later (at once for 0)."""
        wait = self.status_lag if lag is None else lag
        if wait <= 0:
            publish()
            return
        timer = threading.Timer(wait, publish)
        timer.daemon = True
        self._status_timers = [t for t in self._status_timers if t.is_alive()] + [timer]
        timer.start()

    def _publish_late(self, run: PodRun) -> None:
        """The lagging status update; skipped when the pod is gone, was replaced by another of its name, or
        its containers were stopped meanwhile (its last status says so)."""
        try:
            current = self.api.get_pod(run.namespace, run.name)
            if current is None or current["metadata"].get("uid") != run.uid or self.terminator.stopped(run.uid):
                return
            self.publish_status(run)
        except Exception as exc:  # the pod went away meanwhile
            log.info("status update of pod %s/%s not written: %s", run.namespace, run.name, exc)

    def publish_status(self, run: PodRun) -> None:
        """The kubelet's status update: Running, with the containers' IDs (and the init containers')."""
        extra = {"initContainerStatuses": run.init_statuses} if run.init_statuses else {}
        self.api.set_pod_phase(
            run.namespace, run.name, "Running", containerStatuses=run.statuses, qosClass="Guaranteed", **extra
        )

    def wait_status(self, run: PodRun, timeout: float = 30.0) -> None:
        """Wait until the pod's status names its containers' IDs in the API server."""
        deadline = time.monotonic() + timeout
        while True:
            statuses = ((self.api.get_pod(run.namespace, run.name) or {}).get("status") or {}).get(
                "containerStatuses"
            ) or []
            if run.statuses and all(s.get("containerID") for s in statuses) and len(statuses) == len(run.statuses):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"pod {run.namespace}/{run.name}: no container status within {timeout:g} s")
            time.sleep(0.05)

    def run_pod(self, manifest: Mapping[str, Any]) -> PodRun:
        """Create, admit and start a pod."""
        run = self.admit(manifest)
        self.start_containers(run)
        return run

    def delete(self, run: PodRun, *, wait: bool = False) -> None:
        """The pod is deleted through the API as a user does: a pod on the node only gets its
        ``deletionTimestamp``; the kubelet stops its containers at once (their device IDs are free) and
        its last status and the final DELETE follow ``status_lag`` later. ``wait``: until the pod is
        gone from the API server (what ``kubectl delete`` waits for)."""
        pod = self.api.request_deletion(run.namespace, run.name)
        if pod is not None:
            self.terminator.handle("MODIFIED" if pod["metadata"].get("deletionTimestamp") else "DELETED", pod)
        if not wait:
            return
        deadline = time.monotonic() + self.status_lag + 30
        while (self.api.get_pod(run.namespace, run.name) or {}).get("metadata", {}).get("uid") == run.uid:
            if time.monotonic() > deadline:
                raise TimeoutError(f"pod {run.namespace}/{run.name} is still there after its deletion")
            time.sleep(0.05)

    def slow_stop(self, run: PodRun) -> None:
        """The pod's containers are slow to stop (a long preStop hook, a process ignoring SIGTERM): when the
        kubelet stops them, they run on (their cgroups stay, the kubelet still lists their devices) until
        :meth:`finish_stop`."""
        self._slow.add(run.uid)

    def finish_stop(self, run: PodRun) -> None:
        """The slow containers of :meth:`slow_stop` are stopped now (if the kubelet was stopping them)."""
        self._slow.discard(run.uid)
        if run.uid in self._stalled:
            self._stalled.discard(run.uid)
            self._stop_pod(run.uid)

    def end_pod(self, run: PodRun, *, status_lag: float | None = None) -> None:
        """The pod's containers end by themselves (a Job's, exit 0; restartPolicy Never): their cgroups go and
        the kubelet stops counting the pod at once (its device IDs are free for the next pod), while the
        status update (containers terminated, phase Succeeded) reaches the API server ``status_lag`` (the
        cluster's unless given) later, as the kubelet's status manager writes it."""
        from simnode.kubelet_deletion import terminated_statuses

        shutil.rmtree(self.cgroup_root / "kubepods" / f"pod{run.uid}", ignore_errors=True)
        self.kubelet.remove_pod(run.uid)
        self._phase_later(run, "Succeeded", {"containerStatuses": terminated_statuses(run.statuses)}, status_lag)

    def _stop_pod(self, uid: str) -> None:
        """The kubelet stops the pod's containers (their cgroups go) and frees its device IDs."""
        if uid in self._slow:
            self._stalled.add(uid)
            return
        shutil.rmtree(self.cgroup_root / "kubepods" / f"pod{uid}", ignore_errors=True)
        self.kubelet.remove_pod(uid)

    def _known_statuses(self, uid: str) -> list[dict[str, Any]]:
        run = self.runs.get(uid)
        return list(run.statuses) if run is not None else []

    def pod(self, run: PodRun) -> dict[str, Any]:
        """The pod as the API server has it now."""
        found: dict[str, Any] | None = self.api.get_pod(run.namespace, run.name)
        if found is None:
            raise KeyError(f"pod {run.namespace}/{run.name} is gone")
        return found

    def wait_annotations(self, run: PodRun, expected: Mapping[str, str], timeout: float = 10.0) -> dict[str, str]:
        """Wait until the pod carries ``expected`` annotations; returns them all."""
        deadline = time.monotonic() + timeout
        while True:
            current = (self.pod(run).get("metadata") or {}).get("annotations") or {}
            if all(current.get(k) == v for k, v in expected.items()):
                return dict(current)
            if time.monotonic() > deadline:
                raise TimeoutError(f"pod {run.name} annotations {current} do not include {dict(expected)}")
            time.sleep(0.05)
