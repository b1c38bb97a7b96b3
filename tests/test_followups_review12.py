"""Follow-ups: the wait for room on a smaller replacement GPU counts from the first refusal across agent
restarts; per-container usage follows a restarted container's new cgroup before its status names it; the
locks on --virtual-manager-path and --dra-plugin-path follow a directory removed and made again."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest

from gpumanager import cli
from gpumanager.allocation.records import ContainerAllocation
from gpumanager.device.types import GPUInfo
from gpumanager.deviceplugin.dirlock import DirectoryLock, lock_holders
from gpumanager.deviceplugin.replaced import ReplacedGPUs, ReplacedRefusal
from gpumanager.dra.plugin import DRAPluginSockets
from simnode.agent_process import AgentProcess
from simnode.gpusim_state import spec_dir
from tests.test_deviceplugin_lock_review12 import _remove, _until
from tests.test_vmanager_restart_review12 import LAYOUTS, SANDBOX, UID, Layout, Node, cid

MIB = 1 << 20
OLD = GPUInfo(0, "GPU-old", "Tesla T4", 0, 16384 * MIB, "00000000:10:00.0", 0)
NEW = GPUInfo(0, "GPU-new", "Tesla T4", 0, 8192 * MIB, "00000000:10:00.0", 0)  # the same device node


class Clock:
    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _held(*pods: str) -> list[ContainerAllocation]:
    return [
        ContainerAllocation(pod, "c", (0,), 40, 6144 * MIB, namespace="default", pod_name=pod, started=True)
        for pod in pods
    ]


def _waiting_guard(state: Path, clock: Clock, held: list[ContainerAllocation], was: GPUInfo) -> ReplacedGPUs:
    guard = ReplacedGPUs({0: was}, [NEW], [], lambda: held, state_path=state, clock=clock, wait_limit=300)
    guard.note_held(held)
    return guard


def test_the_wait_for_room_on_a_replacement_goes_on_across_agent_restarts(tmp_path: Path) -> None:
    state = tmp_path / "gpumanager_replaced_gpus"
    held = _held("a", "b")
    clock = Clock()
    first = _waiting_guard(state, clock, held, OLD)
    assert first.check(held[0])
    first.note_started(held[0])  # a runs on the 8 GiB replacement: 6 GiB of it
    with pytest.raises(ReplacedRefusal) as waits:
        first.check(held[1])
    assert not waits.value.lasting
    saved = json.loads(state.read_text())
    assert saved["waiting"] == [["b", "c", clock.now]], saved
    clock.now += 200
    again = _waiting_guard(state, clock, held, NEW)  # the agent restarted (its inventory saved with NEW)
    with pytest.raises(ReplacedRefusal) as still:
        again.check(held[1])
    assert not still.value.lasting
    clock.now += 101  # 301 s since the first refusal, 101 s since the restart
    with pytest.raises(ReplacedRefusal) as refused:
        again.check(held[1])
    assert refused.value.lasting and "waited 5m1s" in str(refused.value), str(refused.value)


def test_a_start_that_found_room_forgets_its_wait_and_old_files_read_as_before(tmp_path: Path) -> None:
    state = tmp_path / "gpumanager_replaced_gpus"
    held = _held("a", "b")
    clock = Clock()
    first = _waiting_guard(state, clock, held, OLD)
    assert first.check(held[0])
    first.note_started(held[0])
    with pytest.raises(ReplacedRefusal):
        first.check(held[1])
    del held[0]  # a's pod ended: room for b
    assert first.check(held[0])
    first.note_started(held[0])
    assert json.loads(state.read_text())["waiting"] == []
    # A file written before the field existed: the wait starts at this start's first refusal.
    held = _held("a", "b")
    doc = json.loads(state.read_text())
    del doc["waiting"]
    doc["started"] = [["a", "c"]]
    doc["containers"] = [["a", "c"], ["b", "c"]]
    doc["answered"] = [["a", "c", [0]], ["b", "c", [0]]]
    state.write_text(json.dumps(doc))
    clock.now += 1000
    old = _waiting_guard(state, clock, held, NEW)
    with pytest.raises(ReplacedRefusal) as waits:
        old.check(held[1])
    assert not waits.value.lasting
    # A damaged entry is named and the rest of the file kept.
    doc["waiting"] = [["b", "c", "soon"]]
    state.write_text(json.dumps(doc))
    damaged = _waiting_guard(state, clock, held, NEW)
    with pytest.raises(ReplacedRefusal) as waits:
        damaged.check(held[1])
    assert not waits.value.lasting


# -- per-container usage of a restarted container ------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS, ids=[layout.name for layout in LAYOUTS])
def test_usage_of_a_restarted_container_goes_to_it_before_its_status_names_the_new_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: Layout
) -> None:
    """NVML shows the restarted container's new process on its GPU while the status still names the old
    container ID (gone): the usage is the container's, found in its new cgroup as the pids refresh finds it
    (the pod's sandbox cgroup is not taken for it); and still once the status names the new ID."""
    from gpumanager.metrics import usage

    gpu0 = GPUInfo(0, "GPU-0", "Tesla T4", 0, 16384 * MIB, "00000000:10:00.0", 0)
    n = Node(layout, tmp_path / "cgroup", tmp_path / "vm")
    n._make(SANDBOX, [n.next_pid()])
    main = n.start("main", cid("m0"))
    n.start("aux", cid("a0"))
    n.start("side", cid("s0"))
    allocs = [
        ContainerAllocation(UID, name, (0,), 30, 1 << 30, namespace="ns", pod_name="p", started=True)
        for name in ("main", "aux")
    ]
    procs: dict[int, int] = {main: 100 * MIB}
    monkeypatch.setattr(usage, "_sample_gpu", lambda index, since: usage._GPUSample(dict(procs), {}, {}))
    now = [1000.0]
    sampler = usage.UsageSampler(
        gpus=[gpu0],
        allocations=lambda: list(allocs),
        pod=lambda uid: n.pod() if uid == UID else None,
        cgroup_root=n.root,
        sample_period=1.0,
        clock=lambda: now[0],
    )

    def used() -> dict[str, tuple[int, tuple[int, ...]]]:
        return {
            u.container: (u.devices[0].used_bytes, u.devices[0].pids)
            for u in sampler.sample()
            if u.devices[0].used_bytes
        }

    assert used() == {"main": (100 * MIB, (main,))}
    new = n.restart("main", cid("m1"))
    procs.clear()
    procs[new] = 200 * MIB
    now[0] += 1
    assert used() == {"main": (200 * MIB, (new,))}
    n.publish()
    now[0] += 1
    assert used() == {"main": (200 * MIB, (new,))}


# -- the locks on --virtual-manager-path and --dra-plugin-path follow a directory made again ----------


def _second_agent(tmp_path: Path, spec: Path, vm: Path) -> AgentProcess:
    """Another agent with its own checkpoint and device-plugin directories: only the pods' directory
    (--virtual-manager-path) is shared."""
    second = AgentProcess(
        tmp_path,
        spec,
        extra_args=[
            f"--checkpoint-path={tmp_path / 'other-checkpoint'}",
            f"--device-plugin-path={tmp_path / 'other-dp'}",
            f"--display-socket={tmp_path / 'o.sock'}",
            f"--virtual-manager-path={vm}",
        ],
    )
    second.log_path = tmp_path / "second.log"
    return second.start()


def _locked_by(directory: Path, pid: int) -> bool:
    try:
        return pid in lock_holders(os.stat(directory))
    except OSError:
        return False


def test_a_second_agent_started_after_the_pods_directory_was_made_again_waits_for_the_first(tmp_path: Path) -> None:
    spec = spec_dir() / "t4-x1.json"
    first = AgentProcess(tmp_path, spec, extra_args=["--kubelet-watch-period=100ms"]).start()
    second: AgentProcess | None = None
    try:
        first.wait_for_log("serving 1 GPUs", timeout=60)
        vm = first.vm_path
        assert _locked_by(vm, first.pid)
        _remove(vm)
        vm.mkdir(mode=0o755)
        deadline = time.monotonic() + 5
        while not _locked_by(vm, first.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        second = _second_agent(tmp_path, spec, vm)
        _until(
            lambda: any(t in second.log_text() for t in ("holds the node", "serving 1 GPUs", "cannot start")),
            60,
            "the second agent waits, serves or gives up",
        )
        text = second.log_text()
        assert "holds the node" in text and f"--virtual-manager-path={vm}" in text, text[-3000:]
        assert "was made again; its lock moved" in first.log_text()
        second.signal(signal.SIGTERM)
        assert second.wait(30) == cli.EXIT_OK, second.log_text()[-3000:]
        assert "serving 1 GPUs" not in second.log_text()
    finally:
        if second is not None:
            second.stop()
        first.stop()


def test_a_pods_directory_made_again_and_locked_by_another_agent_first_is_left_to_it(tmp_path: Path) -> None:
    """Another agent (here: this process) locked the new pods' directory first: one line names it and the
    holder, and the first agent takes it once that lock is let go."""
    spec = spec_dir() / "t4-x1.json"
    first = AgentProcess(tmp_path, spec, extra_args=["--kubelet-watch-period=100ms"]).start()
    made = tmp_path / "made-again"
    held: int | None = None
    try:
        first.wait_for_log("serving 1 GPUs", timeout=60)
        vm = first.vm_path
        made.mkdir(mode=0o755)
        held = os.open(made, os.O_RDONLY | os.O_DIRECTORY)
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        first.signal(signal.SIGSTOP)
        try:
            _remove(vm)
            shutil.move(made, vm)  # another file system maybe: the lock goes with the directory's inode only
        finally:
            first.signal(signal.SIGCONT)
        if os.stat(vm).st_ino != os.fstat(held).st_ino:
            pytest.skip("the directory could not be moved in one step")
        _until(lambda: "holds the lock" in first.log_text(), 30, "the first agent says who holds the directory")
        time.sleep(1.0)
        lines = [line for line in first.log_text().splitlines() if "holds the lock" in line]
        assert len(lines) == 1, lines
        assert f"--virtual-manager-path={vm}" in lines[0] and f"pid {os.getpid()}" in lines[0], lines[0]
        assert "Traceback" not in first.log_text()
        os.close(held)
        held = None
        _until(lambda: _locked_by(vm, first.pid), 30, "the first agent locks the directory once it is let go")
    finally:
        if held is not None:
            os.close(held)
        first.stop()


def _dra_sockets(tmp_path: Path, held: list[int]) -> tuple[DRAPluginSockets, DirectoryLock]:
    dra = tmp_path / "dra"
    dra.mkdir()
    fd = os.open(dra, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as the command line locks it
    held.append(fd)
    lock = DirectoryLock(dra, f"--dra-plugin-path={dra}", held)
    sockets = DRAPluginSockets(
        registration_socket=tmp_path / "reg" / "gpu.example.com-reg.sock",
        service_socket=dra / "dra.sock",
        register_registration=lambda s: None,
        register_services=[],
        watch_period=1000.0,  # passes made by the test
        dir_lock=lock,
    )
    return sockets, lock


def _lockable(directory: Path) -> bool:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def test_the_dra_sockets_directory_made_again_is_locked_before_it_is_served(tmp_path: Path) -> None:
    held: list[int] = []
    sockets, lock = _dra_sockets(tmp_path, held)
    sockets.start()
    try:
        dra = lock.path
        _remove(dra)
        dra.mkdir()
        sockets._pass()
        assert (dra / "dra.sock").is_socket()
        assert not _lockable(dra)  # this agent holds the new directory: a second one waits
        assert sockets.unserved == ""
    finally:
        sockets.stop()
        lock.close()


def test_the_dra_sockets_directory_locked_by_another_agent_first_is_left_to_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    held: list[int] = []
    sockets, lock = _dra_sockets(tmp_path, held)
    sockets.start()
    other: int | None = None
    try:
        dra = lock.path
        _remove(dra)
        dra.mkdir()
        other = os.open(dra, os.O_RDONLY | os.O_DIRECTORY)
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the other agent was quicker
        for _ in range(3):
            sockets._pass()
        assert not (dra / "dra.sock").exists()
        assert not sockets.registration_socket.exists()  # the kubelet is not told of a driver not served
        assert "another gpu-manager holds the lock" in sockets.unserved, sockets.unserved
        lines = [r.getMessage() for r in caplog.records if "holds the lock" in r.getMessage()]
        assert len(lines) == 1 and f"--dra-plugin-path={dra}" in lines[0], lines
        os.close(other)
        other = None
        sockets._pass()
        assert (dra / "dra.sock").is_socket() and sockets.registration_socket.is_socket()
        assert not _lockable(dra) and sockets.unserved == ""
    finally:
        if other is not None:
            os.close(other)
        sockets.stop()
        lock.close()


def test_no_container_file_is_written_or_removed_in_a_pods_directory_another_agent_holds(tmp_path: Path) -> None:
    """PreStartContainer's files are refused (an OSError: the kubelet tries the start again) naming the lock,
    and neither the refresh nor the collection of ended pods touches that agent's directories; once the
    lock is let go this agent takes the directory and writes there again."""
    from gpumanager.vmanager.manager import VirtualManager

    vm = tmp_path / "vm"
    vm.mkdir()
    mine = os.open(vm, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(mine, fcntl.LOCK_EX | fcntl.LOCK_NB)
    lock = DirectoryLock(vm, f"--virtual-manager-path={vm}", [mine])
    alloc = ContainerAllocation(UID, "main", (0,), 30, 1 << 30, namespace="ns", pod_name="p", started=True)
    manager = VirtualManager(
        vm_path=vm,
        cgroup_root=tmp_path / "cgroup",
        allocation=lambda uid, name: alloc if (uid, name) == (UID, "main") else None,
        pod=lambda uid: None,
        driver_version="550.54.15",
        dir_lock=lock,
    )
    other: int | None = None
    try:
        _remove(vm)
        vm.mkdir()
        theirs = vm / "0b1f3c6e-1d2a-4b5c-8d7e-9f0a1b2c3d4e"
        theirs.mkdir()  # the other agent's pod
        other = os.open(vm, os.O_RDONLY | os.O_DIRECTORY)
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(OSError) as refused:
            manager.prepare(alloc)
        assert f"another gpu-manager holds the lock of --virtual-manager-path={vm}" in str(refused.value)
        assert sorted(p.name for p in vm.iterdir()) == [theirs.name]
        assert manager.gc([]) == [] and theirs.is_dir()
        assert manager.refresh_pids([alloc]) == 0
        os.close(other)
        other = None
        manager.prepare(alloc)
        assert (manager.own_dir(UID, "main") / "vcuda.config").is_file()
        assert not _lockable(vm)
    finally:
        if other is not None:
            os.close(other)
        manager.stop()
        lock.close()
