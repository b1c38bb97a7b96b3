"""Battery: the checkpoint directory on a small tmpfs that fills up, or is remounted read-only, mid-run.

The agent keeps serving what it has, refuses new allocations naming the path and the errno,
says so on /readyz, never exits, survives a SIGKILL while the disk is full, and takes new pods
again once the disk has room (or is writable) again. Needs root for mount(2); skipped without.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from simnode.cluster import PodRun, SimCluster, gpu_pod
from simnode.kubelet import PluginRPCError
from tests.battery_fixtures import assert_no_overcommit, memory_of, readyz, spec_odd_mixed, wait_agent_matches


@contextlib.contextmanager
def _tmpfs(path: Path, size: str) -> Iterator[Path]:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _fill(directory: Path) -> Path:
    """Take every free byte of the file system; called again, take what was freed since (appends)."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        chunk = b"\0" * 65536
        with contextlib.suppress(OSError):
            while True:
                os.write(fd, chunk)
        with contextlib.suppress(OSError):
            while True:
                os.write(fd, b"\0")
    finally:
        os.close(fd)
    return filler


def _wait_ready(cluster: SimCluster, want: bool, timeout: float = 40.0) -> dict[str, object]:
    deadline = time.monotonic() + timeout
    body: dict[str, object] = {}
    while time.monotonic() < deadline:
        status, body = readyz(cluster)
        if (status == 200) == want:
            return body
        time.sleep(0.2)
    raise AssertionError(f"/readyz did not become {'ready' if want else 'not ready'}: {body}")


def _refused_for_disk(cluster: SimCluster, name: str, errno_name: str) -> None:
    """A new pod is refused, the refusal naming the checkpoint path and the errno; the pod then goes."""
    with pytest.raises(PluginRPCError) as info:
        cluster.admit(gpu_pod(name, [("main", 30, 4)]))
    details = info.value.details
    assert str(cluster.checkpoint_dir) in details and errno_name in details, details
    run = next(r for r in cluster.runs.values() if r.name == name)
    cluster.delete(run)


def _settle(cluster: SimCluster, live: list[PodRun]) -> None:
    assert_no_overcommit(live, memory_of(cluster))
    wait_agent_matches(cluster, live)


def _full_disk_pods(cluster: SimCluster, live: list[PodRun]) -> dict[str, object]:
    """New pods while the checkpoint's disk is full, until /readyz says not ready; its body.

    A new allocation is answered only once durable: recorded in the journal's preallocated room, or refused
    naming the path and the errno. Before each pod the disk is filled again: the agent's own clean-up (a
    compaction that removes an old segment) frees room, and a fill that raced it would leave the disk with
    room for the rest of the test. Once changes stop, the snapshot the agent writes finds no room, and
    /readyz says so; a few more pods (each a change, each a snapshot due) give it more chances.
    """
    for i in range(12):
        _fill(cluster.checkpoint_dir)
        name = f"full-{i}"
        try:
            live.append(cluster.run_pod(gpu_pod(name, [("main", 10, 2)])))
        except PluginRPCError as exc:
            assert str(cluster.checkpoint_dir) in exc.details and "ENOSPC" in exc.details, exc.details
            cluster.delete(next(r for r in cluster.runs.values() if r.name == name))
        if i < 5:
            continue  # six pods first, as many as the journal's room takes
        with contextlib.suppress(AssertionError):
            return _wait_ready(cluster, False, timeout=5.0)
    return _wait_ready(cluster, False)


def test_checkpoint_disk_full_then_room_again(tmp_path: Path) -> None:
    spec = spec_odd_mixed(tmp_path / "spec.json")
    cluster = SimCluster(tmp_path / "node", spec, fill="random", agent_flags=["--allocation-check-period=1"])
    with _tmpfs(cluster.checkpoint_dir, "8m"), cluster:
        live = [cluster.run_pod(gpu_pod(f"before-{i}", [("main", 30, 4)])) for i in range(3)]
        _settle(cluster, live)
        filler = _fill(cluster.checkpoint_dir)
        # Pods end while the disk is full: freed in memory all the same.
        cluster.delete(live.pop())
        body = _full_disk_pods(cluster, live)
        assert "checkpoint" in body["missing"], body  # type: ignore[operator]
        assert cluster.agent is not None and cluster.agent.proc is not None
        # SIGKILL while the disk is full: the agent comes back, serves what it has, refuses the rest.
        cluster.agent.signal(signal.SIGKILL)
        cluster.agent.wait()
        cluster.start_agent()
        _settle(cluster, live)
        _fill(cluster.checkpoint_dir)  # what the start's own clean-up freed, if anything
        _refused_for_disk(cluster, "after-kill", "ENOSPC")
        body = _wait_ready(cluster, False)
        assert str(cluster.checkpoint_dir) in str(body["missing"]), body
        filler.unlink()
        _wait_ready(cluster, True)
        live.append(cluster.run_pod(gpu_pod("room-again", [("main", 30, 4)])))
        _settle(cluster, live)
        assert cluster.agent.proc.poll() is None


def test_checkpoint_dir_read_only_across_a_crash(tmp_path: Path) -> None:
    """The agent dies, its checkpoint's file system comes back read-only (a remount needs no writer open)."""
    spec = spec_odd_mixed(tmp_path / "spec.json")
    cluster = SimCluster(tmp_path / "node", spec, fill="random", agent_flags=["--allocation-check-period=1"])
    with _tmpfs(cluster.checkpoint_dir, "8m"), cluster:
        live = [cluster.run_pod(gpu_pod(f"before-{i}", [("main", 50, 4)])) for i in range(2)]
        _settle(cluster, live)
        assert cluster.agent is not None
        cluster.agent.signal(signal.SIGKILL)
        cluster.agent.wait()
        subprocess.run(["mount", "-o", "remount,ro", str(cluster.checkpoint_dir)], check=True)
        try:
            cluster.start_agent()
            _settle(cluster, live)
            cluster.delete(live.pop())
            _refused_for_disk(cluster, "read-only", "EROFS")
            body = _wait_ready(cluster, False)
            assert "checkpoint" in body["missing"], body  # type: ignore[operator]
            _settle(cluster, live)
        finally:
            subprocess.run(["mount", "-o", "remount,rw", str(cluster.checkpoint_dir)], check=True)
        _wait_ready(cluster, True)
        live.append(cluster.run_pod(gpu_pod("writable-again", [("main", 50, 4)])))
        _settle(cluster, live)
        assert cluster.agent.proc is not None and cluster.agent.proc.poll() is None


def test_pod_directories_disk_full(tmp_path: Path) -> None:
    """--virtual-manager-path fills up: PreStart is refused naming the container and why, then works again."""
    spec = spec_odd_mixed(tmp_path / "spec.json")
    cluster = SimCluster(tmp_path / "node", spec, fill="random", agent_flags=["--allocation-check-period=1"])
    with _tmpfs(cluster.vm_path, "1m"), cluster:
        live = [cluster.run_pod(gpu_pod("before", [("main", 30, 4)]))]
        filler = _fill(cluster.vm_path)
        run = cluster.admit(gpu_pod("full", [("main", 30, 4)]))
        with pytest.raises(PluginRPCError) as info:
            cluster.start_containers(run)
        details = info.value.details
        assert info.value.code is not None and info.value.code.name not in ("INTERNAL", "UNKNOWN"), info.value
        assert run.uid in details and "main" in details and "ENOSPC" in details, details
        filler.unlink()
        cluster.start_containers(run)  # the kubelet retries the start
        live.append(run)
        _settle(cluster, live)
        assert cluster.agent is not None and cluster.agent.proc is not None and cluster.agent.proc.poll() is None
