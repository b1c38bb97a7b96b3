"""Defects around the virtual manager's files, flags and names: each test fails on the code before its fix."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path
from typing import Any, cast

import pytest

from gpumanager import cli, names
from gpumanager.allocation.pods import Pod
from gpumanager.config import ConfigError
from tests.test_cli_review2 import parse

CLAIM_A = "aaaaaaaa-1111-2222-3333-444444444444"
CLAIM_B = "bbbbbbbb-1111-2222-3333-444444444444"


# -- DRA: a claim's pids.config the refresh cannot write -------------------------------------------


class _Claims:
    """The part of the allocator the DRA mode's pids refresh reads."""

    claims_in_doubt = False

    def __init__(self, claims: list[Any]) -> None:
        self._claims = claims

    def claims(self) -> list[Any]:
        return list(self._claims)


def _dra_mode(tmp_path: Path, claims: list[Any], pods: list[Pod]) -> Any:
    from gpumanager.allocation.allocator import Allocator
    from gpumanager.device.types import NodeTopology
    from gpumanager.dra import cdi
    from gpumanager.dra.mode import DRAMode, DRASettings

    vm = tmp_path / "vm"
    return DRAMode(
        settings=DRASettings(
            driver="gpu.example.com",
            plugin_registry_path=str(tmp_path / "registry"),
            plugin_path=str(tmp_path / "plugin"),
            cdi_root=str(tmp_path / "cdi"),
        ),
        node="node-1",
        gpus=[],
        topology=NodeTopology(levels=()),
        health=None,
        allocator=cast(Allocator, _Claims(claims)),
        api_client=None,
        pods=lambda: pods,
        pod=lambda uid: next((p for p in pods if p["metadata"]["uid"] == uid), None),
        cdi_settings=cdi.CDISettings(
            root=tmp_path / "cdi",
            driver="gpu.example.com",
            vdriver_nvidia=str(tmp_path / "vdriver" / "nvidia"),
            vdriver_origin=str(tmp_path / "vdriver" / "origin"),
            virtual_manager_path=str(vm),
        ),
        vm_path=vm,
        cgroup_root=tmp_path / "cgroup",
        driver_version="550.54.15",
        observe=lambda _m, _s, _ok: None,
        report=lambda _what, _message: None,
    )


def test_dra_claim_pids_config_that_cannot_be_written_is_reported_once_and_blocks_no_other(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """DRA mode: one claim's pids.config failing to be written (a full disk, a read-only file system)
    must not stop the refresh of the other claims, nor log a traceback at each period; it is reported
    once (file, claim, reason) until a write works."""
    from gpumanager.allocation.claims import ClaimAllocation, ClaimDevice
    from gpumanager.vmanager import files
    from gpumanager.vmanager.refresh import ClaimPidsRefresher

    claims: list[ClaimAllocation] = []
    pods: list[Pod] = []
    for n, uid in enumerate((CLAIM_A, CLAIM_B)):
        name = f"claim-{n}"
        device = ClaimDevice(
            request="gpu",
            pool="node-1",
            device="gpu-0",
            minor=0,
            share_id=f"s-{n}",
            cores=20,
            memory=1 << 30,
            whole=False,
        )
        claims.append(ClaimAllocation(uid=uid, namespace="default", name=name, devices=(device,)))
        pod_uid = f"{n}2345678-1234-1234-1234-123456789abc"
        cid = f"{n}c" * 32
        cgroup = tmp_path / "cgroup" / "kubepods" / f"pod{pod_uid}" / cid
        cgroup.mkdir(parents=True)
        (cgroup / "cgroup.procs").write_text(f"{os.getpid()}\n")
        pods.append(
            {
                "metadata": {"uid": pod_uid, "name": f"p-{n}", "namespace": "default"},
                "spec": {
                    "resourceClaims": [{"name": "gpu", "resourceClaimName": name}],
                    "containers": [{"name": "main", "resources": {"claims": [{"name": "gpu"}]}}],
                },
                "status": {
                    "phase": "Running",
                    "containerStatuses": [{"name": "main", "containerID": f"containerd://{cid}"}],
                },
            }
        )
        (tmp_path / "vm" / uid).mkdir(parents=True)
    mode = _dra_mode(tmp_path, claims, pods)
    real = files.write_pids
    broken = tmp_path / "vm" / CLAIM_A / names.PIDS_CONFIG_FILE
    failing = {"errno": errno.ENOSPC}

    def write_pids(path: Path, pids: list[int], **kwargs: bool) -> list[int]:
        if path == broken and failing["errno"]:
            raise OSError(failing["errno"], os.strerror(failing["errno"]), str(path))
        return real(path, pids, **kwargs)

    monkeypatch.setattr(files, "write_pids", write_pids)
    refresher = ClaimPidsRefresher(mode.refresh_pids)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            refresher._refresh()
        assert files.read_pids(tmp_path / "vm" / CLAIM_B / names.PIDS_CONFIG_FILE) == [os.getpid()]
        reports = [r for r in caplog.records if str(broken) in r.getMessage()]
        assert len(reports) == 1, [r.getMessage() for r in caplog.records]
        message = reports[0].getMessage()
        assert "No space left on device" in message and "default/claim-0" in message
        assert "main" in message
        assert reports[0].exc_info is None
        # Another reason is reported again; once a write works, the file is current.
        failing["errno"] = errno.EROFS
        refresher._refresh()
        assert len([r for r in caplog.records if str(broken) in r.getMessage()]) == 2
        failing["errno"] = 0
        refresher._refresh()
    assert files.read_pids(broken) == [os.getpid()]


# -- a --virtual-manager-path too long for the pods' vcuda.sock ------------------------------------


def _vm_path(length: int) -> str:
    """An absolute directory path of ``length`` bytes."""
    return "/" + "v" * (length - 1)


# <vm>/<36-character pod uid>/vcuda.sock: 1 + 36 + 1 + 10 bytes after <vm>, at most 107 in all.
LONGEST_VM_PATH = 107 - (1 + 36 + 1 + len("vcuda.sock"))


def test_a_virtual_manager_path_too_long_for_vcuda_sock_is_refused_at_start(
    capfd: pytest.CaptureFixture[str], clean_logging: None
) -> None:
    """Each pod's vcuda.sock is <--virtual-manager-path>/<pod uid>/vcuda.sock: a path longer than a unix
    socket allows cannot be served, and upstream's library, unable to register, kills the pod's
    processes. Such a flag is refused at start (exit 2) naming the flag, its value and the length."""
    value = _vm_path(LONGEST_VM_PATH + 1)
    with pytest.raises(ConfigError) as exc:
        parse(f"--virtual-manager-path={value}")
    message = str(exc.value)
    assert f"--virtual-manager-path={value}" in message and "\n" not in message
    assert "108" in message and "vcuda.sock" in message
    assert cli.main([f"--virtual-manager-path={value}"]) == cli.EXIT_CONFIG
    err = capfd.readouterr().err
    assert f"--virtual-manager-path={value}" in err


def test_the_longest_virtual_manager_path_for_vcuda_sock_is_accepted() -> None:
    value = _vm_path(LONGEST_VM_PATH)
    assert len(f"{value}/{'0' * 36}/vcuda.sock".encode()) == 107
    assert parse(f"--virtual-manager-path={value}").virtual_manager_path == value
    # A trailing '/' adds nothing to the sockets' paths.
    assert parse(f"--virtual-manager-path={value}/").virtual_manager_path == value + "/"


def test_dra_mode_serves_no_vcuda_sock_so_a_long_virtual_manager_path_is_accepted() -> None:
    """DRA claims' directories hold only vcuda.config and pids.config (no socket is served there)."""
    value = _vm_path(LONGEST_VM_PATH + 20)
    assert parse("--mode=dra", f"--virtual-manager-path={value}").virtual_manager_path == value


# -- names with a trailing newline -----------------------------------------------------------------

UID = "12345678-1234-1234-1234-123456789abc"


@pytest.mark.parametrize(
    ("check", "value"),
    [
        ("pod_uid", UID + "\n"),
        ("container_name", "main\n"),
        ("container_id", "a4" * 32 + "\n"),
    ],
)
def test_a_name_with_a_trailing_newline_is_not_safe(check: str, value: str) -> None:
    """``$`` also matches before a final newline: "main\\n" passed as a DNS label, and a UUID followed by
    a newline as a pod UID, so a directory named with a newline could be made under the pod's."""
    from gpumanager import safenames

    with pytest.raises(safenames.UnsafeNameError):
        getattr(safenames, check)(value)
    assert getattr(safenames, check)(value[:-1]) == value[:-1]


def test_a_pod_uid_with_a_trailing_newline_makes_no_directory(tmp_path: Path) -> None:
    from gpumanager.vmanager.manager import VirtualManager

    vm = tmp_path / "vm"
    vm.mkdir()
    manager = VirtualManager(
        vm_path=vm,
        cgroup_root=tmp_path / "cgroup",
        allocation=lambda _pod, _container: None,
        pod=lambda _uid: None,
        driver_version="550.54.15",
    )
    with pytest.raises(ValueError, match="not a UUID"):
        manager.prepare_ahead(UID + "\n", ["main"])
    with pytest.raises(ValueError, match="DNS label"):
        manager.prepare_ahead(UID, ["main\n"])
    assert [p.name for p in vm.rglob("*") if p.name != UID] == []


# -- tencent.com/vcuda-core-limit read as Go's strconv.Atoi reads it -------------------------------


def _limited_pod(value: str) -> Pod:
    return {
        "metadata": {
            "uid": UID,
            "name": "limited",
            "namespace": "default",
            "annotations": {"tencent.com/vcuda-core-limit": value},
        },
        "spec": {"containers": [{"name": "main"}]},
    }


@pytest.mark.parametrize(
    "value",
    [" 30", "30 ", "\t30\n", "3_0", "\uff13\uff10", "\u0663\u0660", "", "+", "-", "0x1e", "30.0", "9" * 20, "+-3"],
)
def test_a_core_limit_atoi_refuses_is_refused_naming_pod_annotation_and_value(
    value: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """upstream reads the annotation with strconv.Atoi: no spaces, no '_', ASCII digits only, within
    int64. Python's int() took " 30", "3_0" and other scripts' digits, so such a pod got a soft limit
    that gpu-manager would not give it."""
    from gpumanager.allocation import pods as podinfo
    from gpumanager.allocation.pods import PodSpecError
    from gpumanager.allocation.records import ContainerAllocation
    from gpumanager.vmanager.manager import VirtualManager

    pod = _limited_pod(value)
    with pytest.raises(PodSpecError) as exc:
        podinfo.core_limit(pod)
    message = str(exc.value)
    assert "default/limited" in message and "tencent.com/vcuda-core-limit" in message and repr(value) in message
    manager = VirtualManager(
        vm_path=tmp_path / "vm",
        cgroup_root=tmp_path / "cgroup",
        allocation=lambda _pod, _container: None,
        pod=lambda uid: pod if uid == UID else None,
        driver_version="550.54.15",
    )
    alloc = ContainerAllocation(pod_uid=UID, container="main", minors=(0,), cores=20, memory=1 << 30)
    with caplog.at_level(logging.WARNING):
        config = manager.config_for(alloc)
    assert (config.limit, config.hard_limit) == (0, 1)
    assert any(repr(value) in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    ("value", "limit"),
    [("30", 30), ("+30", 30), ("007", 7), ("-0", 0), ("0", 0), ("150", 100), (str(2**63 - 1), 100)],
)
def test_a_core_limit_atoi_takes_is_read(value: str, limit: int) -> None:
    from gpumanager.allocation import pods as podinfo

    assert podinfo.core_limit(_limited_pod(value)) == limit


def test_a_negative_core_limit_is_still_refused() -> None:
    from gpumanager.allocation import pods as podinfo
    from gpumanager.allocation.pods import PodSpecError

    with pytest.raises(PodSpecError, match="negative"):
        podinfo.core_limit(_limited_pod("-5"))
