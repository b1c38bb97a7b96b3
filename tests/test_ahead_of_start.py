"""A pending GPU pod's directories, spare vcuda.config and vcuda.sock are made when the watch shows it,
before the kubelet starts it; PreStartContainer then creates no file, and nothing made ahead outlives
the pod."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpumanager import names
from gpumanager.allocation.records import ContainerAllocation
from gpumanager.vmanager import files
from gpumanager.vmanager.ahead import AheadOfStart
from gpumanager.vmanager.manager import VirtualManager
from tests.alloc_fixtures import make_pod, uid_of


@pytest.fixture
def vm(tmp_path: Path) -> Iterator[VirtualManager]:
    vm_path = Path(tempfile.mkdtemp(prefix="gm-vm-"))  # short: <vm>/<uid>/vcuda.sock < 108 bytes
    manager = VirtualManager(
        vm_path=vm_path,
        cgroup_root=tmp_path / "cgroup",
        allocation=lambda uid, name: None,
        pod=lambda uid: None,
        driver_version="550.54.15",
    )
    try:
        yield manager
    finally:
        manager.stop()
        shutil.rmtree(vm_path, ignore_errors=True)


def with_init(pod: dict[str, Any], name: str, cores: int, blocks: int) -> dict[str, Any]:
    limits = {names.VCORE_RESOURCE: str(cores), names.VMEMORY_RESOURCE: str(blocks)}
    pod["spec"]["initContainers"] = [{"name": name, "resources": {"limits": limits, "requests": limits}}]
    return pod


def drained(ahead: AheadOfStart, count: int, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while ahead.prepared < count and time.monotonic() < deadline:
        time.sleep(0.005)
    assert ahead.prepared == count


def test_a_pending_gpu_pod_is_prepared_before_its_start(vm: VirtualManager) -> None:
    pod = with_init(make_pod("a", [("main", 30, 4), ("sidecar", 0, 0), ("whole", 100, 0)]), "setup", 10, 1)
    ahead = AheadOfStart(vm.prepare_ahead)
    ahead.start()
    try:
        ahead.on_pod_event("ADDED", pod)
        ahead.on_pod_event("MODIFIED", pod)  # queued once
        drained(ahead, 1)
    finally:
        ahead.stop()
    directory = vm.pod_dir(uid_of("a"))
    assert sorted(p.name for p in directory.iterdir()) == ["main", "setup", names.VCUDA_SOCKET, "whole"]
    for container in ("main", "setup", "whole"):
        # In the container's own directory (mounted at /etc/vcuda/<container>), not in its mount point.
        assert files.spare_path(vm.own_dir(uid_of("a"), container) / names.VCUDA_CONFIG_FILE).stat().st_size == 0
        assert list((directory / container).iterdir()) == []
    assert vm.serving() == [uid_of("a")]
    with socket.socket(socket.AF_UNIX) as client:
        client.connect(str(directory / names.VCUDA_SOCKET))  # listening already


def test_prestart_fills_the_spare_and_creates_no_file(vm: VirtualManager) -> None:
    uid = uid_of("a")
    vm.prepare_ahead(uid, ["main"])
    config = vm.own_dir(uid, "main") / names.VCUDA_CONFIG_FILE
    spare_inode = files.spare_path(config).stat().st_ino
    vm.prepare(ContainerAllocation(uid, "main", (0,), 30, 4 << 28))
    assert config.stat().st_ino == spare_inode, "the spare became the vcuda.config"
    assert not files.spare_path(config).exists()
    assert oct(config.stat().st_mode & 0o777) == oct(0o644)
    assert files.unpack(config.read_bytes()).utilization == 30
    # Prepared again (a restarted container) with the same values: the file is left as it is.
    vm.prepare(ContainerAllocation(uid, "main", (0,), 30, 4 << 28))
    assert config.stat().st_ino == spare_inode
    # With other values: no spare now, the temp-file way.
    vm.prepare(ContainerAllocation(uid, "main", (0,), 40, 4 << 28))
    assert config.stat().st_ino != spare_inode
    assert files.unpack(config.read_bytes()).utilization == 40
    assert sorted(p.name for p in config.parent.iterdir()) == [names.VCUDA_CONFIG_FILE]


def test_a_spare_that_is_not_a_plain_file_of_ours_is_never_written_through(tmp_path: Path) -> None:
    """A symlink, a second name of another file or a FIFO in the spare's place: the file behind it is
    left as it was (only that name goes), and the config is written the temp-file way, at once."""
    config = tmp_path / "main" / names.VCUDA_CONFIG_FILE
    config.parent.mkdir()
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    plants: list[Callable[[Path], None]] = [
        lambda spare: spare.symlink_to(victim),
        lambda spare: os.link(victim, spare),
        lambda spare: os.mkfifo(spare),  # no reader: opening it to write must not wait for one
    ]
    for utilization, plant in enumerate(plants, start=30):
        plant(files.spare_path(config))
        # Other values each time: a config that holds them already is not written at all.
        values = files.VcudaConfig(
            pod_uid=uid_of("a"), container_name="main", gpu_memory=1 << 28, utilization=utilization
        )
        files.write_config(config, values)
        assert victim.read_bytes() == b"keep"
        assert files.unpack(config.read_bytes()).utilization == utilization
        assert sorted(p.name for p in config.parent.iterdir()) == [names.VCUDA_CONFIG_FILE]
    os.mkfifo(files.spare_path(config))
    files.make_spare(config)  # something is there already: left as it is, and no wait on the FIFO
    assert stat.S_ISFIFO(files.spare_path(config).lstat().st_mode)


def test_two_writers_never_share_a_spare(tmp_path: Path) -> None:
    """Whoever takes the spare first fills it; the other writes the temp-file way. A reader sees a whole
    vcuda.config at every moment (the second writer never truncates the first one's file in place)."""
    config = tmp_path / "main" / names.VCUDA_CONFIG_FILE
    config.parent.mkdir()
    # Each round other values than the last (a config that holds them already is not written at all).
    rounds = [
        files.VcudaConfig(pod_uid=uid_of("a"), container_name="main", gpu_memory=1 << 28, utilization=u)
        for u in (30, 31)
    ]
    files.write_config(config, rounds[1])
    stop = threading.Event()
    sizes: set[int] = set()

    def read() -> None:
        while not stop.is_set():
            with contextlib.suppress(FileNotFoundError):
                sizes.add(len(config.read_bytes()))

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(300):
            files.make_spare(config)
            values = rounds[i % 2]
            writers = [threading.Thread(target=files.write_config, args=(config, values)) for _ in range(2)]
            for w in writers:
                w.start()
            for w in writers:
                w.join()
    finally:
        stop.set()
        reader.join()
    assert sizes == {files.CONFIG_SIZE}
    assert sorted(p.name for p in config.parent.iterdir()) == [names.VCUDA_CONFIG_FILE]


@pytest.mark.parametrize(
    ("kind", "pod"),
    [
        ("ADDED", make_pod("running", [("main", 30, 4)], phase="Running")),
        ("ADDED", make_pod("no-gpu", [("main", 0, 0)])),
        ("ADDED", make_pod("done", [("main", 30, 4)], phase="Succeeded")),
        ("DELETED", make_pod("deleted", [("main", 30, 4)])),
        ("ADDED", {"metadata": {"name": "no-uid"}, "spec": {"containers": []}}),
    ],
    ids=["running", "no-gpu", "ended", "deleted", "no-uid"],
)
def test_only_pending_gpu_pods_are_prepared(vm: VirtualManager, kind: str, pod: dict[str, Any]) -> None:
    made: list[str] = []
    ahead = AheadOfStart(lambda uid, containers: made.append(uid))
    ahead.on_pod_event(kind, pod)
    ahead.on_pod_event("ADDED", make_pod("last", [("main", 30, 4)]))  # taken after the one above
    ahead.start()
    drained(ahead, 1)
    ahead.stop()
    assert made == [uid_of("last")]


def test_a_pod_deleted_before_its_turn_is_not_prepared() -> None:
    made: list[str] = []
    ahead = AheadOfStart(lambda uid, containers: made.append(uid))
    pod = make_pod("a", [("main", 30, 4)])
    ahead.on_pod_event("ADDED", pod)
    ahead.on_pod_event("DELETED", pod)
    ahead.on_pod_event("ADDED", make_pod("b", [("main", 30, 4)]))
    ahead.start()
    drained(ahead, 1)
    ahead.stop()
    assert made == [uid_of("b")]


def test_a_pod_deleted_while_it_is_prepared_has_its_directory_removed_again() -> None:
    started, go = threading.Event(), threading.Event()
    made: list[str] = []
    removed: list[str] = []

    def prepare(uid: str, containers: Any) -> None:
        started.set()
        assert go.wait(5)
        made.append(uid)

    ahead = AheadOfStart(prepare, gone=removed.append)
    ahead.start()
    pod = make_pod("a", [("main", 30, 4)])
    ahead.on_pod_event("ADDED", pod)
    assert started.wait(5)
    ahead.on_pod_event("DELETED", pod)  # the allocation check found no directory to remove yet
    go.set()
    ahead.on_pod_event("ADDED", make_pod("b", [("main", 30, 4)]))
    deadline = time.monotonic() + 5
    while len(made) < 2 and time.monotonic() < deadline:
        time.sleep(0.005)
    ahead.stop()
    assert made == [uid_of("a"), uid_of("b")] and removed == [uid_of("a")]


def test_stop_leaves_the_queued_pods_to_prestart() -> None:
    started, go = threading.Event(), threading.Event()
    made: list[str] = []

    def prepare(uid: str, containers: Any) -> None:
        started.set()
        assert go.wait(5)
        made.append(uid)

    ahead = AheadOfStart(prepare)
    ahead.start()
    for i in range(20):
        ahead.on_pod_event("ADDED", make_pod(f"p{i}", [("main", 30, 4)]))
    assert started.wait(5)
    go.set()
    ahead.stop(timeout=5.0)
    assert made == [uid_of("p0")], "the pod in hand is finished, the queued ones are not"


def test_an_unsafe_name_is_reported_and_nothing_is_made_outside(
    vm: VirtualManager, caplog: pytest.LogCaptureFixture
) -> None:
    pod = make_pod("a", [("../escape", 30, 4)])
    ahead = AheadOfStart(vm.prepare_ahead)
    ahead.start()
    with caplog.at_level(logging.WARNING, logger="gpumanager.vmanager.ahead"):
        ahead.on_pod_event("ADDED", pod)
        deadline = time.monotonic() + 5
        while "cannot prepare" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.005)
        ahead.stop(timeout=5.0)
    assert f"cannot prepare the directory of pod default/a ({uid_of('a')}) ahead of its start" in caplog.text
    assert "'../escape'" in caplog.text
    assert "Traceback" not in caplog.text
    assert not (vm.vm_path / "escape").exists()
