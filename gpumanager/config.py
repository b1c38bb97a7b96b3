"""The agent's configuration: one frozen dataclass built from the command line, and its validation."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from pathlib import Path

from gpumanager import names


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the flag and the value."""


@dataclass(frozen=True)
class Config:
    """Everything the agent needs to know at start-up.

    Field names follow gpu-manager v1.1's flags (``--device-plugin-path`` is
    ``device_plugin_path``); durations are seconds.
    """

    driver: str = "nvidia"
    extra_config: str = ""
    volume_config: str = ""
    query_port: int = 5678
    query_addr: str = "localhost"
    kubeconfig: str = ""
    sample_period: int = 1
    node_labels: str = ""
    hostname_override: str = ""
    virtual_manager_path: str = names.DEFAULT_VIRTUAL_MANAGER_PATH
    device_plugin_path: str = names.DEFAULT_DEVICE_PLUGIN_PATH
    checkpoint_path: str = names.DEFAULT_CHECKPOINT_PATH
    share_mode: bool = False
    allocation_check_period: int = 30
    container_runtime_endpoint: str = "/var/run/dockershim.sock"
    cgroup_driver: str = "cgroupfs"
    runtime_request_timeout: float = 5.0
    wait_timeout: float = 60.0
    # Beyond upstream.
    display_socket: str = names.DEFAULT_DISPLAY_SOCKET
    pod_resources_socket: str = names.DEFAULT_POD_RESOURCES_SOCKET
    nvml_lib: str = ""
    cgroup_root: str = "/sys/fs/cgroup"
    driver_root: str = "/"
    vcuda_library: str = "/usr/local/lib/gpu-manager/libcuda-control.so"
    ignored_xids: tuple[int, ...] = names.DEFAULT_IGNORED_XIDS
    health_quiet_period: float = 300.0
    health_probe_period: float = 1.0
    kubelet_watch_period: float = 0.1
    node_name: str = field(default="", compare=False)

    @property
    def kubelet_socket(self) -> Path:
        """Path of the kubelet's Registration socket."""
        return Path(self.device_plugin_path) / names.KUBELET_SOCKET

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
            if value <= 0:
                raise ConfigError(f"{flag}={value}: must be a positive number of seconds")
        for flag, fvalue in (
            ("--health-quiet-period", self.health_quiet_period),
            ("--health-probe-period", self.health_probe_period),
            ("--kubelet-watch-period", self.kubelet_watch_period),
            ("--wait-timeout", self.wait_timeout),
            ("--runtime-request-timeout", self.runtime_request_timeout),
        ):
            if fvalue < 0 or (flag != "--health-quiet-period" and fvalue == 0):
                raise ConfigError(f"{flag}={fvalue}: must be a positive number of seconds")
        if self.cgroup_driver not in ("cgroupfs", "systemd"):
            raise ConfigError(f"--cgroup-driver={self.cgroup_driver!r}: must be 'cgroupfs' or 'systemd'")
        if not self.device_plugin_path:
            raise ConfigError("--device-plugin-path: must not be empty")
        for x in self.ignored_xids:
            if x < 0:
                raise ConfigError(f"--ignored-xids: {x} is not a valid XID")
        parse_node_labels(self.node_labels)
        # sun_path is 108 bytes including the terminating NUL.
        for flag, path in (
            ("--device-plugin-path", str(Path(self.device_plugin_path) / names.VMEMORY_SOCKET)),
            ("--display-socket", self.display_socket),
        ):
            if len(path.encode()) >= 108:
                raise ConfigError(f"{flag}: socket path {path!r} is longer than the 107 bytes a unix socket allows")
        return self

    def resolved_node_name(self) -> str:
        """The node name: --hostname-override, else NODE_NAME (filled in by the CLI), else the host name."""
        return self.hostname_override or self.node_name or socket.gethostname()


def parse_node_labels(text: str) -> dict[str, str]:
    """Parse ``k=v,k2=v2`` as gpu-manager's --node-labels; raise ConfigError on a malformed pair."""
    labels: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--node-labels: {item!r} is not of the form key=value")
        labels[key] = value
    return labels
