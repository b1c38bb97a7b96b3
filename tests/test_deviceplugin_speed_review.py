"""The device-plugin call path does no work it need not: a repeated PreStartContainer (a restarted
container) leaves a vcuda.config that already holds its values, and replaces anything else."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpumanager.vmanager import files

VALUES = files.VcudaConfig(pod_uid="uid-a", container_name="main", gpu_memory=1 << 30, utilization=30)


def written(tmp_path: Path) -> Path:
    path = tmp_path / "main" / "vcuda.config"
    path.parent.mkdir()
    files.write_config(path, VALUES)
    return path


def test_a_config_already_holding_the_values_is_left_in_place(tmp_path: Path) -> None:
    path = written(tmp_path)
    before = path.stat()
    files.write_config(path, VALUES)
    after = path.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns), "rewritten with the same values"
    assert files.unpack(path.read_bytes()) == VALUES
    assert sorted(p.name for p in path.parent.iterdir()) == ["vcuda.config"]


def test_other_values_replace_the_config(tmp_path: Path) -> None:
    path = written(tmp_path)
    inode = path.stat().st_ino
    other = files.VcudaConfig(pod_uid="uid-a", container_name="main", gpu_memory=1 << 30, utilization=40)
    files.write_config(path, other)
    assert path.stat().st_ino != inode
    assert files.unpack(path.read_bytes()) == other


@pytest.mark.parametrize("change", ["content", "mode", "second name", "symlink", "fifo", "short"])
def test_a_config_that_is_not_exactly_ours_is_replaced(tmp_path: Path, change: str) -> None:
    """Anything but a plain file of one name, mode 0644, holding exactly the values, is replaced by one."""
    path = written(tmp_path)
    if change == "content":
        data = bytearray(path.read_bytes())
        data[48] ^= 1  # the limit field
        path.write_bytes(bytes(data))
    elif change == "mode":
        path.chmod(0o666)
    elif change == "second name":
        os.link(path, tmp_path / "elsewhere")
    elif change == "symlink":
        target = tmp_path / "target"
        target.write_bytes(path.read_bytes())
        path.unlink()
        path.symlink_to(target)
    elif change == "fifo":
        path.unlink()
        os.mkfifo(path)
    else:
        path.write_bytes(path.read_bytes()[:-8])
    files.write_config(path, VALUES)
    st = path.lstat()
    assert path.is_file() and not path.is_symlink() and st.st_nlink == 1
    assert st.st_mode & 0o7777 == 0o644
    assert files.unpack(path.read_bytes()) == VALUES
    if change == "symlink":
        assert (tmp_path / "target").read_bytes() == files.pack(VALUES), "the link's target is left as it was"
