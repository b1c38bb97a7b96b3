"""A kubelet whose PodResources does not answer when the agent starts is asked again until it does."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from gpumanager import names
from gpumanager.allocation.pods import Pod
from gpumanager.deviceplugin.devices import DeviceLayout
from gpumanager.kube.podresources import ContainerDevices, PodResourcesClient, PodResourcesUnavailableError
from gpumanager.recovery import Recovery
from gpumanager.retry import Backoff
from tests.alloc_fixtures import FakePods, core_ids, make_allocator, make_pod, uid_of, v100x4


class _Kubelet(PodResourcesClient):
    """PodResources that refuses ``down`` times (a kubelet restarting), then answers."""

    def __init__(self, down: int, entries: list[ContainerDevices]) -> None:
        super().__init__(Path("/nonexistent/kubelet.sock"))
        self.down = down
        self.entries = entries
        self.calls = 0

    def list_all(self) -> list[ContainerDevices]:
        self.calls += 1
        if self.calls <= self.down:
            raise PodResourcesUnavailableError("connection refused")
        return list(self.entries)


def _setup(tmp_path: Path, down: int) -> tuple[Recovery, _Kubelet, FakePods]:
    gpus, _ = v100x4()
    pods = FakePods([make_pod("run", [("c0", 50, 4)], phase="Running")])
    allocator = make_allocator(tmp_path, pods)  # our checkpoint is lost, the kubelet's names nothing
    recovery = Recovery(allocator, kubelet_checkpoint_path=tmp_path / "no-kc", layout=DeviceLayout(gpus), gpus=gpus)
    recovery.from_disk()
    entries = [ContainerDevices("default", "run", "c0", names.VCORE_RESOURCE, tuple(core_ids(2, 50)))]
    return recovery, _Kubelet(down, entries), pods


def _find(pods: FakePods) -> Callable[[str, str], Pod | None]:
    return lambda ns, name: next((p for p in pods.items if p["metadata"]["name"] == name), None)


def test_a_running_container_is_taken_over_once_the_kubelet_answers(tmp_path: Path) -> None:
    recovery, kubelet, pods = _setup(tmp_path, down=3)
    assert recovery.from_pod_resources(kubelet, _find(pods)) is False
    allocator = recovery._allocator
    assert not allocator.holds((uid_of("run"), "c0"))
    assert recovery.retry_pod_resources(kubelet, _find(pods), threading.Event(), Backoff(0.001, 0.002)) is True
    assert kubelet.calls == 4
    held = {a.key: a.minors for a in allocator.allocations()}
    assert held == {(uid_of("run"), "c0"): (2,)}, "the running container's GPU would be handed out again"


def test_the_retry_ends_when_the_agent_stops(tmp_path: Path) -> None:
    recovery, kubelet, pods = _setup(tmp_path, down=10**9)
    stop = threading.Event()
    done: list[bool] = []
    thread = threading.Thread(
        target=lambda: done.append(recovery.retry_pod_resources(kubelet, _find(pods), stop, Backoff(0.01, 0.02)))
    )
    thread.start()
    stop.set()
    thread.join(5)
    assert done == [False]


def test_a_kubelet_that_answers_at_once_is_not_asked_again(tmp_path: Path) -> None:
    recovery, kubelet, pods = _setup(tmp_path, down=0)
    assert recovery.from_pod_resources(kubelet, _find(pods)) is True
    assert kubelet.calls == 1
