"""The registration loop against the kubelet simulator, in process: what it notices and when."""

from __future__ import annotations

import itertools
import os
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from gpumanager.api import deviceplugin_v1beta1_pb2 as pb
from gpumanager.api import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from gpumanager.deviceplugin import manager as manager_module
from gpumanager.deviceplugin.manager import PluginManager
from gpumanager.deviceplugin.server import PluginServer
from gpumanager.deviceplugin.servicer import ResourceServicer
from simnode.kubelet import KubeletSimulator

RESOURCE = "example.com/r"
DEVICES = pb.ListAndWatchResponse(devices=[pb.Device(ID="r-0", health="Healthy")]).SerializeToString()


def _started_manager(tmp_path: Path, kubelet: KubeletSimulator) -> PluginManager:
    """One resource's plugin, serving in ``tmp_path``/device-plugins, its safety-net poll out of the way."""
    servicer = ResourceServicer(RESOURCE, devices=lambda: DEVICES, options=pb.DevicePluginOptions())
    plugins = PluginManager(
        [PluginServer(servicer, tmp_path / "device-plugins" / "r.sock")],
        kubelet.socket_path,
        options_for=lambda _server: pb.DevicePluginOptions(),
        watch_period=600.0,
    )
    plugins.start()
    return plugins


def test_a_kubelet_restart_before_the_directory_is_watched_is_seen_without_waiting_for_the_poll(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The directory watch opens only after the first registration. A kubelet restart in between
    # (our socket removed, kubelet.sock re-created) must be seen then, not at the safety-net poll.
    kubelet = KubeletSimulator(tmp_path / "device-plugins", dial_timeout=10.0)
    kubelet.start()
    real_watch = manager_module.DirectoryWatch
    restarts: list[float] = []

    def restart_then_watch(directory: Path, names: Any = None) -> manager_module.DirectoryWatch:
        restarts.append(kubelet.restart())
        return real_watch(directory, names)

    monkeypatch.setattr(manager_module, "DirectoryWatch", restart_then_watch)
    plugins = _started_manager(tmp_path, kubelet)
    try:
        # The first and the second registration (the latest could already be the second).
        first = kubelet.wait_for_registration(RESOURCE, after=0, timeout=10)
        again = kubelet.wait_for_registration(RESOURCE, after=1, timeout=10, with_devices=True)
        assert len(restarts) == 1
        assert first.registered_at < restarts[0] < again.registered_at
    finally:
        plugins.stop()
        kubelet.stop()


class _GatedWatch:
    """A directory watch whose waits end only when the test opens the gate: the loop makes one pass per
    opening, and ``passes`` counts the waits it entered."""

    def __init__(self) -> None:
        self.gate = threading.Semaphore(0)
        self.passes = 0
        self._lock = threading.Lock()

    def __call__(self, directory: Path, names: Any = None) -> _GatedWatch:
        return self

    def wait(self, timeout: float, *, every: bool = False) -> bool:
        with self._lock:
            self.passes += 1
        return self.gate.acquire(timeout=600)

    def wake(self) -> None:
        self.gate.release()

    def take_created(self, name: str) -> bool:
        return False

    def close(self) -> None:
        pass

    def one_pass(self) -> None:
        """Let the loop make one pass and wait until it waits again."""
        entered = self.passes
        self.gate.release()
        deadline = time.monotonic() + 30
        while self.passes == entered:
            assert time.monotonic() < deadline, "the loop never came back to its wait"
            time.sleep(0.005)


@pytest.mark.parametrize("looks", [1, None], ids=["the-first-look", "every-look-until-the-dial"])
def test_a_kubelet_socket_that_appears_while_we_serve_again_is_registered_with_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, looks: int | None
) -> None:
    """The kubelet restarts: our socket is gone, and its new kubelet.sock appears while we serve ours again,
    after we looked for it (the first look misses it, or every look until the registration dials it). The
    registration that follows reaches the new kubelet; the next pass must not take the socket it registered
    with for a new kubelet and register again (the kubelet then drops the endpoint it just dialled, and the
    PreStartContainer calls on it fail)."""
    kubelet = KubeletSimulator(tmp_path / "device-plugins", dial_timeout=10.0)
    kubelet.start()
    watch = _GatedWatch()
    monkeypatch.setattr(manager_module, "DirectoryWatch", watch)
    hidden = [0]  # the next looks at kubelet.sock find nothing: it is being created
    real_identity = manager_module.socket_identity

    def identity(path: Path) -> tuple[int, int] | None:
        if path == kubelet.socket_path and hidden[0] > 0:
            hidden[0] -= 1
            return None
        return real_identity(path)

    monkeypatch.setattr(manager_module, "socket_identity", identity)
    real_restart = PluginServer.restart

    def restart(server: PluginServer) -> None:
        real_restart(server)
        hidden[0] = looks if looks is not None else 1_000_000

    real_register = manager_module.register

    def register(*args: Any, **kwargs: Any) -> Any:
        hidden[0] = 0  # there by the time it is dialled
        return real_register(*args, **kwargs)

    monkeypatch.setattr(manager_module, "register", register)

    monkeypatch.setattr(PluginServer, "restart", restart)
    plugins = _started_manager(tmp_path, kubelet)
    try:
        kubelet.wait_for_registration(RESOURCE, after=0, timeout=10)
        watch.one_pass()  # the pass that opened the watch ends in its first wait
        kubelet.restart()
        watch.one_pass()  # serves again, looks for kubelet.sock (not there yet), registers
        kubelet.wait_for_registration(RESOURCE, after=1, timeout=10, with_devices=True)
        watch.one_pass()  # kubelet.sock is the one registered with: nothing to do
        watch.one_pass()
        assert kubelet.registration_count(RESOURCE) == 2, (
            "registered again with the kubelet it had just registered with"
        )
    finally:
        plugins.stop()
        kubelet.stop()


def _ours_and_another(tmp_path: Path) -> tuple[KubeletSimulator, PluginServer, PluginManager, PluginServer]:
    """A started kubelet, our server and its started manager, and another plugin's server for our path
    (not started)."""
    kubelet = KubeletSimulator(tmp_path / "device-plugins", dial_timeout=10.0)
    kubelet.start()
    servicer = ResourceServicer(RESOURCE, devices=lambda: DEVICES, options=pb.DevicePluginOptions())
    ours = PluginServer(servicer, tmp_path / "device-plugins" / "r.sock")
    plugins = PluginManager(
        [ours], kubelet.socket_path, options_for=lambda _server: pb.DevicePluginOptions(), watch_period=0.1
    )
    other = PluginServer(
        ResourceServicer(RESOURCE, devices=lambda: DEVICES, options=pb.DevicePluginOptions()), ours.socket_path
    )
    plugins.start()
    return kubelet, ours, plugins, other


def test_a_live_socket_of_another_plugin_at_our_path_is_not_taken_back(tmp_path: Path) -> None:
    """A second plugin (another agent on the node) serves at our socket path: we leave it there and do not
    register over it; once its socket is gone we serve and register again."""
    kubelet, ours, plugins, other = _ours_and_another(tmp_path)
    try:
        kubelet.wait_for_registration(RESOURCE, after=0, timeout=10)
        count = kubelet.registration_count(RESOURCE)
        other.start()  # removes our socket and serves in its place
        time.sleep(1.5)
        assert other.socket_intact(), "took the other plugin's socket"
        assert kubelet.registration_count(RESOURCE) == count
        assert not plugins.status.registered
        other.close()
        kubelet.wait_for_registration(RESOURCE, after=count, timeout=10)
        assert ours.socket_intact()
    finally:
        other.close()
        plugins.stop()
        kubelet.stop()


class _SlowRefusingKubelet(pb_grpc.RegistrationServicer):
    """A kubelet whose Register answers late (a busy node) and, when ``refuse``, with an error."""

    def __init__(self, delay: float, refuse: bool) -> None:
        self.delay, self.refuse = delay, refuse
        self.calls: list[tuple[float, float, float | None]] = []  # start, end, the caller's deadline left
        self._lock = threading.Lock()

    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.Empty:
        start = time.monotonic()
        left = context.time_remaining()
        time.sleep(self.delay)
        with self._lock:
            self.calls.append((start, time.monotonic(), left))
        if self.refuse:
            context.abort(grpc.StatusCode.INTERNAL, "busy")
        return pb.Empty()


def _fake_kubelet(tmp_path: Path, servicer: _SlowRefusingKubelet) -> tuple[grpc.Server, Path]:
    socket_path = tmp_path / "device-plugins" / "kubelet.sock"
    socket_path.parent.mkdir(parents=True, exist_ok=True)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_RegistrationServicer_to_server(servicer, server)
    server.add_insecure_port(f"unix://{socket_path}")
    server.start()
    return server, socket_path


def test_registration_waits_for_a_slow_kubelet_and_backs_off_after_a_failure(tmp_path: Path) -> None:
    """A Register the kubelet answers late is given a generous deadline, and after a failed one the next try
    waits the backoff counted from the end of the attempt, not from its start."""
    kubelet = _SlowRefusingKubelet(delay=1.2, refuse=True)
    server, socket_path = _fake_kubelet(tmp_path, kubelet)
    servicer = ResourceServicer(RESOURCE, devices=lambda: DEVICES, options=pb.DevicePluginOptions())
    plugins = PluginManager(
        [PluginServer(servicer, tmp_path / "device-plugins" / "r.sock")],
        socket_path,
        options_for=lambda _server: pb.DevicePluginOptions(),
        watch_period=600.0,
    )
    plugins.start()
    try:
        time.sleep(4.5)
    finally:
        plugins.stop()
        server.stop(None)
    calls = sorted(kubelet.calls)
    assert len(calls) >= 2, calls
    for (_start, end, _left), (start, _end, _left2) in itertools.pairwise(calls):
        assert start - end >= 0.7, f"retried {start - end:.2f} s after the failure"
    assert all(left is None or left >= 55 for _s, _e, left in calls), calls


def test_a_stop_while_the_loop_serves_again_leaves_no_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kubelet wipes our socket and the agent stops while the loop is serving again: nothing serves and
    no socket is left after the stop."""
    directory = tmp_path / "device-plugins"
    directory.mkdir()
    servicer = ResourceServicer(RESOURCE, devices=lambda: DEVICES, options=pb.DevicePluginOptions())
    server = PluginServer(servicer, directory / "r.sock")
    real_restart = PluginServer.restart
    entered = threading.Event()

    def slow_restart(self: PluginServer) -> None:
        entered.set()
        time.sleep(0.3)  # a busy node: the old server's cancel takes this long
        real_restart(self)

    monkeypatch.setattr(PluginServer, "restart", slow_restart)
    plugins = PluginManager(
        [server], directory / "kubelet.sock", options_for=lambda _server: pb.DevicePluginOptions(), watch_period=0.2
    )
    plugins.start()
    time.sleep(0.3)
    (directory / "r.sock").unlink()
    assert entered.wait(5)
    plugins.stop()
    time.sleep(0.6)
    assert sorted(p.name for p in directory.iterdir()) == []
    with pytest.raises(RuntimeError):
        server.start()


def test_a_plugin_that_listens_a_moment_after_removing_our_socket_is_left_there(tmp_path: Path) -> None:
    """Another plugin removes our socket and listens at the path a moment later (50 ms here: the time it
    takes a process to set up its server). The kubelet did not restart (its socket is the one we
    registered with), so we do not serve and register again in between."""
    kubelet, ours, plugins, other = _ours_and_another(tmp_path)
    try:
        kubelet.wait_for_registration(RESOURCE, after=0, timeout=10)
        count = kubelet.registration_count(RESOURCE)
        ours.socket_path.unlink()
        time.sleep(0.05)
        other.start()
        time.sleep(1.0)
        assert other.socket_intact(), "took the other plugin's socket"
        assert kubelet.registration_count(RESOURCE) == count, "served and registered in the gap"
    finally:
        other.close()
        plugins.stop()
        kubelet.stop()


def test_a_kubelet_socket_made_again_under_the_same_inode_number_is_a_restart_not_a_takeover(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kubelet restart removes our socket and makes kubelet.sock again; the file system may give the
    new kubelet.sock the inode number of the old one, so (device, inode) looks unchanged. The new file is
    still told from the old (its change time): served and registered again at once, not after the grace
    that waits for another plugin (made far longer here than any registration takes)."""
    kubelet = KubeletSimulator(tmp_path / "device-plugins", dial_timeout=10.0)
    kubelet.start()
    monkeypatch.setattr(manager_module, "TAKEOVER_GRACE_SECONDS", 120.0)
    real_identity = manager_module.socket_identity

    def same_inode(path: Path) -> tuple[int, int] | None:
        found = real_identity(path)
        return (0, 1) if found is not None and path == kubelet.socket_path else found

    monkeypatch.setattr(manager_module, "socket_identity", same_inode)
    real_register = manager_module.register

    def register(*args: Any, **kwargs: Any) -> Any:
        return (0, 1) if real_register(*args, **kwargs) is not None else None  # the one it dialled

    monkeypatch.setattr(manager_module, "register", register)
    watch = _GatedWatch()
    monkeypatch.setattr(manager_module, "DirectoryWatch", watch)
    plugins = _started_manager(tmp_path, kubelet)
    try:
        kubelet.wait_for_registration(RESOURCE, after=0, timeout=10)
        watch.one_pass()  # the pass that opened the watch ends in its first wait
        kubelet.restart()  # done before the loop looks: our socket gone, kubelet.sock made again
        watch.wake()
        kubelet.wait_for_registration(RESOURCE, after=1, timeout=20, with_devices=True)
    finally:
        plugins.stop()
        kubelet.stop()


def test_the_kubelets_checkpoint_writes_do_not_wake_the_registration_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kubelet rewrites kubelet_internal_checkpoint in the device-plugin directory (a temporary file
    and a rename) on every allocation. The registration loop has nothing to do then, and a pass of it
    competes with the Allocate and PreStartContainer calls being answered: only the kubelet's socket and
    ours wake it. A kubelet restart still does, at once (the safety-net poll is 600 s away)."""
    kubelet = KubeletSimulator(tmp_path / "device-plugins", dial_timeout=10.0)
    kubelet.start()
    woken: list[bool] = []
    waits = threading.Semaphore(0)
    real_watch = manager_module.DirectoryWatch

    class Counting(real_watch):  # type: ignore[misc,valid-type]
        def wait(self, timeout: float, *, every: bool = False) -> bool:
            waits.release()
            changed: bool = super().wait(timeout, every=every)
            woken.append(changed)
            return changed

    monkeypatch.setattr(manager_module, "DirectoryWatch", Counting)
    plugins = _started_manager(tmp_path, kubelet)
    try:
        kubelet.wait_for_registration(RESOURCE, after=0, timeout=10)
        assert waits.acquire(timeout=10), "the registration loop never waited on the directory watch"
        before = len(woken)
        for _ in range(20):
            kubelet.write_checkpoint()
            (tmp_path / "device-plugins" / "other-plugin.sock").touch()
            (tmp_path / "device-plugins" / "other-plugin.sock").unlink()
            time.sleep(0.01)
        time.sleep(0.3)
        assert True not in woken[before:], f"woken {woken[before:].count(True)} times by other entries' changes"
        kubelet.restart()
        kubelet.wait_for_registration(RESOURCE, after=1, timeout=10)
        assert True in woken[before:]
    finally:
        plugins.stop()
        kubelet.stop()


def test_a_directory_watch_counts_only_its_names_and_those_it_was_asked_about(tmp_path: Path) -> None:
    from gpumanager.deviceplugin.dirwatch import DirectoryWatch

    directory = tmp_path / "device-plugins"
    directory.mkdir()
    watch = DirectoryWatch(directory, {"kubelet.sock"})
    try:
        (directory / ".kubelet_internal_checkpoint.tmp").write_text("{}")
        os.replace(directory / ".kubelet_internal_checkpoint.tmp", directory / "kubelet_internal_checkpoint")
        assert watch.wait(0.2) is False
        (directory / "kubelet.sock").touch()
        assert watch.wait(5) is True
        assert watch.take_created("vcore.sock") is False  # followed from now on
        (directory / "vcore.sock").touch()
        assert watch.wait(5) is True
        assert watch.take_created("vcore.sock") is True
    finally:
        watch.close()


def test_a_directory_made_again_while_held_open_is_seen_through_other_entries_changes(tmp_path: Path) -> None:
    """The agent's lock holds the device-plugin directory open: removed, it gets no DELETE_SELF, and when
    none of the names watched was in it, the only changes the watch sees are of other entries (the
    kubelet's checkpoint). Those must still tell it the directory went, or a kubelet.sock made in the new
    one waits for the safety-net poll."""
    from gpumanager.deviceplugin.dirwatch import DirectoryWatch

    directory = tmp_path / "device-plugins"
    directory.mkdir()
    (directory / "kubelet_internal_checkpoint").write_text("{}")
    held = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    watch = DirectoryWatch(directory, {"kubelet.sock"})

    def made_again() -> None:
        (directory / "kubelet_internal_checkpoint").unlink()
        directory.rmdir()
        directory.mkdir()
        (directory / "kubelet.sock").touch()

    try:
        watch.wait(0.05)  # watching
        timer = threading.Timer(0.2, made_again)  # while the watch waits
        timer.start()
        assert watch.wait(5) is True
        timer.join()
        (directory / "kubelet.sock").unlink()
        (directory / "kubelet.sock").touch()
        assert watch.wait(5) is True  # the new directory is watched
    finally:
        watch.close()
        os.close(held)


def test_every_entry_counts_when_asked(tmp_path: Path) -> None:
    """Waiting for another agent that holds the directory to go: its sockets may have other names."""
    from gpumanager.deviceplugin.dirwatch import DirectoryWatch

    directory = tmp_path / "device-plugins"
    directory.mkdir()
    watch = DirectoryWatch(directory, {"kubelet.sock"})
    try:
        (directory / "other-agent.sock").touch()
        assert watch.wait(5, every=True) is True
        (directory / "other-agent.sock").unlink()
        assert watch.wait(0.2) is False
    finally:
        watch.close()
