"""A kubelet DRA stand-in: plugin watcher, NodePrepareResources/NodeUnprepareResources, CDI edits.

What it does as the kubelet does:

* **Plugin watcher**: polls the registry directory (``watch_period``; the kubelet uses inotify)
  for unix sockets; for each new one (by device and inode) it calls ``GetInfo``, checks the type
  (``DRAPlugin``), the name and the endpoint, picks the newest version it speaks (``versions``:
  ``v1.DRAPlugin``, else ``v1beta1.DRAPlugin``; a 1.33 kubelet speaks only v1beta1) and answers
  ``NotifyRegistrationStatus``. A socket that disappears
  deregisters its driver. It reads the driver's ``DRAResourceHealth`` stream while registered;
  a device the stream has not named again within the report's timeout (30 s unless the report
  says otherwise) shows as UNKNOWN, as in the kubelet's health cache.
* **Start and restart** delete every ResourceSlice of its node (as the kubelet does when it
  starts); the slices of a driver whose socket is gone are deleted ``slice_wipe_delay`` seconds
  (30 by default) later unless it registered again; a restart drops the plugin connections and,
  with ``wipe_sockets``, removes the sockets in the registry and plugins directories.
* **Pods**: :meth:`start_pod` resolves the pod's claims (``resourceClaimName`` or
  ``status.resourceClaimStatuses``), groups them by driver from their allocation results, calls
  ``NodePrepareResources`` once per driver (claims it has already prepared are not sent again:
  its claim-info cache survives restarts, like the kubelet's checkpoint), turns each
  container's CDI device IDs into edits read from the CDI spec files (spec-level edits once,
  then each device's; env merged last-wins) and starts the container as a child process.
  :meth:`stop_pod` ends the processes and unprepares claims no other pod on the node uses.

Not as the kubelet: mounts are applied by translating paths (the child's environment values
that point into a mounted container path get the host path; no mount namespace), device nodes
are checked for shape only, and a per-claim error is raised to the caller instead of retried.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from gpumanager.api import (
    dra_v1_pb2,
    dra_v1_pb2_grpc,
    dra_v1beta1_pb2,
    dra_v1beta1_pb2_grpc,
    drahealth_v1_pb2,
    drahealth_v1_pb2_grpc,
)
from gpumanager.api import pluginregistration_v1_pb2 as reg_pb
from gpumanager.api import pluginregistration_v1_pb2_grpc as reg_grpc
from simnode.cgroup_files import make_cgroup

log = logging.getLogger(__name__)

JSON = dict[str, Any]
VERSIONS = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
#: The kubelet's health timeout when a report names none (DefaultHealthTimeout).
DEFAULT_HEALTH_TIMEOUT = 30.0


class PrepareFailed(RuntimeError):
    """NodePrepareResources reported errors; ``errors`` maps claim name to the driver's message."""

    def __init__(self, errors: Mapping[str, str]) -> None:
        super().__init__("; ".join(f"{k}: {v}" for k, v in errors.items()))
        self.errors = dict(errors)


#: The health service a driver lists in GetInfo's supported versions for the kubelet to open its stream.
HEALTH_SERVICE = "v1.DRAResourceHealth"


@dataclass
class PluginRecord:
    """A registered DRA driver."""

    name: str
    endpoint: str
    version: str
    socket: Path
    identity: tuple[int, int, int]
    registered_at: float
    channel: grpc.Channel | None = None
    health: dict[str, tuple[int, str]] = field(default_factory=dict)  # device -> (status, message)
    # device -> (when the stream last named it, its health_check_timeout_seconds or the default)
    health_seen: dict[str, tuple[float, float]] = field(default_factory=dict)


@dataclass
class PreparedClaim:
    """The kubelet's claim-info cache entry."""

    namespace: str
    name: str
    uid: str
    driver: str
    devices: list[JSON]  # {request_names, pool, device, cdi_ids, share_id}
    pods: set[str] = field(default_factory=set)


@dataclass
class RunningContainer:
    """A container started from CDI edits."""

    pod_uid: str
    name: str
    env: dict[str, str]
    mounts: dict[str, str]  # container path -> host path
    device_nodes: list[str]
    cdi_ids: list[str]
    proc: subprocess.Popen[bytes] | None = None


def _identity(path: Path) -> tuple[int, int, int] | None:
    """Which file is at ``path`` now: device, inode and change time (a socket created again after
    its predecessor was unlinked often gets the same inode; the kubelet's inotify watch sees it)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_ctime_ns)


class DRAKubeletSimulator:
    """The DRA side of a kubelet for one node (thread-safe)."""

    def __init__(
        self,
        *,
        registry_dir: Path,
        api_client: Any,
        node: str,
        cdi_dirs: Sequence[Path],
        watch_period: float = 0.1,
        rpc_timeout: float = 45.0,
        versions: Sequence[str] = VERSIONS,
        slice_wipe_delay: float = 30.0,
    ) -> None:
        self.registry_dir = registry_dir
        self.node = node
        self.cdi_dirs = list(cdi_dirs)
        self._api: Any = k8s.ResourceV1Api(api_client)
        self._core: Any = k8s.CoreV1Api(api_client)
        self._period = watch_period
        self._rpc_timeout = rpc_timeout
        self.versions = tuple(versions)
        self.slice_wipe_delay = slice_wipe_delay
        self._lock = threading.RLock()
        self._plugins: dict[str, PluginRecord] = {}
        self._seen: dict[Path, tuple[int, int, int]] = {}
        self.claims: dict[str, PreparedClaim] = {}
        self.containers: dict[tuple[str, str], RunningContainer] = {}
        self.registration_log: list[tuple[float, str, str]] = []  # (time, driver, "ok" or error)
        self.prepare_calls: list[tuple[str, list[str]]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._health_threads: list[threading.Thread] = []

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Delete this node's ResourceSlices, then watch the registry directory."""
        self.registry_dir.mkdir(parents=True, exist_ok=True)
        self._delete_node_slices()
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, name="dra-kubelet-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop watching and close plugin connections (containers keep running)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        with self._lock:
            for plugin in self._plugins.values():
                if plugin.channel is not None:
                    plugin.channel.close()
            self._plugins.clear()
            self._seen.clear()

    def restart(self, *, wipe_sockets: bool = False, plugin_dirs: Sequence[Path] = ()) -> None:
        """A kubelet restart: connections dropped, optionally every socket removed, slices deleted."""
        self.stop()
        if wipe_sockets:
            for directory in [self.registry_dir, *plugin_dirs]:
                for entry in directory.glob("*.sock"):
                    entry.unlink(missing_ok=True)
        self.start()

    def kill_all(self) -> None:
        """End every container process."""
        with self._lock:
            for c in self.containers.values():
                if c.proc is not None and c.proc.poll() is None:
                    c.proc.kill()
                    c.proc.wait(5)

    # -- plugin watcher ------------------------------------------------------------------------

    def _delete_node_slices(self) -> None:
        try:
            listed = self._api.list_resource_slice(field_selector=f"spec.nodeName={self.node}")
        except ApiException as exc:
            log.warning("kubelet: cannot list ResourceSlices: %s", exc.reason)
            return
        for item in listed.items:
            try:
                self._api.delete_resource_slice(item.metadata.name)
                log.info("kubelet: deleted ResourceSlice %s of node %s at start", item.metadata.name, self.node)
            except ApiException:
                pass

    def _wipe_driver_slices(self, driver: str) -> None:
        """A driver gone for ``slice_wipe_delay`` seconds: delete its slices of this node, as the kubelet does."""
        with self._lock:
            if driver in self._plugins or self._stop.is_set():
                return
        try:
            listed = self._api.list_resource_slice(field_selector=f"spec.nodeName={self.node},spec.driver={driver}")
            for item in listed.items:
                self._api.delete_resource_slice(item.metadata.name)
                log.info("kubelet: driver %s is gone; deleted its ResourceSlice %s", driver, item.metadata.name)
        except ApiException as exc:
            log.warning("kubelet: cannot delete the slices of driver %s: %s", driver, exc.reason)

    def _watch(self) -> None:
        while not self._stop.is_set():
            try:
                self._scan()
            except Exception:
                log.exception("kubelet plugin watcher failed")
            self._stop.wait(self._period)

    def _scan(self) -> None:
        present = {p: _identity(p) for p in self.registry_dir.glob("*.sock")}
        with self._lock:
            for path, ident in list(self._seen.items()):
                if present.get(path) != ident:
                    del self._seen[path]
                    for name, plugin in list(self._plugins.items()):
                        if plugin.socket == path:
                            log.info("kubelet: plugin socket %s removed; deregistering %s", path, name)
                            if plugin.channel is not None:
                                plugin.channel.close()
                            del self._plugins[name]
                            timer = threading.Timer(self.slice_wipe_delay, self._wipe_driver_slices, args=(name,))
                            timer.daemon = True
                            timer.start()
            new = [(p, i) for p, i in present.items() if i is not None and self._seen.get(p) != i]
        for path, ident in new:
            self._register(path, ident)

    def _register(self, path: Path, ident: tuple[int, int, int]) -> None:
        with grpc.insecure_channel(f"unix://{path}") as channel:
            stub = reg_grpc.RegistrationStub(channel)
            try:
                info = stub.GetInfo(reg_pb.InfoRequest(), timeout=5)
            except grpc.RpcError as exc:
                log.warning("kubelet: GetInfo on %s failed: %s", path, exc.code())
                return
            error = ""
            version = next((v for v in self.versions if v in info.supported_versions), "")
            if info.type != "DRAPlugin":
                error = f"unsupported plugin type {info.type!r}"
            elif not info.name:
                error = "plugin name is empty"
            elif not version:
                error = f"none of the supported versions {list(info.supported_versions)} is known"
            elif not Path(info.endpoint).is_absolute() or not os.path.exists(info.endpoint):
                error = f"endpoint {info.endpoint!r} does not exist"
            try:
                stub.NotifyRegistrationStatus(
                    reg_pb.RegistrationStatus(plugin_registered=not error, error=error), timeout=5
                )
            except grpc.RpcError as exc:
                log.warning("kubelet: NotifyRegistrationStatus on %s failed: %s", path, exc.code())
        with self._lock:
            self._seen[path] = ident
            self.registration_log.append((time.monotonic(), info.name, error or "ok"))
            if error:
                log.warning("kubelet: refused plugin at %s: %s", path, error)
                return
            record = PluginRecord(info.name, info.endpoint, version, path, ident, time.monotonic())
            record.channel = grpc.insecure_channel(f"unix://{info.endpoint}")
            self._plugins[info.name] = record
        log.info("kubelet: registered DRA driver %s (%s at %s)", info.name, version, info.endpoint)
        if HEALTH_SERVICE not in info.supported_versions:
            # As the kubelet: a driver's health stream is opened only when its registration lists the service.
            log.info("kubelet: DRA driver %s does not list %s: no health stream", info.name, HEALTH_SERVICE)
            return
        thread = threading.Thread(target=self._read_health, args=(record,), name="dra-health", daemon=True)
        thread.start()
        self._health_threads.append(thread)

    def _read_health(self, record: PluginRecord) -> None:
        assert record.channel is not None
        stub = drahealth_v1_pb2_grpc.DRAResourceHealthStub(record.channel)
        try:
            for resp in stub.NodeWatchResources(drahealth_v1_pb2.NodeWatchResourcesRequest()):
                now = time.monotonic()
                with self._lock:
                    record.health = {d.device.device_name: (int(d.health), d.message) for d in resp.devices}
                    for d in resp.devices:
                        timeout = float(d.health_check_timeout_seconds) or DEFAULT_HEALTH_TIMEOUT
                        record.health_seen[d.device.device_name] = (now, timeout)
        except grpc.RpcError:
            return

    def device_health(self, driver: str) -> dict[str, tuple[int, str]]:
        """Each device's health as the kubelet shows it in pod status: as last reported, or UNKNOWN
        (0, no message) once the driver has not named the device within the report's timeout (the
        kubelet stamps a report with its own clock and ignores the driver's time)."""
        now = time.monotonic()
        with self._lock:
            record = self._plugins.get(driver)
            if record is None:
                return {}
            out = {}
            for device, (status, message) in record.health.items():
                seen, timeout = record.health_seen.get(device, (0.0, DEFAULT_HEALTH_TIMEOUT))
                out[device] = (status, message) if now - seen <= timeout else (0, "")
            return out

    def plugins(self) -> dict[str, PluginRecord]:
        """Registered drivers by name."""
        with self._lock:
            return dict(self._plugins)

    def wait_registered(self, driver: str, *, after: int = 0, timeout: float = 30.0) -> PluginRecord:
        """Wait until ``driver`` has registered more than ``after`` times; returns its record."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                count = sum(1 for _, name, result in self.registration_log if name == driver and result == "ok")
                if count > after and driver in self._plugins:
                    return self._plugins[driver]
            time.sleep(0.02)
        raise TimeoutError(f"DRA driver {driver} did not register (log: {self.registration_log})")

    def registrations(self, driver: str) -> int:
        """Successful registrations of ``driver`` so far."""
        with self._lock:
            return sum(1 for _, name, result in self.registration_log if name == driver and result == "ok")

    # -- NodePrepareResources ------------------------------------------------------------------

    def _plugin(self, driver: str) -> PluginRecord:
        with self._lock:
            plugin = self._plugins.get(driver)
        if plugin is None or plugin.channel is None:
            raise RuntimeError(f"DRA driver {driver} is not registered with the kubelet")
        return plugin

    def prepare(self, driver: str, claims: Sequence[tuple[str, str, str]]) -> dict[str, JSON]:
        """Call NodePrepareResources with (namespace, name, uid) claims; returns the raw answer per UID."""
        plugin = self._plugin(driver)
        self.prepare_calls.append((driver, [c[1] for c in claims]))
        if plugin.version == "v1.DRAPlugin":
            stub: Any = dra_v1_pb2_grpc.DRAPluginStub(plugin.channel)
            req: Any = dra_v1_pb2.NodePrepareResourcesRequest(
                claims=[dra_v1_pb2.Claim(namespace=ns, name=n, uid=u) for ns, n, u in claims]
            )
        else:
            stub = dra_v1beta1_pb2_grpc.DRAPluginStub(plugin.channel)
            req = dra_v1beta1_pb2.NodePrepareResourcesRequest(
                claims=[dra_v1beta1_pb2.Claim(namespace=ns, name=n, uid=u) for ns, n, u in claims]
            )
        resp = stub.NodePrepareResources(req, timeout=self._rpc_timeout)
        out: dict[str, JSON] = {}
        for uid, entry in resp.claims.items():
            out[uid] = {
                "error": entry.error,
                "devices": [
                    {
                        "request_names": list(d.request_names),
                        "pool": d.pool_name,
                        "device": d.device_name,
                        "cdi_ids": list(d.cdi_device_ids),
                        "share_id": d.share_id if hasattr(d, "share_id") and d.HasField("share_id") else "",
                    }
                    for d in entry.devices
                ],
            }
        return out

    def unprepare(self, driver: str, claims: Sequence[tuple[str, str, str]]) -> dict[str, str]:
        """Call NodeUnprepareResources; returns the error text per UID."""
        plugin = self._plugin(driver)
        if plugin.version == "v1.DRAPlugin":
            stub: Any = dra_v1_pb2_grpc.DRAPluginStub(plugin.channel)
            req: Any = dra_v1_pb2.NodeUnprepareResourcesRequest(
                claims=[dra_v1_pb2.Claim(namespace=ns, name=n, uid=u) for ns, n, u in claims]
            )
        else:
            stub = dra_v1beta1_pb2_grpc.DRAPluginStub(plugin.channel)
            req = dra_v1beta1_pb2.NodeUnprepareResourcesRequest(
                claims=[dra_v1beta1_pb2.Claim(namespace=ns, name=n, uid=u) for ns, n, u in claims]
            )
        resp = stub.NodeUnprepareResources(req, timeout=self._rpc_timeout)
        return {uid: entry.error for uid, entry in resp.claims.items()}

    # -- pods ----------------------------------------------------------------------------------

    def _pod_claims(self, pod: JSON) -> dict[str, JSON]:
        """Pod claim name -> the ResourceClaim (raises when one is not there yet)."""
        ns = pod["metadata"].get("namespace", "default")
        names: dict[str, str] = {}
        for entry in (pod.get("spec") or {}).get("resourceClaims") or []:
            if entry.get("resourceClaimName"):
                names[entry["name"]] = entry["resourceClaimName"]
        for entry in (pod.get("status") or {}).get("resourceClaimStatuses") or []:
            if entry.get("resourceClaimName"):
                names[entry["name"]] = entry["resourceClaimName"]
        wanted = [e["name"] for e in (pod.get("spec") or {}).get("resourceClaims") or []]
        missing = [w for w in wanted if w not in names]
        if missing:
            raise RuntimeError(f"pod {pod['metadata']['name']}: claims {missing} are not created yet")
        out = {}
        for local, claim_name in names.items():
            resp = self._api.read_namespaced_resource_claim(claim_name, ns, _preload_content=False)
            out[local] = json.loads(resp.data)
        return out

    def start_pod(
        self,
        pod: JSON,
        commands: Mapping[str, Sequence[str]] | None = None,
        *,
        base_env: Mapping[str, str] | None = None,
        cgroup_root: Path | None = None,
    ) -> dict[str, RunningContainer]:
        """Prepare the pod's claims and start its containers; raises PrepareFailed on claim errors."""
        uid = pod["metadata"]["uid"]
        claims = self._pod_claims(pod)
        by_driver: dict[str, list[JSON]] = {}
        for claim in claims.values():
            results = (((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or []
            drivers = sorted({r.get("driver") for r in results if r.get("driver")}) or ["?"]
            for d in drivers:
                by_driver.setdefault(str(d), []).append(claim)
        errors: dict[str, str] = {}
        for driver, driver_claims in sorted(by_driver.items()):
            todo = [c for c in driver_claims if c["metadata"]["uid"] not in self.claims]
            if todo:
                refs = [(c["metadata"]["namespace"], c["metadata"]["name"], c["metadata"]["uid"]) for c in todo]
                answer = self.prepare(driver, refs)
                for c in todo:
                    cuid = c["metadata"]["uid"]
                    entry = answer.get(cuid)
                    if entry is None:
                        errors[c["metadata"]["name"]] = "no entry in the NodePrepareResources response"
                    elif entry["error"]:
                        errors[c["metadata"]["name"]] = entry["error"]
                    else:
                        with self._lock:
                            self.claims[cuid] = PreparedClaim(
                                c["metadata"]["namespace"], c["metadata"]["name"], cuid, driver, entry["devices"]
                            )
        if errors:
            raise PrepareFailed(errors)
        with self._lock:
            for claim in claims.values():
                self.claims[claim["metadata"]["uid"]].pods.add(uid)
        return self._start_containers(pod, claims, commands or {}, base_env or {}, cgroup_root)

    def _cdi_devices(self) -> dict[str, tuple[JSON, JSON]]:
        """Fully qualified CDI device ID -> (spec, device), from every spec file."""
        out: dict[str, tuple[JSON, JSON]] = {}
        for directory in self.cdi_dirs:
            for path in sorted(directory.glob("*.json")):
                spec = json.loads(path.read_text())
                for dev in spec.get("devices") or []:
                    if not dev.get("containerEdits"):
                        raise RuntimeError(f"CDI spec {path}: device {dev.get('name')} has no edits (invalid spec)")
                    out[f"{spec['kind']}={dev['name']}"] = (spec, dev)
        return out

    def _start_containers(
        self,
        pod: JSON,
        claims: Mapping[str, JSON],
        commands: Mapping[str, Sequence[str]],
        base_env: Mapping[str, str],
        cgroup_root: Path | None,
    ) -> dict[str, RunningContainer]:
        uid = pod["metadata"]["uid"]
        known = self._cdi_devices()
        started: dict[str, RunningContainer] = {}
        for container in pod["spec"]["containers"]:
            refs = ((container.get("resources") or {}).get("claims")) or []
            ids: list[str] = []
            for ref in refs:
                claim = claims[ref["name"]]
                prepared = self.claims[claim["metadata"]["uid"]]
                for dev in prepared.devices:
                    if ref.get("request") and ref["request"] not in dev["request_names"]:
                        continue
                    ids.extend(dev["cdi_ids"])
            env: dict[str, str] = {}
            mounts: dict[str, str] = {}
            nodes: list[str] = []
            applied_specs: set[int] = set()
            for cdi_id in ids:
                if cdi_id not in known:
                    raise RuntimeError(f"container {container['name']}: CDI device {cdi_id} is not in any spec")
                spec, dev = known[cdi_id]
                edits_list = []
                if id(spec) not in applied_specs and spec.get("containerEdits"):
                    applied_specs.add(id(spec))
                    edits_list.append(spec["containerEdits"])
                edits_list.append(dev["containerEdits"])
                for edits in edits_list:
                    for item in edits.get("env") or []:
                        key, _, value = item.partition("=")
                        env[key] = value
                    for m in edits.get("mounts") or []:
                        if "bind" not in (m.get("options") or []) and m.get("type") != "bind":
                            raise RuntimeError(f"CDI mount {m} has no bind option")
                        mounts[m["containerPath"]] = m["hostPath"]
                    nodes.extend(n["path"] for n in edits.get("deviceNodes") or [])
            run = RunningContainer(uid, container["name"], env, mounts, nodes, ids)
            command = commands.get(container["name"])
            if command:
                child_env = dict(base_env)
                child_env.update({k: self._translate(v, mounts) for k, v in env.items()})
                run.proc = subprocess.Popen(
                    list(command), env=child_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
                )
                if cgroup_root is not None:
                    cid = f"{uid[:8]}{container['name']}".replace("-", "")
                    make_cgroup(cgroup_root / "kubepods" / f"pod{uid}" / cid, [run.proc.pid])
            with self._lock:
                self.containers[(uid, container["name"])] = run
            started[container["name"]] = run
        return started

    @staticmethod
    def _translate(value: str, mounts: Mapping[str, str]) -> str:
        """Container paths in an env value (``:`` separated) as host paths through the mounts."""
        parts = []
        for part in value.split(":"):
            for cpath in sorted(mounts, key=len, reverse=True):
                if part == cpath or part.startswith(cpath.rstrip("/") + "/"):
                    part = mounts[cpath] + part[len(cpath.rstrip("/")) :]
                    break
            parts.append(part)
        return ":".join(parts)

    def stop_pod(self, pod_uid: str) -> dict[str, str]:
        """End the pod's containers, then unprepare claims no other pod uses; returns per-claim errors."""
        with self._lock:
            for key in [k for k in self.containers if k[0] == pod_uid]:
                run = self.containers.pop(key)
                if run.proc is not None and run.proc.poll() is None:
                    run.proc.kill()
                    run.proc.wait(5)
            done: dict[str, list[PreparedClaim]] = {}
            for claim in self.claims.values():
                claim.pods.discard(pod_uid)
                if not claim.pods:
                    done.setdefault(claim.driver, []).append(claim)
        errors: dict[str, str] = {}
        for driver, claims in done.items():
            answer = self.unprepare(driver, [(c.namespace, c.name, c.uid) for c in claims])
            for c in claims:
                err = answer.get(c.uid, "no entry in the NodeUnprepareResources response")
                if err:
                    errors[c.name] = err
                else:
                    with self._lock:
                        self.claims.pop(c.uid, None)
        return errors
