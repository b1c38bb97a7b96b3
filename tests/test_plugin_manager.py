"""The registration loop against the kubelet simulator, in process: what it notices and when."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpumanager.api import deviceplugin_v1beta1_pb2 as pb
from gpumanager.deviceplugin import manager as manager_module
from gpumanager.deviceplugin.manager import PluginManager
from gpumanager.deviceplugin.server import PluginServer
from gpumanager.deviceplugin.servicer import ResourceServicer
from simnode.kubelet import KubeletSimulator

RESOURCE = "example.com/r"
DEVICES = pb.ListAndWatchResponse(devices=[pb.Device(ID="r-0", health="Healthy")]).SerializeToString()


def test_a_kubelet_restart_before_the_directory_is_watched_is_seen_without_waiting_for_the_poll(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The directory watch opens only after the first registration. A kubelet restart in between
    # (our socket removed, kubelet.sock re-created) must be seen then, not at the safety-net poll.
    kubelet = KubeletSimulator(tmp_path / "device-plugins", dial_timeout=10.0)
    kubelet.start()
    real_watch = manager_module.DirectoryWatch
    restarts: list[float] = []

    def restart_then_watch(directory: Path) -> manager_module.DirectoryWatch:
        restarts.append(kubelet.restart())
        return real_watch(directory)

    monkeypatch.setattr(manager_module, "DirectoryWatch", restart_then_watch)
    servicer = ResourceServicer(RESOURCE, devices=lambda: DEVICES, options=pb.DevicePluginOptions())
    plugins = PluginManager(
        [PluginServer(servicer, tmp_path / "device-plugins" / "r.sock")],
        kubelet.socket_path,
        options_for=lambda _server: pb.DevicePluginOptions(),
        watch_period=600.0,
    )
    plugins.start()
    try:
        # The first and the second registration (the latest could already be the second).
        first = kubelet.wait_for_registration(RESOURCE, after=0, timeout=10)
        again = kubelet.wait_for_registration(RESOURCE, after=1, timeout=10, with_devices=True)
        assert len(restarts) == 1
        assert first.registered_at < restarts[0] < again.registered_at
    finally:
        plugins.stop()
        kubelet.stop()
