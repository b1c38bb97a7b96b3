"""The chart's host mounts follow every flag in `flags` that moves a host path the agent opens, and
mount nothing wider or more writable than the agent needs."""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest

from tests.test_rbac_review import RENDER
from tests.test_rbac_review_mounts import _check, _common, _config, _daemonset, _mounts

JSON = dict[str, Any]
HOST_ROOT = "/usr/local/host"


def _render(flags: JSON, **values: Any) -> tuple[JSON, Any]:
    ds = _daemonset(RENDER["documents"]({"flags": flags, **values}))
    for version in ("1.30.0", "1.37.0"):
        kubernetes_validate.validate(ds, version, strict=True)
    (container,) = ds["spec"]["template"]["spec"]["containers"]
    return ds, _config(container)


def _host_paths(ds: JSON) -> list[str]:
    return [v["hostPath"]["path"] for v in ds["spec"]["template"]["spec"]["volumes"] if "hostPath" in v]


def _mount_of(ds: JSON, path: str) -> JSON:
    (container,) = ds["spec"]["template"]["spec"]["containers"]
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"].rstrip("/") == path]
    return dict(mount)


def test_a_moved_display_socket_is_served_on_the_host() -> None:
    # outside /var/run the socket was made in the container, where no host client finds it
    ds, cfg = _render({"display-socket": "/run/gpu-manager/gpu-manager.sock"})
    assert cfg.display_socket == "/run/gpu-manager/gpu-manager.sock"
    _check(ds, cfg, {**_common(cfg), "--display-socket": (cfg.display_socket, True, True)})
    # and only its directory: no /var/run left mounted that nothing uses
    assert "/var/run" not in _mounts(ds)


@pytest.mark.parametrize("values", [{}, {"logDir": "/var/log/other"}])
def test_a_log_dir_set_in_flags_is_mounted(values: JSON) -> None:
    # flags come last on the command line, so their --log-dir is the one the agent writes in
    ds, cfg = _render({"log-dir": "/var/log/gpu-manager"}, **values)
    assert cfg.log_dir == "/var/log/gpu-manager"
    _check(ds, cfg, {**_common(cfg), "--log-dir": (cfg.log_dir, True, True)})
    assert "/var/log/other" not in _host_paths(ds)


def _no_mount_inside_the_host_root(ds: JSON) -> None:
    # a path under the host's / (mounted at HOST_ROOT) is read there: no host path of that name exists
    assert not [p for p in _host_paths(ds) if PurePosixPath(p).is_relative_to(HOST_ROOT)], _host_paths(ds)


def test_a_moved_cgroup_root_is_the_hosts_read_only() -> None:
    ds, cfg = _render({"cgroup-root": "/host/sys/fs/cgroup"})
    assert cfg.cgroup_root == "/host/sys/fs/cgroup"
    _check(ds, cfg, {**_common(cfg), "--cgroup-root": (cfg.cgroup_root, False, True)})
    assert _mounts(ds)["/host/sys/fs/cgroup"] == ("/host/sys/fs/cgroup", True)
    assert "/sys/fs/cgroup" not in _mounts(ds)  # nothing else reads it


def test_a_cgroup_root_under_the_host_root_needs_no_mount_of_its_own() -> None:
    ds, cfg = _render({"cgroup-root": f"{HOST_ROOT}/sys/fs/cgroup"})
    _check(ds, cfg, _common(cfg))
    _no_mount_inside_the_host_root(ds)
    assert "/sys/fs/cgroup" not in _mounts(ds)


def test_a_moved_driver_root_is_the_hosts_read_only_with_its_mounts() -> None:
    # the GPU Operator's driver container mounts its root at /run/nvidia/driver on the host
    ds, cfg = _render({"driver-root": "/run/nvidia/driver"})
    assert cfg.driver_root == "/run/nvidia/driver"
    _check(ds, cfg, _common(cfg))
    assert _mounts(ds)["/run/nvidia/driver"] == ("/run/nvidia/driver", True)
    assert _mount_of(ds, "/run/nvidia/driver").get("mountPropagation") == "HostToContainer"
    assert HOST_ROOT not in _mounts(ds)  # nothing else is read through the host's /


def test_a_driver_root_under_the_host_root_needs_no_mount_of_its_own() -> None:
    ds, cfg = _render({"driver-root": f"{HOST_ROOT}/run/nvidia/driver"})
    _check(ds, cfg, _common(cfg))
    _no_mount_inside_the_host_root(ds)


def test_a_moved_proc_root_is_mounted_read_only() -> None:
    ds, cfg = _render({"proc-root": "/host/proc"})
    assert cfg.proc_root == "/host/proc"
    _check(ds, cfg, {**_common(cfg), "--proc-root": (cfg.proc_root, False, True)})
    assert _mounts(ds)["/host/proc"] == ("/host/proc", True)


def test_the_default_proc_root_is_the_host_pid_namespaces_own() -> None:
    ds, cfg = _render({})
    assert cfg.proc_root == "/proc" and ds["spec"]["template"]["spec"]["hostPID"] is True
    assert "/proc" not in _mounts(ds)
    ds, cfg = _render({"proc-root": f"{HOST_ROOT}/proc"})
    _no_mount_inside_the_host_root(ds)
    # the host's / stays mounted while /proc is read through it, the driver being elsewhere
    ds, cfg = _render({"proc-root": f"{HOST_ROOT}/proc", "driver-root": "/run/nvidia/driver"})
    assert _mounts(ds)[HOST_ROOT] == ("/", True)


@pytest.mark.parametrize("flags", [{}, {"pod-resources-socket": "/var/lib/k8s/kubelet/pod-resources/kubelet.sock"}])
def test_the_pod_resources_directory_is_read_only(flags: JSON) -> None:
    # the agent only connects to the kubelet's socket there; connect(2) needs no writable mount
    ds, cfg = _render(flags)
    found = _mounts(ds)[str(PurePosixPath(cfg.pod_resources_socket).parent)]
    assert found == (str(PurePosixPath(cfg.pod_resources_socket).parent), True)


@pytest.mark.parametrize(
    "flags",
    [
        {"display-socket": "/var/lib/kubelet/device-plugins/gpu-manager.sock"},
        {"log-dir": "/etc/gpu-manager/checkpoint/"},
        {"cgroup-root": "/var/run"},
    ],
)
def test_two_mounts_at_one_path_are_refused_by_name(flags: JSON) -> None:
    # the API server rejects a pod with two mounts at one path only at apply time, naming neither flag
    with pytest.raises(Exception, match=r"flags: .* both need a mount at /"):
        RENDER["documents"]({"flags": flags})
