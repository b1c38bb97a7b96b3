"""A kubelet DRA stand-in: plugin watcher, NodePrepareResources/NodeUnprepareResources, CDI edits.

What it does as the kubelet does:

* **Plugin watcher**: polls the registry directory (``watch_period``; the kubelet uses inotify)
  for unix sockets; for each new one (by device and inode) it calls ``GetInfo``, checks the type
  (``DRAPlugin``), the name and the endpoint, picks the newest version it speaks (``versions``:
  ``v1.DRAPlugin``, else ``v1beta1.DRAPlugin``; a 1.33 kubelet speaks only v1beta1) and answers
  ``NotifyRegistrationStatus``; a refused registration is tried again (GetInfo, the checks,
  NotifyRegistrationStatus) with the plugin manager's backoff, 0.5 s doubling to 2 min 2 s, while the
  socket stays. A socket that disappears
  deregisters its driver. It reads the driver's ``DRAResourceHealth`` stream while registered;
  a device the stream has not named again within the report's timeout (30 s unless the report
  says otherwise) shows as UNKNOWN, as in the kubelet's health cache.
* **Start and restart** delete every ResourceSlice of its node (as the kubelet does when it
  starts); the slices of a driver whose socket is gone are deleted ``slice_wipe_delay`` seconds
  (30 by default) later unless it registered again, and so are those of a driver whose
  ``dra.sock`` has accepted no connection for that long though its registration socket stays
  (the kubelet watches the gRPC connection); a restart drops the plugin connections and,
  with ``wipe_sockets``, removes the sockets in the registry and plugins directories.
* **Pods**: :meth:`start_pod` resolves the pod's claims (``resourceClaimName`` or
  ``status.resourceClaimStatuses``), groups them by driver from their allocation results, calls
  ``NodePrepareResources`` once per driver (claims it has already prepared are not sent again;
  its claim-info cache survives restarts, like the kubelet's checkpoint, but without the
  "prepared" mark, so after a restart a claim is sent again with the next pod that uses it;
  a claim enters the cache before the call, so one whose Prepare failed is unprepared when its
  pod goes; one claim's error leaves the whole call's claims unprepared), turns each
  container's CDI device IDs into edits read from the CDI spec files (spec-level edits once,
  then each device's; env merged last-wins) and starts the container as a child process.
  :meth:`stop_pod` ends the processes and unprepares claims no other pod on the node uses.

Not as the kubelet: mounts are applied by translating paths (the child's environment values
that point into a mounted container path get the host path; no mount namespace), device nodes
are checked for shape only, and a Prepare error is raised to the caller (PrepareFailed) instead of
retried with backoff: the caller calls again, as the kubelet's next pod sync does.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import subprocess
import threading
import time
import uuid
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


#: The plugin manager's backoff for a registration that failed (initial and maximum delay).
REGISTRATION_RETRY_FIRST = 0.5
REGISTRATION_RETRY_MAX = 122.0

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
    # When the connection to the endpoint was found down (None: connected), and whether the
    # driver's slices were wiped for it since.
    down_since: float | None = None
    wiped: bool = False


@dataclass
class PreparedClaim:
    """The kubelet's claim-info cache entry."""

    namespace: str
    name: str
    uid: str
    driver: str
    devices: list[JSON]  # {request_names, pool, device, cdi_ids, share_id}
    pods: set[str] = field(default_factory=set)
    # Set when NodePrepareResources succeeded; not checkpointed: after a kubelet restart the
    # claim is sent again with the next pod sandbox that uses it.
    prepared: bool = False


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


def _accepts(endpoint: str) -> bool:
    """Whether a unix socket at ``endpoint`` accepts a connection now."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(1.0)
        try:
            sock.connect(endpoint)
        except OSError:
            return False
    return True


def _identity(path: Path) -> tuple[int, int, int] | None:
    """Which file is at ``path`` now: device, inode and change time (a socket created again after
    its predecessor was unlinked often gets the same inode; the kubelet's inotify watch sees it)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_ctime_ns)


#: CDI specification versions a current runtime loads, and what each newer one adds that a spec needs.
CDI_VERSIONS = ("0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0")
_SPEC_KEYS = {"cdiVersion", "kind", "annotations", "devices", "containerEdits"}
_DEVICE_KEYS = {"name", "annotations", "containerEdits"}
_EDIT_KEYS = {"env", "deviceNodes", "mounts", "hooks", "additionalGIDs", "intelRdt", "netDevices"}
_NODE_KEYS = {"path", "hostPath", "type", "major", "minor", "fileMode", "permissions", "uid", "gid"}
_MOUNT_KEYS = {"hostPath", "containerPath", "type", "options"}
_HOOK_KEYS = {"hookName", "path", "args", "env", "timeout"}
_VENDOR_CLASS = re.compile(r"^[A-Za-z]([A-Za-z0-9_.-]*[A-Za-z0-9])?$")
_DEVICE_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?$")


def _cdi_version(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("."))


def cdi_spec_problem(spec: Any) -> str | None:
    """Why a CDI runtime refuses to load ``spec`` (one file), or None: unknown fields, a version it
    does not know or below what the fields used need, a malformed kind or device name, a device
    with no edits, a malformed env entry, device node, mount or hook."""
    if not isinstance(spec, dict):
        return "not an object"
    if extra := set(spec) - _SPEC_KEYS:
        return f"unknown fields {sorted(extra)}"
    version = spec.get("cdiVersion")
    if version not in CDI_VERSIONS:
        return f"unsupported cdiVersion {version!r}"
    vendor, _, klass = str(spec.get("kind", "")).partition("/")
    if not _VENDOR_CLASS.match(vendor) or not _VENDOR_CLASS.match(klass):
        return f"invalid kind {spec.get('kind')!r}"
    devices = spec.get("devices")
    if not isinstance(devices, list) or not devices:
        return "no devices"
    names = [d.get("name") if isinstance(d, dict) else None for d in devices]
    if len(set(names)) != len(names):
        return "duplicate device names"
    need = "0.3.0"
    edit_sets: list[Any] = [spec.get("containerEdits") or {}]
    for dev in devices:
        if not isinstance(dev, dict) or (extra := set(dev) - _DEVICE_KEYS):
            return f"device {dev!r}: unknown fields"
        if not isinstance(dev.get("name"), str) or not _DEVICE_NAME.match(dev["name"]):
            return f"invalid device name {dev.get('name')!r}"
        if not dev.get("containerEdits"):
            return f"device {dev['name']} has no edits"
        if not dev["name"][:1].isalpha():
            need = max(need, "0.5.0", key=_cdi_version)
        if dev.get("annotations"):
            need = max(need, "0.6.0", key=_cdi_version)
        edit_sets.append(dev["containerEdits"])
    if spec.get("annotations"):
        need = max(need, "0.6.0", key=_cdi_version)
    for edits in edit_sets:
        if not isinstance(edits, dict) or (extra := set(edits) - _EDIT_KEYS):
            return f"containerEdits: unknown fields {sorted(extra) if isinstance(edits, dict) else edits!r}"
        for item in edits.get("env") or []:
            if not isinstance(item, str) or "=" not in item or not item.split("=", 1)[0]:
                return f"invalid env entry {item!r}"
        for node in edits.get("deviceNodes") or []:
            if not isinstance(node, dict) or set(node) - _NODE_KEYS or not str(node.get("path", "")).startswith("/"):
                return f"invalid device node {node!r}"
            if not set(str(node.get("permissions", "rwm"))) <= set("rwm"):
                return f"invalid device node permissions {node!r}"
            if node.get("hostPath"):
                need = max(need, "0.5.0", key=_cdi_version)
        for m in edits.get("mounts") or []:
            if not isinstance(m, dict) or set(m) - _MOUNT_KEYS:
                return f"invalid mount {m!r}"
            if not str(m.get("hostPath", "")).startswith("/") or not str(m.get("containerPath", "")).startswith("/"):
                return f"invalid mount {m!r}"
            if m.get("type"):
                need = max(need, "0.4.0", key=_cdi_version)
        for hook in edits.get("hooks") or []:
            if not isinstance(hook, dict) or set(hook) - _HOOK_KEYS or not hook.get("path"):
                return f"invalid hook {hook!r}"
    if _cdi_version(version) < _cdi_version(need):
        return f"cdiVersion {version} is below {need}, which the fields used need"
    return None


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
        health_service: str = HEALTH_SERVICE,
        health_retry: float = 5.0,
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
        #: The health service this kubelet calls (``v1alpha1.DRAResourceHealth`` for 1.34/1.35,
        #: ``v1beta1.`` or ``v1.`` for later ones), and how long it waits to open an ended stream again.
        self.health_service = health_service
        self.health_retry = health_retry
        self.health_stream_starts: dict[str, int] = {}  # driver -> health streams that ended
        self._lock = threading.RLock()
        self._plugins: dict[str, PluginRecord] = {}
        self._seen: dict[Path, tuple[int, int, int]] = {}
        # Refused registrations: socket -> (when to try again, the backoff used), as the plugin
        # manager's reconciler retries a failed registration with exponential backoff.
        self._refused: dict[Path, tuple[float, float]] = {}
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
        with self._lock:
            # The claim-info cache read back from the checkpoint: pods and devices kept, no claim
            # marked prepared (the kubelet keeps that flag in memory only).
            for claim in self.claims.values():
                claim.prepared = False
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
            self._refused.clear()

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
        self._delete_driver_slices(driver)

    def _delete_driver_slices(self, driver: str) -> None:
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

    def _check_connections(self) -> None:
        """As the kubelet's plugin manager watches each plugin's gRPC connection: a driver whose
        endpoint has accepted no connection for ``slice_wipe_delay`` seconds, though its
        registration socket stays, is not usable and its slices of this node are deleted."""
        with self._lock:
            plugins = list(self._plugins.values())
        now = time.monotonic()
        for plugin in plugins:
            up = _accepts(plugin.endpoint)
            wipe = False
            with self._lock:
                if up:
                    plugin.down_since, plugin.wiped = None, False
                elif plugin.down_since is None:
                    plugin.down_since = now
                    log.info("kubelet: connection to DRA driver %s at %s is down", plugin.name, plugin.endpoint)
                elif not plugin.wiped and now - plugin.down_since >= self.slice_wipe_delay:
                    plugin.wiped = wipe = True
            if wipe:
                self._delete_driver_slices(plugin.name)

    def _scan(self) -> None:
        self._check_connections()
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
            now = time.monotonic()
            for path in list(self._refused):
                if path not in self._seen:
                    del self._refused[path]
            new = [
                (p, i)
                for p, i in present.items()
                if i is not None and (self._seen.get(p) != i or (p in self._refused and now >= self._refused[p][0]))
            ]
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
            # As the kubelet: the first of the plugin's list that the kubelet speaks.
            version = next((v for v in info.supported_versions if v in self.versions), "")
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
                _, delay = self._refused.get(path, (0.0, 0.0))
                delay = min(max(delay * 2, REGISTRATION_RETRY_FIRST), REGISTRATION_RETRY_MAX)
                self._refused[path] = (time.monotonic() + delay, delay)
                log.warning("kubelet: refused plugin at %s: %s (tried again in %.1f s)", path, error, delay)
                return
            self._refused.pop(path, None)
            record = PluginRecord(info.name, info.endpoint, version, path, ident, time.monotonic())
            record.channel = grpc.insecure_channel(f"unix://{info.endpoint}")
            self._plugins[info.name] = record
        log.info("kubelet: registered DRA driver %s (%s at %s)", info.name, version, info.endpoint)
        if self.health_service not in info.supported_versions:
            # As the kubelet: a driver's health stream is opened only when its registration lists the service.
            log.info("kubelet: DRA driver %s does not list %s: no health stream", info.name, self.health_service)
            return
        thread = threading.Thread(target=self._read_health, args=(record,), name="dra-health", daemon=True)
        thread.start()
        self._health_threads.append(thread)

    def _read_health(self, record: PluginRecord) -> None:
        """Read the driver's health stream (the gRPC service ``health_service``); a stream that ends or
        cannot be opened is opened again ``health_retry`` seconds later while the driver stays
        registered, as the kubelet does (every 5 s)."""
        assert record.channel is not None
        call = record.channel.unary_stream(
            f"/{self.health_service}/NodeWatchResources",
            request_serializer=drahealth_v1_pb2.NodeWatchResourcesRequest.SerializeToString,
            response_deserializer=drahealth_v1_pb2.NodeWatchResourcesResponse.FromString,
        )
        while True:
            try:
                for resp in call(drahealth_v1_pb2.NodeWatchResourcesRequest()):
                    now = time.monotonic()
                    with self._lock:
                        record.health = {d.device.device_name: (int(d.health), d.message) for d in resp.devices}
                        for d in resp.devices:
                            timeout = float(d.health_check_timeout_seconds) or DEFAULT_HEALTH_TIMEOUT
                            record.health_seen[d.device.device_name] = (now, timeout)
            except (grpc.RpcError, ValueError) as exc:  # ValueError: the channel was closed
                log.info("kubelet: health stream of %s ended: %s", record.name, exc)
            with self._lock:
                self.health_stream_starts[record.name] = self.health_stream_starts.get(record.name, 0) + 1
            if self._stop.wait(self.health_retry):
                return
            with self._lock:
                if self._plugins.get(record.name) is not record:
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
        """Prepare the pod's claims and start its containers, as the kubelet before a sandbox is made.

        As the kubelet's DRA manager: every claim must list the pod in ``status.reservedFor`` and
        every driver must be registered (even for claims already prepared); each claim enters the
        claim-info cache with the pod's reference *before* NodePrepareResources is called, so a
        claim whose preparation failed is still unprepared when the pod goes; a claim is marked
        prepared only when every call for the pod succeeded (one claim's error leaves the others of
        the call unprepared: the next try sends them again); an answer naming an unknown claim or
        leaving one out fails the pod. Raises PrepareFailed on any of these (the kubelet retries
        with backoff; the caller calls again)."""
        uid = pod["metadata"]["uid"]
        pod_name = pod["metadata"].get("name", "")
        claims = self._pod_claims(pod)
        by_driver: dict[str, list[JSON]] = {}
        errors: dict[str, str] = {}
        for claim in claims.values():
            md = claim["metadata"]
            reserved = ((claim.get("status") or {}).get("reservedFor")) or []
            if not any(r.get("uid") == uid for r in reserved):
                errors[md["name"]] = (
                    f"pod {pod_name} ({uid}) is not allowed to use ResourceClaim {md['name']} ({md['uid']})"
                )
                continue
            results = (((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or []
            drivers = sorted({str(r.get("driver")) for r in results if r.get("driver")})
            for d in drivers:
                if d not in self.plugins():
                    errors[md["name"]] = f"DRA driver {d} is not registered"
                by_driver.setdefault(d, []).append(claim)
        if errors:
            raise PrepareFailed(errors)
        with self._lock:
            for claim in claims.values():
                md = claim["metadata"]
                known = self.claims.get(md["uid"])
                same_name = [c for c in self.claims.values() if (c.namespace, c.name) == (md["namespace"], md["name"])]
                if known is None and same_name:
                    errors[md["name"]] = (
                        f"old ResourceClaim with same name {md['name']} and different UID "
                        f"{same_name[0].uid} still exists (previous pod force-deleted?!)"
                    )
                    continue
                if known is None:
                    results = (((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get(
                        "results"
                    ) or []
                    drivers = sorted({str(r.get("driver")) for r in results if r.get("driver")}) or ["?"]
                    known = PreparedClaim(md["namespace"], md["name"], md["uid"], drivers[0], [])
                    self.claims[md["uid"]] = known
                known.pods.add(uid)  # checkpointed before the call, as the kubelet does
        if errors:
            raise PrepareFailed(errors)
        answers: dict[str, list[JSON]] = {}
        for driver, driver_claims in sorted(by_driver.items()):
            todo = [c for c in driver_claims if not self.claims[c["metadata"]["uid"]].prepared]
            if not todo:
                continue
            refs = [(c["metadata"]["namespace"], c["metadata"]["name"], c["metadata"]["uid"]) for c in todo]
            try:
                answer = self.prepare(driver, refs)
            except grpc.RpcError as exc:
                failed = f"NodePrepareResources: {exc.code()}: {exc.details() if hasattr(exc, 'details') else ''}"
                raise PrepareFailed({c["metadata"]["name"]: failed for c in todo}) from None
            by_uid = {c["metadata"]["uid"]: c for c in todo}
            for cuid, entry in answer.items():
                if cuid not in by_uid:
                    raise PrepareFailed({"?": f"NodePrepareResources returned result for unknown claim UID {cuid}"})
                if entry["error"]:
                    # The kubelet stops at the first error: no claim of this pod is marked prepared.
                    raise PrepareFailed({by_uid[cuid]["metadata"]["name"]: entry["error"]})
                answers[cuid] = entry["devices"]
            left = [c["metadata"]["name"] for c in todo if c["metadata"]["uid"] not in answer]
            if left:
                raise PrepareFailed({n: f"NodePrepareResources skipped {len(left)} ResourceClaims" for n in left})
        with self._lock:
            for cuid, devices in answers.items():
                self.claims[cuid].devices = devices
                self.claims[cuid].prepared = True
        return self._start_containers(pod, claims, commands or {}, base_env or {}, cgroup_root)

    def _cdi_devices(self) -> tuple[dict[str, tuple[JSON, JSON]], dict[str, str]]:
        """As a CDI runtime's registry: fully qualified device ID -> (spec, device) from every spec
        file that loads, and the error of every file that does not (its devices cannot be used;
        the other files' can)."""
        out: dict[str, tuple[JSON, JSON]] = {}
        broken: dict[str, str] = {}
        for directory in self.cdi_dirs:
            for path in sorted(directory.glob("*.json")):
                try:
                    spec = json.loads(path.read_text())
                    problem = cdi_spec_problem(spec)
                except (OSError, ValueError) as exc:
                    spec, problem = None, f"cannot parse: {exc}"
                if problem is not None or not isinstance(spec, dict):
                    broken[str(path)] = problem or "not an object"
                    log.warning("CDI runtime: spec %s refused: %s", path, broken[str(path)])
                    continue
                for dev in spec["devices"]:
                    out[f"{spec['kind']}={dev['name']}"] = (spec, dev)
        return out, broken

    def _start_containers(
        self,
        pod: JSON,
        claims: Mapping[str, JSON],
        commands: Mapping[str, Sequence[str]],
        base_env: Mapping[str, str],
        cgroup_root: Path | None,
    ) -> dict[str, RunningContainer]:
        uid = pod["metadata"]["uid"]
        known, broken = self._cdi_devices()
        started: dict[str, RunningContainer] = {}
        if cgroup_root is not None:
            # The sandbox (the pause container) first, its cgroup beside the containers': no status names it.
            pod_cgroup = cgroup_root / "kubepods" / f"pod{uid}"
            if not pod_cgroup.is_dir():
                make_cgroup(pod_cgroup / uuid.uuid5(uuid.NAMESPACE_OID, uid).hex, [1])
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
                    why = "; ".join(f"{p}: {e}" for p, e in sorted(broken.items()))
                    raise RuntimeError(
                        f"container {container['name']}: unresolvable CDI device {cdi_id}"
                        + (f" (refused spec files: {why})" if why else "")
                    )
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
        """End the pod's containers, then unprepare the claims no other pod uses; returns per-claim errors.

        As the kubelet: every claim that holds the pod's reference is unprepared, prepared or not
        (a claim whose Prepare failed is unprepared too); the first error (a call error, a
        per-claim error, a claim left out of the answer) stops it and no claim leaves the cache,
        so a later call (the kubelet's reconcile loop) sends them all again."""
        with self._lock:
            for key in [k for k in self.containers if k[0] == pod_uid]:
                run = self.containers.pop(key)
                if run.proc is not None and run.proc.poll() is None:
                    run.proc.kill()
                    run.proc.wait(5)
            done: dict[str, list[PreparedClaim]] = {}
            for claim in self.claims.values():
                if pod_uid not in claim.pods:
                    continue
                if len(claim.pods) > 1:
                    claim.pods.discard(pod_uid)
                else:
                    done.setdefault(claim.driver, []).append(claim)
        for driver, claims in sorted(done.items()):
            if driver == "?":
                continue
            try:
                answer = self.unprepare(driver, [(c.namespace, c.name, c.uid) for c in claims])
            except (grpc.RpcError, RuntimeError) as exc:
                detail = exc.code() if isinstance(exc, grpc.RpcError) else exc
                return {c.name: f"NodeUnprepareResources: {detail}" for c in claims}
            names = {c.uid: c.name for c in claims}
            for cuid, err in answer.items():
                if cuid not in names:
                    return {"?": f"NodeUnprepareResources returned result for unknown claim UID {cuid}"}
                if err:
                    return {names[cuid]: err}
            left = [c.name for c in claims if c.uid not in answer]
            if left:
                return {n: f"NodeUnprepareResources skipped {len(left)} ResourceClaims" for n in left}
        with self._lock:
            for claims in done.values():
                for c in claims:
                    self.claims.pop(c.uid, None)
        return {}

    def pods_to_unprepare(self) -> set[str]:
        """UIDs of pods still referenced by a claim in the cache (the kubelet's reconcile loop
        unprepares those of pods that are no longer active)."""
        with self._lock:
            return {uid for claim in self.claims.values() for uid in claim.pods}
