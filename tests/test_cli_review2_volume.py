"""A --volume-config file that is no JSON document is reported naming the file, never as a traceback
that ends the background start (the display socket, /metrics and the pod cache after it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpumanager.volume.config import load_volume_config
from gpumanager.volume.errors import VolumeError
from gpumanager.volume.keeper import MirrorKeeper


@pytest.mark.parametrize("content", [b"[" * 200000, b'{"volume": ' * 100000])
def test_a_volume_config_nested_too_deeply_is_a_volume_error(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "volume.conf"
    path.write_bytes(content)
    with pytest.raises(VolumeError, match=str(path)):
        load_volume_config(path)


def test_the_mirror_reports_it_and_the_start_goes_on(tmp_path: Path) -> None:
    path = tmp_path / "volume.conf"
    path.write_bytes(b"[" * 200000)
    keeper = MirrorKeeper(volume_config=str(path), driver_root=str(tmp_path), share_mode=True, interceptor="/x")
    assert keeper.build() is False
    assert str(path) in keeper.error
