"""The agent's configuration: one frozen dataclass built from the command line, and its validation."""

from __future__ import annotations

import errno
import os
import re
import socket
import stat
from dataclasses import dataclass, field
from pathlib import Path

from gpumanager import flagspec, names
from gpumanager.flagspec import (
    choice,
    duration,
    number,
    parse_trace_location,
    parse_vmodule,
    parsed_text,
    severity,
    switch,
    text,
    xid_list,
)

#: The shortest --health-probe-period and --kubelet-watch-period, seconds.
MIN_PERIOD = 0.01

#: A pod UID (a UUID in its 36-character text form) names its directory under --virtual-manager-path.
POD_UID_LENGTH = 36

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*\Z")


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the flag and the value."""


@dataclass(frozen=True)
class Config:
    """Everything the agent needs to know at start-up.

    Field names follow gpu-manager v1.1's flags (``--device-plugin-path`` is
    ``device_plugin_path``); durations are seconds. Every field declared with a
    :mod:`gpumanager.flagspec` helper is a flag and an environment variable
    (``GPU_MANAGER_DEVICE_PLUGIN_PATH``); a new flag is one such field here.
    """

    # gpu-manager v1.1's flags, same names and meanings.
    driver: str = text("nvidia", "GPU driver family (only nvidia)", metavar="NAME")
    extra_config: str = text(
        "", "extra-config.json: device nodes added to every container (default.devices)", shown="none", metavar="FILE"
    )
    volume_config: str = text(
        "", "volume.conf: build the driver mirror (vdriver/{nvidia,origin}) at start", shown="none", metavar="FILE"
    )
    query_addr: str = text(
        "localhost", "bind address of the HTTP endpoints (/metrics, /healthz, /usage, ...)", metavar="ADDR"
    )
    query_port: int = number(5678, "port of the HTTP endpoints", metavar="PORT")
    kubeconfig: str = text(
        "",
        "kubeconfig of the API server; without one the device plugin serves and Allocate refuses clearly",
        shown="in-cluster",
        metavar="FILE",
    )
    sample_period: int = number(1, "seconds of NVML utilisation samples behind the usage metrics", metavar="SECONDS")
    node_labels: str = text(
        "",
        "k=v,... applied to the node; gaia.tencent.com/gpu-model gets the GPU model; retried until the API server "
        "takes them (refused for good only on 403, 404 or 422)",
        shown="none",
        metavar="LABELS",
    )
    hostname_override: str = text(
        "", "node name (pods are watched with spec.nodeName=)", shown="$NODE_NAME, else the host name", metavar="NAME"
    )
    virtual_manager_path: str = text(
        names.DEFAULT_VIRTUAL_MANAGER_PATH,
        "per-pod directories, mounted at /etc/vcuda, and each container's own directory "
        "configs/<pod uid>/<container>, mounted at /etc/vcuda/<container>",
        metavar="DIR",
    )
    device_plugin_path: str = text(names.DEFAULT_DEVICE_PLUGIN_PATH, "kubelet device-plugin directory", metavar="DIR")
    checkpoint_path: str = text(
        names.DEFAULT_CHECKPOINT_PATH, "directory of the checkpoint gpumanager_internal_checkpoint", metavar="DIR"
    )
    share_mode: bool = switch(False, "allow vcuda-core < 100 (a share of one GPU; needs vcuda-memory)")
    allocation_check_period: int = number(
        30, "seconds between checks that free finished pods and repair annotations", metavar="SECONDS"
    )
    container_runtime_endpoint: str = text(
        "/var/run/dockershim.sock",
        "accepted for compatibility; container names come from the pod status instead",
        metavar="ENDPOINT",
    )
    cgroup_driver: str = text(
        "cgroupfs", "accepted for compatibility: both cgroupfs and systemd layouts are found", metavar="DRIVER"
    )
    runtime_request_timeout: float = duration(5.0, "accepted for compatibility; no container runtime is called")
    wait_timeout: float = duration(
        60.0,
        "accepted for compatibility in device-plugin mode, where nothing waits on it (gpu-manager exited 1 when its"
        " sockets did not answer in time; ours listen before the start ends, and a kubelet that is not there is"
        " retried and reported at once); with --mode=dra, how long the kubelet may take to register the driver"
        " once its sockets are served (at start, after a kubelet restart) before that is logged once and reported"
        " on /healthz and /readyz; the agent never exits for it",
    )
    # Beyond upstream.
    display_socket: str = text(names.DEFAULT_DISPLAY_SOCKET, "display gRPC socket", metavar="PATH")
    pod_resources_socket: str = text(
        names.DEFAULT_POD_RESOURCES_SOCKET, "the kubelet's PodResources API socket", metavar="PATH"
    )
    nvml_lib: str = text("", "path of libnvidia-ml.so.1", shown="the linker's choice", metavar="PATH")
    cgroup_root: str = text(
        "/sys/fs/cgroup", "where container PIDs are looked up (cgroup v1 or v2, either driver)", metavar="DIR"
    )
    driver_root: str = text(
        "/", "the host's root for driver files (the image mounts the host's / at /usr/local/host)", metavar="DIR"
    )
    vcuda_library: str = text(
        "/usr/local/lib/gpu-manager/libcuda-control.so", "the interceptor shared containers get", metavar="PATH"
    )
    gpu_client: str = text(
        "",
        "gpu-client put in vdriver/nvidia/bin (upstream's library runs it to register over vcuda.sock)",
        shown="gpu-client beside --vcuda-library",
        metavar="PATH",
    )
    proc_root: str = text(
        "/proc", "where processes are inspected for driver files they map or mount (the host's: hostPID)", metavar="DIR"
    )
    ignored_xids: tuple[int, ...] = xid_list(
        names.DEFAULT_IGNORED_XIDS, "XIDs (comma-separated decimal numbers) that never make a GPU unhealthy"
    )
    health_quiet_period: float = duration(300.0, "error-free time before an unhealthy GPU is offered again")
    health_probe_period: float = duration(1.0, "how often every GPU is asked whether it is still there (at least 10ms)")
    kubelet_watch_period: float = duration(
        5.0,
        "safety-net check of the kubelet socket and the agent's own (inotify reports changes at once; at least 10ms)",
    )
    replaced_gpu_wait: float = duration(
        300.0,
        "how long a container started again on a smaller GPU that replaced its own while the agent was down waits"
        " for room there (its start refused with UNAVAILABLE, the kubelet trying again), from its first refused"
        " start, before its start is refused for good (PreStartContainer check failed: the pod is to be placed"
        " again); 0: at once",
    )
    # DRA mode (one mode per node).
    mode: str = choice(
        "device-plugin",
        ("device-plugin", "dra"),
        "device-plugin: tencent.com/vcuda-* through the device-plugin API; dra: ResourceSlices and DRA claims",
    )
    dra_driver_name: str = text(
        "vcuda.tencent.com", "DRA driver name (DeviceClass, ResourceSlices, CDI kind)", metavar="NAME"
    )
    plugin_registry_path: str = text(
        "/var/lib/kubelet/plugins_registry", "the kubelet's plugin registration directory (DRA mode)", metavar="DIR"
    )
    dra_plugin_path: str = text(
        "", "directory of dra.sock (DRA mode)", shown="/var/lib/kubelet/plugins/<driver name>", metavar="DIR"
    )
    cdi_root: str = text("/var/run/cdi", "where CDI specs of prepared claims are written (DRA mode)", metavar="DIR")
    sysfs_root: str = text("/sys", "sysfs, where a GPU's PCIe root is read (DRA mode)", metavar="DIR")
    legacy_metrics: bool = switch(
        False,
        "also export gpu-manager 1.x's container_gpu_utilization, container_gpu_memory_total, "
        "container_request_gpu_utilization and container_request_gpu_memory, as it wrote them",
    )
    # Logging (klog's flag names).
    v: int = number(0, "log verbosity; 4 or more logs debug messages")
    log_format: str = choice("text", ("text", "json"), "log line format (json: one JSON object per line)")
    logtostderr: bool = switch(
        True, "log to stderr; with false and --log-dir, log to the file (and --stderrthreshold and above to stderr)"
    )
    alsologtostderr: bool = switch(False, "log to stderr as well when --logtostderr=false")
    stderrthreshold: str = severity(
        "ERROR",
        "with --logtostderr=false, messages of this severity and above go to stderr as well "
        "(INFO, WARNING, ERROR, FATAL or 0-3)",
    )
    vmodule: str = parsed_text(
        "",
        "pattern=N,... : --v for the modules whose file name (without .py) matches the glob pattern",
        parse_vmodule,
        shown="none",
        metavar="PATTERN=N,...",
    )
    log_backtrace_at: str = parsed_text(
        "",
        "file.py:N: a message logged from that line also writes the stack",
        parse_trace_location,
        shown="none",
        metavar="FILE:LINE",
    )
    log_dir: str = text("", "also write gpu-manager.log in this directory (rotated)", shown="none", metavar="DIR")
    log_file_max_size: int = number(
        100, "MiB after which gpu-manager.log is rotated (3 older files are kept)", metavar="MIB"
    )
    node_name: str = field(default="", compare=False)

    @property
    def dra_socket_dir(self) -> Path:
        """Directory of dra.sock: --dra-plugin-path, else /var/lib/kubelet/plugins/<driver name>."""
        return Path(self.dra_plugin_path or f"/var/lib/kubelet/plugins/{self.dra_driver_name}")

    @property
    def gpu_client_path(self) -> Path:
        """--gpu-client, else ``gpu-client`` in the directory of --vcuda-library."""
        return Path(self.gpu_client) if self.gpu_client else Path(self.vcuda_library).parent / "gpu-client"

    @property
    def kubelet_socket(self) -> Path:
        """Path of the kubelet's Registration socket."""
        return Path(self.device_plugin_path) / names.KUBELET_SOCKET

    def _check_gpu_client(self) -> None:
        """--gpu-client names a regular file (a name the kernel refuses, too long say, is named as such)."""
        try:
            st = os.stat(self.gpu_client)
        except OSError as exc:
            reason = "no such file" if exc.errno == errno.ENOENT else exc.strerror or str(exc)
            raise ConfigError(f"--gpu-client={self.gpu_client}: {reason}") from None
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"--gpu-client={self.gpu_client}: not a regular file")

    def validate(self) -> Config:
        """Check every value; raise ConfigError naming the flag and the value. Returns self."""
        if self.driver != "nvidia":
            raise ConfigError(f"--driver={self.driver!r}: only 'nvidia' is supported")
        if not 0 <= self.query_port <= 65535:
            raise ConfigError(f"--query-port={self.query_port}: must be between 0 and 65535")
        for flag, value in (
            ("--sample-period", self.sample_period),
            ("--allocation-check-period", self.allocation_check_period),
        ):
            if not 0 < value <= flagspec.MAX_SECONDS:
                raise ConfigError(
                    f"{flag}={value}: must be a positive number of seconds, at most {flagspec.MAX_SECONDS} "
                    "(Go's longest duration)"
                )
        for flag, fvalue in (
            ("--health-quiet-period", self.health_quiet_period),
            ("--health-probe-period", self.health_probe_period),
            ("--kubelet-watch-period", self.kubelet_watch_period),
            ("--wait-timeout", self.wait_timeout),
            ("--runtime-request-timeout", self.runtime_request_timeout),
        ):
            if fvalue < 0 or (flag != "--health-quiet-period" and fvalue == 0):
                raise ConfigError(f"{flag}={fvalue}: must be a positive number of seconds")
        if self.replaced_gpu_wait < 0:
            raise ConfigError(
                f"--replaced-gpu-wait={self.replaced_gpu_wait:g}s: must not be negative"
                " (0: a start without room on a replacement is refused for good at once)"
            )
        for flag, fvalue in (
            ("--health-probe-period", self.health_probe_period),
            ("--kubelet-watch-period", self.kubelet_watch_period),
        ):
            if fvalue < MIN_PERIOD:  # shorter, the agent does little but wake up (1ns: a third of a CPU)
                raise ConfigError(f"{flag}={fvalue:g}: must be at least 10ms (0.01 seconds)")
        if self.log_file_max_size <= 0:
            raise ConfigError(f"--log-file-max-size={self.log_file_max_size}: must be a positive number of MiB")
        if self.cgroup_driver not in ("cgroupfs", "systemd"):
            raise ConfigError(f"--cgroup-driver={self.cgroup_driver!r}: must be 'cgroupfs' or 'systemd'")
        if not self.device_plugin_path:
            raise ConfigError("--device-plugin-path: must not be empty")
        # gRPC binds and dials unix sockets by absolute path only.
        # The pod directories are mount sources the kubelet must find, the checkpoint must outlive the
        # agent's working directory: both are host paths, absolute.
        for flag, path_value in (
            ("--device-plugin-path", self.device_plugin_path),
            ("--display-socket", self.display_socket),
            ("--pod-resources-socket", self.pod_resources_socket),
            ("--checkpoint-path", self.checkpoint_path),
            ("--virtual-manager-path", self.virtual_manager_path),
        ):
            if not Path(path_value).is_absolute():
                raise ConfigError(f"{flag}={path_value}: must be an absolute path")
        if self.mode == "dra":
            # Other processes find these by path: the kubelet's plugin watcher the registration socket, the
            # kubelet dials dra.sock at the endpoint the registration names, the container runtime reads
            # the CDI specs. A relative path is the agent's working directory's, which neither of them shares.
            for flag, path_value in (
                ("--plugin-registry-path", self.plugin_registry_path),
                ("--dra-plugin-path", str(self.dra_socket_dir)),
                ("--cdi-root", self.cdi_root),
            ):
                if not Path(path_value).is_absolute():
                    raise ConfigError(f"{flag}={path_value}: must be an absolute path (DRA mode)")
        try:
            socket.getaddrinfo(
                self.query_addr or None, self.query_port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )
        except (OSError, UnicodeError) as exc:
            raise ConfigError(f"--query-addr={self.query_addr!r}: not an address to listen on ({exc})") from None
        for x in self.ignored_xids:
            if x < 0:
                raise ConfigError(f"--ignored-xids: {x} is not a valid XID")
        parse_node_labels(self.node_labels)
        if self.gpu_client:
            self._check_gpu_client()
        if not _DNS_SUBDOMAIN.match(self.dra_driver_name) or len(self.dra_driver_name) > 63:
            raise ConfigError(
                f"--dra-driver-name={self.dra_driver_name!r}: must be a DNS subdomain of at most 63 characters "
                "(lower-case letters, digits, '-' and '.')"
            )
        self._check_node_name()
        if self.mode == "dra" and not self.dra_driver_name[:1].isalpha():
            raise ConfigError(
                f"--dra-driver-name={self.dra_driver_name!r}: must start with a letter (it is the vendor of the "
                "CDI devices, <driver>/gpu=<device>, and CDI refuses a vendor that starts otherwise)"
            )
        # sun_path is 108 bytes including the terminating NUL.
        for flag, path in (
            ("--device-plugin-path", str(Path(self.device_plugin_path) / names.VMEMORY_SOCKET)),
            ("--display-socket", self.display_socket),
            *(
                (
                    (
                        "--plugin-registry-path",
                        str(Path(self.plugin_registry_path) / f"{self.dra_driver_name}-reg.sock"),
                    ),
                    ("--dra-plugin-path", str(self.dra_socket_dir / "dra.sock")),
                )
                if self.mode == "dra"
                else ()
            ),
        ):
            if len(path.encode()) >= 108:
                raise ConfigError(f"{flag}: socket path {path!r} is longer than the 107 bytes a unix socket allows")
        if self.mode != "dra":  # DRA claims' directories hold no socket
            # Each pod's <vm>/<pod uid>/vcuda.sock: one it cannot be served on, upstream's library (which
            # cannot register) kills every process of the pod.
            longest = str(Path(self.virtual_manager_path) / ("x" * POD_UID_LENGTH) / names.VCUDA_SOCKET)
            if len(os.fsencode(longest)) >= 108:
                shown = str(Path(self.virtual_manager_path) / "<pod uid>" / names.VCUDA_SOCKET)
                raise ConfigError(
                    f"--virtual-manager-path={self.virtual_manager_path}: each pod's socket {shown} needs "
                    f"{len(os.fsencode(longest)) + 1} bytes with a {POD_UID_LENGTH}-character pod UID, more than "
                    "the 108 (with the terminating NUL) a unix socket path holds"
                )
        return self

    def _check_node_name(self) -> None:
        """The node name must be one a Node can have: with another the agent watches no pod, ever."""
        name = self.resolved_node_name()
        if len(name) <= 253 and _DNS_SUBDOMAIN.match(name):
            return
        if self.hostname_override.strip():
            source = f"--hostname-override={self.hostname_override!r}"
        elif self.node_name.strip():
            source = f"$NODE_NAME={self.node_name!r}"
        else:
            source = f"the host name {socket.gethostname()!r} (set --hostname-override)"
        raise ConfigError(
            f"{source}: {name!r} is not a node name: a DNS subdomain (lower-case letters, digits, '-' and '.') "
            "of at most 253 characters, as `kubectl get nodes` shows it"
        )

    def resolved_node_name(self) -> str:
        """The node name: --hostname-override, else NODE_NAME (filled in by the CLI), else the host name;
        trimmed and in lower case, as the kubelet names its node from the same two."""
        name = self.hostname_override.strip() or self.node_name.strip() or socket.gethostname().strip()
        return name.lower()


#: The name part of a label key and a label value (Kubernetes' qualified name, at most 63 characters).
_LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]\Z")
#: The label whose value is replaced by the GPU's model (what the flag gives there is never sent).
_GPU_MODEL_LABEL = "gaia.tencent.com/gpu-model"


def _label_key_problem(key: str) -> str:
    """Why the API server would refuse ``key`` as a label key ('' when it would not)."""
    prefix, slash, name = key.rpartition("/")
    if slash and (not prefix or len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix)):
        return "its prefix must be a DNS subdomain (lower-case letters, digits, '-' and '.') of at most 253 characters"
    if len(name) > 63 or not _LABEL_NAME.match(name):
        return (
            "its name must be at most 63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit"
        )
    return ""


def parse_node_labels(text: str) -> dict[str, str]:
    """Parse ``k=v,k2=v2`` as gpu-manager's --node-labels; raise ConfigError on a malformed pair or a key
    or value the API server would refuse as a label (said at start, not as a 422 once serving)."""
    labels: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--node-labels: {item!r} is not of the form key=value")
        problem = _label_key_problem(key)
        if problem:
            raise ConfigError(f"--node-labels: {key!r} is not a label key: {problem}")
        if key != _GPU_MODEL_LABEL and value and (len(value) > 63 or not _LABEL_NAME.match(value)):
            raise ConfigError(
                f"--node-labels: {value!r} (of {key}) is not a label value: at most 63 letters, digits, '-', '_' "
                "or '.', starting and ending with a letter or digit"
            )
        labels[key] = value
    return labels
