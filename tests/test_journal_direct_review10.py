"""Journal segments written past the page cache (O_DIRECT, whole blocks): every record lands where it was
placed, the records already in a block survive the next write into it, a failed write is cleared without
touching them, and a file system that refuses O_DIRECT gets the page-cache writes."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest

from gpumanager.allocation import journal
from gpumanager.allocation.journal import CheckpointStore

NAME = "gpumanager_internal_checkpoint"


def put(pod: str, pad: int = 0) -> dict[str, Any]:
    return {
        "op": "put",
        "pod": pod,
        "container": "c" + "x" * pad,
        "entry": {"Devices": ["/dev/nvidia0"], "Cores": 1, "Memory": 0},
    }


def _direct_supported(directory: Path) -> bool:
    probe = directory / "probe"
    probe.write_bytes(bytes(4096))
    try:
        fd = os.open(probe, os.O_RDWR | journal._DIRECT)
    except OSError:
        return False
    os.close(fd)
    return True


def _segment_bytes(store: CheckpointStore) -> bytes:
    assert store._segment is not None
    return store._segment.path.read_bytes()


def test_records_of_any_size_and_batches_land_in_place(tmp_path: Path) -> None:
    if not journal._DIRECT or not _direct_supported(tmp_path):
        pytest.skip("no O_DIRECT on this file system")
    store = CheckpointStore(tmp_path / NAME)
    store.record(put("first"))
    assert store._segment is not None and store._segment.direct
    expected = [put("first")]
    # Single records, records across block boundaries, and group commits of several at once.
    for i in range(60):
        if i % 7 == 3:
            tickets = [store.stage(put(f"batch{i}-{k}", pad=i * 13)) for k in range(5)]
            expected += [put(f"batch{i}-{k}", pad=i * 13) for k in range(5)]
            store.sync(tickets[-1])
        else:
            store.record(put(f"one{i}", pad=(i * 97) % 3000))
            expected.append(put(f"one{i}", pad=(i * 97) % 3000))
    data = _segment_bytes(store)
    records = b"".join(journal._record(change) for change in expected)
    assert data[: len(records)] == records
    assert data[len(records) :].strip(b"\0") == b""
    store.close()
    loaded = CheckpointStore(tmp_path / NAME).load()
    assert loaded.problems == []
    assert loaded.document is not None
    assert set(loaded.document["PodGPUMapping"]) == {c["pod"] for c in expected}


def test_a_failed_write_is_cleared_and_the_records_before_it_in_its_block_stay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not journal._DIRECT or not _direct_supported(tmp_path):
        pytest.skip("no O_DIRECT on this file system")
    path = tmp_path / NAME
    store = CheckpointStore(path)
    store.record(put("kept"))
    real = os.pwrite
    calls: list[int] = []

    def written_then_eio(fd: int, data: bytes, offset: int) -> int:
        calls.append(offset)
        if len(calls) == 1:
            real(fd, data, offset)  # on the disk, though the write is reported failed
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", written_then_eio)
    with pytest.raises(OSError):
        store.record(put("refused"))
    monkeypatch.setattr(os, "pwrite", real)
    assert len(calls) == 2  # the write, and the one clearing it
    data = _segment_bytes(store)
    kept = journal._record(put("kept"))
    assert data[: len(kept)] == kept
    assert data[len(kept) :].strip(b"\0") == b""
    store.close()
    loaded = CheckpointStore(path).load()
    assert loaded.document is not None
    assert set(loaded.document["PodGPUMapping"]) == {"kept"}


def test_a_file_system_refusing_o_direct_at_the_write_gets_page_cache_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not journal._DIRECT:
        pytest.skip("no O_DIRECT on this platform")
    import fcntl

    real = os.pwrite

    def refuse_direct(fd: int, data: bytes, offset: int) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & journal._DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", refuse_direct)
    path = tmp_path / NAME
    store = CheckpointStore(path)
    for i in range(5):
        store.record(put(f"pod{i}"))
    assert store._segment is not None and not store._segment.direct
    store.close()
    loaded = CheckpointStore(path).load()
    assert loaded.problems == []
    assert loaded.document is not None
    assert set(loaded.document["PodGPUMapping"]) == {f"pod{i}" for i in range(5)}


def test_a_file_system_refusing_o_direct_at_the_open_gets_page_cache_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not journal._DIRECT:
        pytest.skip("no O_DIRECT on this platform")
    real = os.open

    def refuse_direct(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & journal._DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refuse_direct)
    path = tmp_path / NAME
    store = CheckpointStore(path)
    store.record(put("pod"))
    assert store._segment is not None and not store._segment.direct
    store.close()
    loaded = CheckpointStore(path).load()
    assert loaded.document is not None and set(loaded.document["PodGPUMapping"]) == {"pod"}
