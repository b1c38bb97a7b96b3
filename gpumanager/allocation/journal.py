"""Our checkpoint on disk: a snapshot in upstream's format, and an append-only journal of changes since.

Every change must be durable before the kubelet gets its answer. Rewriting and
fsyncing the whole ``gpumanager_internal_checkpoint`` for each one costs several
milliseconds (file data, a rename, the directory); so a change is one small
record written into a journal segment that was filled with zeros and synced
beforehand (``O_DSYNC``, an overwrite of blocks already allocated: no file
size or block map to update; what is left is the disk's cache flush, from a
fraction of a millisecond on a local NVMe drive to several on a virtual disk).

Group commit: a change is staged under the allocator's lock (its place in the
segment is reserved, in order) and made durable after the lock is released
(:meth:`CheckpointStore.sync`): the first caller writes every change staged so
far in one write and one flush, and the callers who staged meanwhile wait for
it or for the next. So concurrent calls neither wait for each other's flush
under the lock nor pay one flush each. A failed write fails every change
staged up to then and every one staged after it, until a snapshot of the whole
state has been written (a change behind a hole in the segment would never be
read back). The
snapshot, upstream's exact shape, is rewritten in the background a moment after
changes stop, when a segment fills up, and at stop; so an upgrade or downgrade
in place reads a snapshot at most a second or so old, and this agent reads the
journal too.

A disk with no room for a whole segment gets smaller ones (down to
:data:`MIN_SEGMENT_BYTES`, leaving half the free room to the snapshot); with no
room for even that, each change is written as the whole snapshot before it is
answered (:class:`NoSegment`), as upstream does; said once each, and once when
whole segments fit again. Only when the snapshot cannot be written either is a
change refused.

Files, beside the snapshot ``<name>``: ``<name>.journal-<seq>`` segments of
:data:`SEGMENT_BYTES` (or smaller, above), for container allocations and prepared claims (DRA mode)
alike. A record is ``<length:8 hex> <crc32:8 hex> <json>\\n``; zeros mark the
free rest of a segment. On load the snapshot is read, then every segment in
order (a change is a put or a delete of one container's or one claim's entry,
so replaying one the snapshot already holds changes nothing). A record whose
checksum does not match at the end of the last segment is a write cut short by
a crash and is ignored; anywhere else it is damage: reported with the file and
offset, reading goes on at the next whole record (each has its own checksum), a copy of the segment is
kept aside, the segment itself stays until the snapshot written at that start replaces it, and the caller
reconciles with the kubelet's records. A whole record holding no change this agent writes
(:func:`change_problem`) is skipped and reported the same way; the records after it are replayed. A write
that fails is cleared to zeros at once (the page cache may hold it), and its changes are refused.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import mmap
import os
import re
import threading
import time
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpumanager import deferred
from gpumanager.allocation import checkpoint
from gpumanager.fileio import fsync_dir, read_regular

log = logging.getLogger(__name__)

#: The snapshot's key naming the first journal segment that continues it (upstream's reader ignores
#: it; upstream's writer drops it, so a snapshot without it was not written by this agent).
JOURNAL_KEY = "JournalSegment"

#: The snapshot's key for allocations freed before their container started, remembered by their device IDs
#: (a container the kubelet gave those IDs and our answer to may take one over): ``{"<the IDs, sorted and
#: comma-joined>": {"<pod uid>": {"<container>": <entry>}}}``, one pod per set of IDs. A ``del`` record
#: carries the freed entry under ``freed``; a ``put`` of any of the same IDs forgets it. Upstream's reader and
#: older versions of this agent ignore both (keys they do not know).
FREED_KEY = "FreedUnstarted"

#: Size of one journal segment (about 2000 changes of a one-GPU container).
SEGMENT_BYTES = 1 << 20
_HEADER = 18  # "%08x %08x " before the JSON
#: The largest segment number a snapshot or a segment's name may carry (a larger one is no number this agent
#: wrote): below 2^63 by room for 2^32 more segments, so that no stray file can make this agent number its
#: next segments beyond what the next start accepts.
_SEQ_MAX = (1 << 63) - 1 - (1 << 32)


#: The smallest segment made when the disk has no room for a whole one (some 50 one-GPU changes).
MIN_SEGMENT_BYTES = 16 << 10
#: The errors of a disk with no room left.
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


#: How long a failed write is remembered for the callers whose changes it held: while fewer changes than
#: this were staged after it, and among this many failures (each needs a snapshot written in between).
_FAILED_TICKETS = 1 << 20
_FAILED_KEPT = 4096


def _failure(failed: list[tuple[int, int, OSError]], ticket: int) -> OSError | None:
    """Why the write holding ``ticket`` failed (None when it did not): ``failed`` is in ticket order, and
    a ticket newer than every failure (a write that went well) is answered at the first look."""
    for first, last, why in reversed(failed):
        if last < ticket:
            return None
        if first <= ticket:
            return why
    return None


class NoSegment(OSError):
    """No journal segment can be made or holds the change (a nearly full disk): the caller writes the whole
    state as the snapshot instead, durable before it answers."""


def _fill_zeros(fd: int, size: int) -> None:
    """Write ``size`` zero bytes at the start of a new segment and sync them."""
    zeros = b"\0" * min(size, 1 << 20)
    left = size
    while left > 0:
        left -= os.write(fd, zeros[:left])
    os.fsync(fd)


def _free_bytes(directory: Path) -> int:
    """The bytes free for this process on the file system of ``directory``."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


class JournalError(RuntimeError):
    """A journal segment is damaged (not just cut short at its end); the message names file and offset."""


@dataclass
class Loaded:
    """What :meth:`CheckpointStore.load` found."""

    document: dict[str, Any] | None  # the snapshot with the journal applied; None when neither exists
    replayed: int = 0
    problems: list[str] = field(default_factory=list)  # damaged segments (moved aside)
    #: The snapshot names no journal segment (upstream's, or an odd value): changes journaled from now on
    #: are not replayed over it until a snapshot of ours replaces it.
    unnamed: bool = False
    #: Where each container's entry was last put by the journal, (pod UID, container) -> 'journal <file> at
    #: offset <n>' (an entry not listed is the snapshot's): named when the entry cannot be trusted.
    origins: dict[tuple[str, str], str] = field(default_factory=dict)


#: O_DIRECT's unit: a journal write covers whole blocks of this size, at offsets it divides (4096 suits a
#: disk of 512-byte or 4 KiB sectors; segments are multiples of it).
_BLOCK = 4096
#: The open flag for journal writes past the page cache (0 where the platform has none).
_DIRECT = getattr(os, "O_DIRECT", 0)
#: A segment's aligned write buffer (larger for a larger batch).
_DIRECT_BUFFER = 64 << 10
#: One encoder for every record (``json.dumps`` with these options makes a new one per call).
_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"))


#: One decoder for every record read (``json.loads`` with an option makes a new one per call).
_DECODER = json.JSONDecoder(parse_int=checkpoint.parse_int)


def _record(change: Mapping[str, Any], text: str | None = None) -> bytes:
    """The record of ``change``: length, CRC and its JSON (``text`` when the caller made it already)."""
    body = (_ENCODER.encode(change) if text is None else text).encode()
    return b"%08x %08x " % (len(body), zlib.crc32(body)) + body + b"\n"


def apply(document: dict[str, Any], change: Mapping[str, Any], freed: FreedIndex | None = None) -> None:
    """Apply one journal change (or a batch of them) to a checkpoint document, in place.

    A container's entry (``PodGPUMapping``) is put or deleted by ``put``/``del``; a prepared
    claim's (``Claims``, DRA mode) by ``claim-put``/``claim-del``. ``freed``: the index of the document's
    remembered freed allocations by device ID, kept over a whole replay (without it, each put looks at
    every one).
    """
    if "batch" in change:
        batch = change.get("batch")
        for one in batch if isinstance(batch, list) else []:
            if isinstance(one, Mapping):
                apply(document, one, freed)
        return
    op = change.get("op")
    if op in ("claim-put", "claim-del"):
        claims = document.get("Claims")
        if not isinstance(claims, dict):
            claims = document["Claims"] = {}
        uid = str(change.get("uid", ""))
        if op == "claim-put":
            claims[uid] = change.get("entry")
        else:
            claims.pop(uid, None)
            if not claims:
                document.pop("Claims", None)
        return
    mapping = document.get("PodGPUMapping")
    if not isinstance(mapping, dict):  # null in the snapshot (a list or else is refused before replay)
        mapping = document["PodGPUMapping"] = {}
    pod, container = str(change.get("pod", "")), str(change.get("container", ""))
    if change.get("op") == "put":
        per = mapping.get(pod)
        if not isinstance(per, dict):  # the journal's entry is newer than a malformed one
            per = mapping[pod] = {}
        per[container] = change.get("entry")
        _forget_freed(document, change.get("entry"), freed)
    elif change.get("op") == "del":
        per = mapping.get(pod)
        if isinstance(per, dict):
            per.pop(container, None)
            if not per:
                mapping.pop(pod, None)
        index = freed
        freed_entry = change.get("freed")
        ids = freed_key(freed_entry.get("DeviceIDs")) if isinstance(freed_entry, Mapping) else None
        if ids is not None:
            remembered = document.get(FREED_KEY)
            if not isinstance(remembered, dict):
                remembered = document[FREED_KEY] = {}
            same = remembered.get(ids)
            if not isinstance(same, dict) or list(same) != [pod]:  # those of one pod only, as in memory
                same = remembered[ids] = {pod: {}}
                if index is not None:
                    index.added(remembered, ids)
            same[pod][container] = freed_entry


def freed_key(device_ids: object) -> str | None:
    """The key of ``FREED_KEY`` for these device IDs (None when they are not a non-empty list of strings)."""
    if not isinstance(device_ids, list) or not device_ids or not all(isinstance(i, str) for i in device_ids):
        return None
    return ",".join(sorted(device_ids))


class FreedIndex:
    """The keys of a document's remembered freed allocations (:data:`FREED_KEY`) by each device ID they hold,
    kept over one replay: a put forgets every one sharing an ID with it, as the running agent did, without
    looking at each (up to a journal's thousands of puts over a thousand remembered)."""

    __slots__ = ("_by_id", "_remembered")

    def __init__(self) -> None:
        self._remembered: dict[str, Any] | None = None
        self._by_id: dict[str, set[str]] = {}

    def _over(self, remembered: dict[str, Any]) -> None:
        if remembered is not self._remembered:  # first use, or the document's mapping was made anew
            self._remembered = remembered
            self._by_id = {}
            for key in remembered:
                self.added(remembered, key)

    def added(self, remembered: dict[str, Any], key: str) -> None:
        """``key`` was just remembered in ``remembered``."""
        if remembered is not self._remembered:
            self._over(remembered)
            return
        for one in str(key).split(","):
            self._by_id.setdefault(one, set()).add(key)

    def sharing(self, remembered: dict[str, Any], ids: str) -> list[str]:
        """The keys of ``remembered`` holding any of ``ids`` (comma-joined)."""
        self._over(remembered)
        found: set[str] = set()
        for one in ids.split(","):
            keys = self._by_id.pop(one, None)
            if keys:
                found |= keys
        return [k for k in found if k in remembered]


def _forget_freed(document: dict[str, Any], entry: object, index: FreedIndex | None) -> None:
    """A put of an entry holding some device IDs: the allocations freed with any of them are no longer
    remembered (an Allocate gave them out again, or a container took one over)."""
    remembered = document.get(FREED_KEY)
    if not remembered or not isinstance(remembered, dict) or not isinstance(entry, Mapping):
        return
    ids = freed_key(entry.get("DeviceIDs"))
    if ids is None:
        return
    if index is not None:
        gone = index.sharing(remembered, ids)
    else:
        given = set(ids.split(","))
        gone = [k for k in remembered if not given.isdisjoint(str(k).split(","))]
    for key in gone:
        del remembered[key]
    if not remembered:
        document.pop(FREED_KEY, None)


def _note_origin(origins: dict[tuple[str, str], str], change: Mapping[str, Any], where: str) -> None:
    """Remember where ``change`` put a container's entry (forget it where it deleted one)."""
    if "batch" in change:
        for one in change["batch"]:
            _note_origin(origins, one, where)
        return
    op = change.get("op")
    if op == "put":
        origins[(change["pod"], change["container"])] = where
    elif op == "del":
        origins.pop((change["pod"], change["container"]), None)


class _Segment:
    """One preallocated journal file, written record by record with O_DSYNC.

    Where the file system allows it the file is also opened with O_DIRECT: a record goes to the disk
    without passing through the page cache (a quarter less CPU per durable write, as an Allocate pays
    it), written as the whole :data:`_BLOCK` blocks it touches, the records already in its first block
    kept from memory (writes into a segment only go forward). Refused (EINVAL at the open or the
    first write, as tmpfs does), the segment is written through the page cache as before."""

    def __init__(self, path: Path, fd: int, seq: int, size: int | None = None, *, direct: bool = False) -> None:
        self.path = path
        self.fd = fd
        self.seq = seq
        self.size = SEGMENT_BYTES if size is None else size
        self.offset = 0
        #: A write into it failed: what was staged after the hole would never be read back.
        self.hole = False
        #: Written with O_DIRECT: whole blocks, from :attr:`_buffer` (page-aligned, as O_DIRECT needs).
        self.direct = direct and self.size % _BLOCK == 0
        self._buffer: mmap.mmap | None = None
        self._tail = b""  # what the last write left in its last block, from the block's start
        self._tail_at = 0  # that block's offset

    @classmethod
    def create(cls, path: Path, seq: int, size: int | None = None) -> _Segment:
        """A segment of ``size`` bytes (:data:`SEGMENT_BYTES` when None), zero-filled and synced."""
        size = SEGMENT_BYTES if size is None else size
        path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            try:
                _fill_zeros(fd, size)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink()  # a full disk keeps none of its partial segments
            raise
        fsync_dir(path.parent)
        if _DIRECT:
            try:
                return cls(path, os.open(path, os.O_RDWR | os.O_DSYNC | _DIRECT), seq, size, direct=True)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
        return cls(path, os.open(path, os.O_RDWR | os.O_DSYNC), seq, size)

    def write_at(self, offset: int, data: bytes) -> None:
        """Write records already placed at ``offset`` (durable on return: O_DSYNC)."""
        if self.direct and self._write_direct(offset, data):
            return
        written = os.pwrite(self.fd, data, offset)
        if written != len(data):
            raise OSError(f"short write to {self.path} ({written} of {len(data)} bytes)")

    def _write_direct(self, offset: int, data: bytes) -> bool:
        """Write ``data`` at ``offset`` as whole blocks; False when this segment cannot be written so (it
        is written through the page cache from now on)."""
        start = offset - offset % _BLOCK
        end = offset + len(data)
        length = -(-end // _BLOCK) * _BLOCK
        if length > self.size:
            return self._buffered()
        length -= start
        if start == self._tail_at:  # the block the last write ended in: what it holds so far, zeros after
            head = self._tail[: offset - start].ljust(offset - start, b"\0")
        elif start > self._tail_at:  # a block no write reached yet: zeros
            head = bytes(offset - start)
        else:  # an earlier block (never, as writes only go forward): not kept in memory
            return self._buffered()
        buffer = self._buffer
        if buffer is None or len(buffer) < length:
            if buffer is not None:
                buffer.close()
            buffer = self._buffer = mmap.mmap(-1, max(length, _DIRECT_BUFFER))
        used = len(head) + len(data)
        buffer[: len(head)] = head
        buffer[len(head) : used] = data
        buffer[used:length] = bytes(length - used)
        with memoryview(buffer) as whole, whole[:length] as blocks:
            try:
                written = os.pwrite(self.fd, blocks, start)
            except OSError as exc:
                if exc.errno != errno.EINVAL or start or self._tail:  # refused only at the first write
                    raise
                written = -1
        if written < 0:
            return self._buffered()
        if written != length:
            raise OSError(f"short write to {self.path} ({written} of {length} bytes)")
        self._tail_at = end - end % _BLOCK
        self._tail = bytes(buffer[self._tail_at - start : end - start])
        return True

    def _buffered(self) -> bool:
        """Write this segment through the page cache from now on; False (for :meth:`_write_direct`)."""
        fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~_DIRECT)
        self.direct = False
        if self._buffer is not None:
            self._buffer.close()
            self._buffer = None
        return False

    def room(self, size: int) -> bool:
        return self.offset + size <= self.size

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)
        if self._buffer is not None:
            self._buffer.close()
            self._buffer = None

    def discard(self) -> None:
        self.close()
        with contextlib.suppress(OSError):
            self.path.unlink()


def _write_batch(batch: list[tuple[_Segment, int, bytes]]) -> None:
    """Write staged records: one write per run of adjacent records in one segment (normally one)."""
    if len(batch) == 1:  # the common case: one Allocate's record
        segment, offset, data = batch[0]
        segment.write_at(offset, data)
        return
    start = 0
    while start < len(batch):
        segment, offset, _ = batch[start]
        end = start + 1
        while end < len(batch) and batch[end][0] is segment:
            end += 1
        segment.write_at(offset, b"".join(data for _, _, data in batch[start:end]))
        start = end


def _unwrite(batch: list[tuple[_Segment, int, bytes]]) -> None:
    """Zero the records of a write that failed, best effort. After EIO the page cache may still hold what
    the write copied into it, and a restart (not a reboot) would read those changes back, answered as
    refused, as if they had been made."""
    for segment, offset, data in batch:
        try:
            segment.write_at(offset, bytes(len(data)))
        except OSError as exc:
            log.warning(
                "journal %s: cannot clear the failed write at offset %d (%s); a snapshot replaces it",
                segment.path,
                offset,
                exc,
            )
            return


#: What each operation needs besides ``op``: the keys naming what it changes (strings), and an entry.
_OPS: dict[str, tuple[tuple[str, ...], bool]] = {
    "put": (("pod", "container"), True),
    "del": (("pod", "container"), False),
    "claim-put": (("uid",), True),
    "claim-del": (("uid",), False),
}


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def change_problem(change: Mapping[str, Any], *, in_batch: bool = False) -> str:
    """Why ``change`` is not one this agent writes ('' when it is): an unknown ``op``, a name that is not a
    string, a put without an entry, a batch that is not a flat list of changes. The entry itself is checked
    where the document is read (:func:`gpumanager.allocation.records.from_json`)."""
    if "batch" in change:
        batch = change["batch"]
        if in_batch:
            return "a batch inside a batch"
        if not isinstance(batch, list):
            return f"batch {_shown(batch)} is not a list of changes"
        for one in batch:
            why = change_problem(one, in_batch=True) if isinstance(one, dict) else f"{_shown(one)} is not a change"
            if why:
                return f"in its batch: {why}"
        return ""
    op = change.get("op")
    if not isinstance(op, str) or op not in _OPS:
        return f"op {_shown(op)} is not put, del, claim-put or claim-del"
    keys, entry = _OPS[op]
    for key in keys:
        if not isinstance(change.get(key), str):
            return f"{op}: {key} {_shown(change.get(key))} is not a string"
    if entry and "entry" not in change:
        return f"{op} without an entry"
    return ""


def _parse(data: bytes, pos: int) -> tuple[dict[str, Any] | None, int, str]:
    """The change at ``pos``, the offset after it, and why it cannot be used ('' when it can).

    (None, -1, '') when the record there is damaged (its frame or checksum); (None, offset after it, why)
    when it is whole but holds no change this agent writes (JSON nested too deeply, an unknown op).
    """
    header = data[pos : pos + _HEADER]
    try:
        length, crc = int(header[0:8], 16), int(header[9:17], 16)
    except ValueError:
        return None, -1, ""
    end = pos + _HEADER + length
    body = data[pos + _HEADER : end]
    if len(body) != length or data[end : end + 1] != b"\n" or zlib.crc32(body) != crc:
        return None, -1, ""
    try:
        change = _DECODER.decode(body.decode())  # records are ASCII: anything else is not JSON of ours
    except ValueError:
        return None, end + 1, "not JSON"
    except RecursionError:
        return None, end + 1, "JSON nested too deeply to read"
    if not isinstance(change, dict):
        return None, end + 1, f"a JSON {type(change).__name__}, not an object"
    why = change_problem(change)
    return (None, end + 1, why) if why else (change, end + 1, "")


def _cut_short(data: bytes, pos: int) -> bool:
    """Whether the record at ``pos`` is a write that never completed: the end of what was written.

    Records hold no NUL byte (JSON escapes it), so zeros mark space never written to. A record cut
    short runs into those zeros, holds no record end (a newline) before them, and nothing but zeros
    follows: zeros with records after them, or a length that reaches past records, are damage.
    """
    written = data.find(b"\0", pos)
    written = len(data) if written < 0 else written
    if b"\n" in data[pos:written] or data.find(b"\n", written) >= 0 or data[written:].strip(b"\0"):
        return False
    try:
        length = int(data[pos : pos + 8], 16)
    except ValueError:
        return written - pos < _HEADER
    return pos + _HEADER + length + 1 > written


#: The largest segment read: far beyond the segments this agent writes (a newer version's may be larger),
#: short of what could take the agent's memory.
SEGMENT_LIMIT = 64 * SEGMENT_BYTES


def _segment_bytes(path: Path) -> bytes:
    """A segment's content (OSError naming it when it is no regular file or larger than :data:`SEGMENT_LIMIT`)."""
    return read_regular(path, SEGMENT_LIMIT)


#: Where a record may start after damage: a header right after a record's end or after zeros.
_RECORD_START = re.compile(rb"(?<=[\n\0])[0-9a-f]{8} [0-9a-f]{8} ")


def _next_record(data: bytes, pos: int) -> int:
    """The offset of the first whole record (its frame and checksum match) after ``pos``; -1 when none.

    Each record carries its own checksum, so damage costs the records it covers, not the rest of its segment.
    """
    newline = -1  # the first newline after the header being looked at (they only move forward)
    for match in _RECORD_START.finditer(data, pos + 1):
        start = match.start()
        # Records hold no newline but their last byte: checked before the checksum, so that a long run of
        # damage is read once, not once per header-like text in it.
        if newline < start + _HEADER:
            newline = data.find(b"\n", start + _HEADER)
            if newline < 0:
                return -1
        if newline == start + _HEADER + int(data[start : start + 8], 16) and _parse(data, start)[1] >= 0:
            return start
    return -1


def _read_segment(data: bytes, path: Path, last: bool) -> tuple[list[tuple[int, dict[str, Any]]], str, int]:
    """The changes of one segment with their offsets, a problem ('' when it is whole or only cut short at
    its end), and the offset of a last record cut short (-1 when there is none). Past damage (a record whose
    frame or checksum does not match, zeros with records after them) reading goes on at the next whole
    record."""
    changes: list[tuple[int, dict[str, Any]]] = []
    skipped: list[str] = []  # damage, and whole records holding no change this agent writes; the rest replayed
    pos = 0
    while pos < len(data):
        if data[pos] == 0:
            # Nothing but zeros after: the free rest of the segment (a newline is looked for first: it
            # stops at the next record, where zeros to the end would be read through at every gap).
            if data.find(b"\n", pos) < 0 and not data[pos:].strip(b"\0"):
                break
            skipped.append(f"zeros at offset {pos} with records after them")
        else:
            change, after, why = _parse(data, pos)
            if after >= 0:
                if change is None:
                    skipped.append(f"record at offset {pos} skipped: {why}")
                else:
                    changes.append((pos, change))
                pos = after
                continue
            if last and _cut_short(data, pos):
                log.info("journal %s: last record cut short at offset %d (a crash while writing); ignored", path, pos)
                return changes, _skipped(path, skipped), pos
            skipped.append(f"damaged record at offset {pos}")
        pos = _next_record(data, pos)
        if pos < 0:
            break
        skipped.append(f"records from offset {pos} replayed")
    return changes, _skipped(path, skipped), -1


def _erase_cut_short(path: Path, data: bytes, pos: int) -> None:
    """Zero a record cut short at ``pos`` (never answered), so that the segment reads as whole once later
    segments follow it; a failure is logged (the next start then reports the segment as damaged)."""
    end = data.find(b"\0", pos)
    end = len(data) if end < 0 else end
    try:
        fd = os.open(path, os.O_WRONLY)
        try:
            if os.pwrite(fd, b"\0" * (end - pos), pos) != end - pos:
                raise OSError(errno.EIO, "short write")
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        log.warning(
            "journal %s: cannot clear the record cut short at offset %d (%s); the next start reports it as damage",
            path,
            pos,
            exc,
        )


def _skipped(path: Path, problems: list[str]) -> str:
    """One problem line for a segment ('' when it has none; the first few problems when it has many)."""
    if len(problems) > 5:
        problems = [*problems[:4], f"{len(problems) - 4} more problems"]
    return f"journal {path}: {'; '.join(problems)}" if problems else ""


class CheckpointStore:
    """The snapshot and its journal.

    :meth:`stage`, :meth:`record`, :meth:`switch` and :meth:`load` are called under the allocator's
    lock; :meth:`sync`, :meth:`write_snapshot` and :meth:`make_spare` may run outside it (the
    compactor, a caller waiting for its change).
    """

    def __init__(self, path: Path, *, idle_compact: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self._segment: _Segment | None = None
        self._spare: _Segment | None = None
        self._seq = 0
        self._active_seq = 0
        self._idle = idle_compact
        self._clock = clock
        self._snap_lock = threading.Lock()
        self._snapshot_seq = -1
        self.dirty_since: float | None = None  # first change not yet in the snapshot
        self.records = 0
        # Group commit. Tickets number the staged changes; every ticket <= _done was written or failed.
        #: The io condition's lock; taken directly on the Allocate path (the condition's own
        #: ``with`` is a Python call on entry and on exit).
        self._io_lock = threading.RLock()
        self._io = threading.Condition(self._io_lock)
        self._pending: list[tuple[_Segment, int, bytes]] = []  # (segment, offset, record), in ticket order
        self._staged = 0
        self._done = 0
        self._flushing = False
        self._broken: OSError | None = None  # a write failed: every change fails until a snapshot is written
        self._failed: list[tuple[int, int, OSError]] = []  # (first, last ticket, why), in ticket order
        self._switched_at = 0  # the last ticket staged before the newest segment switch
        #: Changes written and flushed (for metrics).
        self.durable_records = 0
        #: Told of each durable write, (kind, seconds): ``"journal"`` for one write of the records staged so
        #: far (what an Allocate waits for), ``"snapshot"`` for the whole state, its encoding included. Inside a
        #: device-plugin call, once its answer has left (:func:`gpumanager.deferred.later`); elsewhere (the
        #: DRA driver's calls, background writes) at once, the store's io lock perhaps held: it must be quick
        #: and never call back into the store. Never for a write that failed.
        self.on_write: Callable[[str, float], None] | None = None
        #: The disk had no room for a whole segment lately: what was said about it ('' when it had).
        self._short_said: set[str] = set()

    def _segment_path(self, seq: int) -> Path:
        return self.path.with_name(f"{self.path.name}.journal-{seq}")

    def _segments(self) -> list[tuple[int, Path]]:
        """The live segments, ``<name>.journal-<seq>`` (not a damaged one moved aside as ``.corrupt-<time>[-<n>]``,
        nor a ``.tmp`` being prepared)."""
        return [(seq, p) for seq, p in self._numbered() if seq <= _SEQ_MAX]

    def _numbered(self) -> list[tuple[int, Path]]:
        """Every ``<name>.journal-<digits>`` file, by number (those beyond :data:`_SEQ_MAX` too)."""
        prefix = self.path.name + ".journal-"
        found = []
        for p in self.path.parent.glob(prefix + "*"):
            tail = p.name[len(prefix) :]
            if tail.isascii() and tail.isdigit():
                found.append((int(tail), p))
        return sorted(found)

    def exists(self) -> bool:
        """Whether a snapshot or a journal segment is on disk."""
        return self.path.exists() or bool(self._numbered())

    def load(self, *, quarantine: bool = True) -> Loaded:
        """The snapshot with every journal change applied (raises checkpoint.CheckpointError when the
        snapshot itself is unusable; it is left for the caller to move aside, with
        :meth:`set_aside_segments`). A damaged segment is moved aside when ``quarantine``."""
        segments = self._segments()
        beyond = [p for seq, p in self._numbered() if seq > _SEQ_MAX]
        for path in beyond:  # no number this agent writes; counted, it would number new segments past any
            problem = f"journal {path}: its number is beyond {_SEQ_MAX}, not a segment this agent wrote; not read"
            if quarantine:
                self._set_aside(path, problem)
            else:
                log.warning("%s", problem)
        for seq, _ in segments:  # known before the snapshot is read: new segments never reuse a number
            self._seq = max(self._seq, seq)
        if quarantine:
            self._remove_partial_segments()
        snapshot = checkpoint.read_json(self.path)
        if snapshot is None and not segments:
            return Loaded(None)
        document: dict[str, Any] = dict(snapshot) if snapshot is not None else {"PodGPUMapping": {}}
        raw = document.pop(JOURNAL_KEY, None)
        first = raw if type(raw) is int and 0 <= raw <= _SEQ_MAX else None
        odd_key = ""
        if raw is not None and first is None:
            odd_key = f"{self.path} names {JOURNAL_KEY} {_shown(raw)}, not a segment number"
            log.warning("%s: no segment is known to continue it", odd_key)
        if first is not None:
            # New segments continue this snapshot: never numbered below it, or the next start skips them.
            self._seq = max(self._seq, first - 1)
        loaded = Loaded(document, unnamed=snapshot is not None and first is None)
        freed = FreedIndex()
        if not isinstance(document.get("PodGPUMapping") or {}, dict):
            return loaded  # the caller reports the shape
        contents: list[tuple[Path, bytes | None, str]] = []
        for _, path in segments:
            try:
                contents.append((path, _segment_bytes(path), ""))
            except FileNotFoundError:
                raise  # removed by the running agent's compaction under a reader: it starts again
            except OSError as exc:
                contents.append((path, None, f"journal {path}: cannot read it: {exc}"))
        # The last segment written to: a spare made ahead of need (all zeros) may follow it.
        last = max((i for i, (_, data, _) in enumerate(contents) if data and data.strip(b"\0")), default=-1)
        for i, (path, data, problem) in enumerate(contents):
            if snapshot is not None and first is not None and segments[i][0] < first:
                continue  # held by the snapshot already (left behind by a removal that failed)
            if data is not None:
                changes, problem, cut = _read_segment(data, path, last=i == last)
                if cut >= 0 and quarantine:
                    _erase_cut_short(path, data, cut)
                if changes and snapshot is not None and odd_key:
                    problem = f"journal {path} holds {len(changes)} changes, but {odd_key}; not replayed over it"
                    changes = []
                elif changes and snapshot is not None and first is None:
                    # A snapshot without our key was rewritten by another program after these changes
                    # (upstream's gpu-manager after a downgrade, or an older version of this agent):
                    # replayed over it, they would bring back what it has released since.
                    problem = (
                        f"journal {path} holds {len(changes)} changes made before {self.path} was rewritten by "
                        "another program (upstream gpu-manager after a downgrade, or an older version of this "
                        "agent); not replayed over it"
                    )
                    changes = []
                for offset, change in changes:
                    apply(document, change, freed)
                    _note_origin(loaded.origins, change, f"journal {path} at offset {offset}")
                loaded.replayed += len(changes)
            if problem:
                loaded.problems.append(problem)
                if quarantine:
                    self._keep_aside(path, data, problem)
        return loaded

    def _keep_aside(self, path: Path, data: bytes | None, problem: str) -> None:
        """Keep a copy of a damaged segment aside for the operator; the segment itself stays in place
        until the snapshot written at this start holds what was read from it (:meth:`write_snapshot`
        removes it): moved now, a start that died before that snapshot would leave the next one without
        its whole records, and without a word of the damage."""
        if data is None:  # it cannot be read: nothing of it is replayed, and nothing lost by moving it
            self._set_aside(path, problem)
            return
        try:
            aside = checkpoint.copy_aside(path, data)
        except OSError as exc:
            log.error("%s; could not keep a copy of it (%s); the kubelet's records fill what it lost", problem, exc)
        else:
            log.error(
                "%s; a copy is kept as %s, and the segment stays until this start's snapshot replaces it (the "
                "kubelet's records fill what it lost)",
                problem,
                aside,
            )

    def _set_aside(self, path: Path, problem: str) -> None:
        try:
            aside = checkpoint.move_aside(path)
        except OSError as exc:
            log.error("%s; could not move it aside (%s); the kubelet's records fill what it lost", problem, exc)
        else:
            log.error("%s; moved aside as %s (the kubelet's records fill what it lost)", problem, aside)

    def set_aside_segments(self, why: str) -> None:
        """Move every live segment aside (the snapshot they apply to was unusable and is set aside)."""
        for _, path in self._segments():
            self._set_aside(path, f"journal {path}: {why}")

    def _remove_partial_segments(self) -> None:
        """Remove segments whose preparation never finished (``<name>.journal-<seq>.tmp``), and temp files
        of snapshot writes a crash cut short (``.<name>.<random>``, never renamed into place)."""
        for path in self.path.parent.glob(self.path.name + ".journal-*.tmp"):
            with contextlib.suppress(OSError):
                path.unlink()
                log.info("removed %s, a journal segment whose preparation never finished", path)
        for path in self.path.parent.glob(f".{self.path.name}.*"):
            with contextlib.suppress(OSError):
                if path.is_file() and not path.is_symlink():
                    path.unlink()
                    log.info("removed %s, a snapshot whose writing never finished", path)

    def record(self, change: Mapping[str, Any]) -> None:
        """Make one change durable now (raises OSError when it cannot be written)."""
        self.sync(self.stage(change))

    def stage(self, change: Mapping[str, Any], text: str | None = None) -> int:
        """Queue one change (under the allocator's lock, so changes keep their order); returns the
        ticket to :meth:`sync` before answering. Raises OSError when changes cannot be written now.
        ``text``: the change as compact JSON with sorted keys, when the caller has it (the same bytes
        the encoder would write)."""
        data = _record(change, text)
        with self._io_lock:
            if self._broken is not None:
                why = self._broken.strerror or str(self._broken)
                raise OSError(self._broken.errno, f"{why} (journal not written since)")
            size = len(data)
            segment = self._segment
            if segment is None or segment.hole or segment.offset + size > segment.size:  # not segment.room()
                self._switch_locked()
                segment = self._segment
            if segment is None:
                raise NoSegment(errno.ENOSPC, f"no room for a journal segment beside {self.path}")
            if segment.offset + size > segment.size:
                if segment.size < SEGMENT_BYTES:
                    raise NoSegment(errno.ENOSPC, f"a change of {len(data)} bytes does not fit a small segment")
                raise OSError(f"a change of {len(data)} bytes does not fit a journal segment")
            self._pending.append((segment, segment.offset, data))
            segment.offset += size
            self._staged += 1
            self.records += 1
            if self.dirty_since is None:
                self.dirty_since = self._clock()
            return self._staged

    def sync(self, ticket: int) -> None:
        """Return once the change of ``ticket`` is durable (outside the allocator's lock); OSError when it
        could not be written. Writes every change staged so far unless another caller is doing so."""
        with self._io_lock:
            while self._done < ticket:
                if self._flushing:
                    self._io.wait()
                    continue
                self._flush_locked(release=True)
            failed = _failure(self._failed, ticket) if self._failed else None
        if failed is not None:
            raise OSError(failed.errno, failed.strerror or str(failed))

    def durable(self, ticket: int) -> bool:
        """Whether ``ticket`` has been written (successfully or not): :meth:`sync` would not wait."""
        with self._io:
            return self._done >= ticket

    def _flush_locked(self, *, release: bool) -> None:
        """Write every staged change (the io lock held; released while writing when ``release``)."""
        batch, upto = self._pending, self._staged
        self._pending = []
        if not batch:
            self._done = upto
            return
        error = self._broken
        self._flushing = True
        if release:
            self._io.release()
        if error is None and (batch[0][0].hole if len(batch) == 1 else any(s.hole for s, _, _ in batch)):
            # Staged behind a write that failed (before the failure was known): never read back.
            error = OSError(errno.EIO, "staged behind a journal write that failed")
        took = -1.0
        try:
            if error is None:
                started = time.perf_counter()
                _write_batch(batch)
                took = time.perf_counter() - started
        except OSError as exc:
            error = exc
            for segment, _, _ in batch:
                segment.hole = True
            _unwrite(batch)
        finally:
            if release:
                self._io.acquire()
            self._flushing = False
        if error is None:
            self.durable_records += len(batch)
            if self.on_write is not None and took >= 0:
                deferred.later(self.on_write, "journal", took)
        else:
            self._broken = error
            # Kept until no caller can still be looking for them: a caller preempted between staging and
            # waiting must learn of the failure even after many more (each followed by a snapshot).
            floor = upto - _FAILED_TICKETS
            kept = [f for f in self._failed[-(_FAILED_KEPT - 1) :] if f[1] >= floor]
            self._failed = [*kept, (self._done + 1, upto, error)]
        self._done = upto
        self._io.notify_all()

    def switch(self) -> int:
        """Start a new journal segment (the spare one when it is ready); returns its sequence number.

        Every change staged before this call is written first, into older segments, which a snapshot
        of the state at this moment makes unnecessary (:meth:`write_snapshot`).
        """
        with self._io:
            return self._switch_locked()

    def switched_since(self, ticket: int) -> bool:
        """Whether the segment was switched (and so a snapshot may have been taken) after ``ticket`` was staged."""
        with self._io:
            return self._switched_at >= ticket

    def _switch_locked(self) -> int:
        while self._flushing:
            self._io.wait()
        self._flush_locked(release=False)
        self._switched_at = self._staged
        spare, self._spare = self._spare, None
        if self._segment is not None:
            self._segment.close()
            self._segment = None
        if spare is None or spare.seq <= self._active_seq:
            if spare is not None:
                spare.discard()
            self._seq += 1
            spare = self._new_segment(self._seq)
            if spare is None:  # a full disk: changes are written as whole snapshots until one can be made
                self._active_seq = self._seq
                return self._seq
        self._segment = spare
        self._active_seq = spare.seq
        return spare.seq

    def reserve(self) -> int:
        """A sequence number for a spare segment, 0 when one is ready (under the lock)."""
        if self._spare is not None:
            return 0
        self._seq += 1
        return self._seq

    def make_spare(self, seq: int) -> _Segment | None:
        """Create the reserved segment, zero-filled and synced (outside the lock); None when there is no
        room for one (the next switch tries again)."""
        return self._new_segment(seq) if seq else None

    def _new_segment(self, seq: int) -> _Segment | None:
        """A new segment: a whole one, else (a nearly full disk) the largest that leaves half the free room
        to the snapshot, down to :data:`MIN_SEGMENT_BYTES`; None when not even that can be made. Errors
        other than a full disk are raised."""
        path = self._segment_path(seq)
        why: OSError = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        if not self._short_said:
            try:
                return _Segment.create(path, seq)
            except OSError as exc:
                if exc.errno not in _DISK_FULL:
                    raise
                why = exc
        try:
            free = _free_bytes(path.parent)
        except OSError:
            free = 0
        size = SEGMENT_BYTES if self._short_said else SEGMENT_BYTES // 2  # a whole one just failed
        while size > free // 2 and size >= MIN_SEGMENT_BYTES:
            size //= 2
        while size >= MIN_SEGMENT_BYTES:
            try:
                segment = _Segment.create(path, seq, None if size == SEGMENT_BYTES else size)
            except OSError as exc:
                if exc.errno not in _DISK_FULL:
                    raise
                why, size = exc, size // 2
                continue
            self._short_of_room(size, why)
            return segment
        self._short_of_room(0, why)
        return None

    def _short_of_room(self, size: int, why: OSError) -> None:
        """Say once what a full disk makes the journal do (and once when it has room again)."""
        if size == SEGMENT_BYTES:
            if self._short_said:
                self._short_said = set()
                log.info("checkpoint %s: room for whole journal segments again", self.path)
            return
        state = "small" if size else "none"
        if state in self._short_said:
            return
        self._short_said.add(state)
        reason = why.strerror or str(why)
        if size:
            log.warning(
                "checkpoint %s: no room for a journal segment of %d KiB (%s); using segments of %d KiB",
                self.path,
                SEGMENT_BYTES >> 10,
                reason,
                size >> 10,
            )
        else:
            log.warning(
                "checkpoint %s: no room for a journal segment of even %d KiB (%s); every change is written as "
                "the whole snapshot before it is answered, until the disk has room again",
                self.path,
                MIN_SEGMENT_BYTES >> 10,
                reason,
            )

    def set_spare(self, segment: _Segment | None) -> None:
        """Keep a prepared segment for the next :meth:`switch` (under the lock)."""
        if segment is None:
            return
        if self._spare is None and segment.seq > self._active_seq:
            self._spare = segment
        else:
            segment.discard()

    def write_snapshot(self, document: Mapping[str, Any], seq: int) -> None:
        """Write the state as of :meth:`switch` number ``seq``; then older segments go. A snapshot older
        than one already written is skipped."""
        with self._snap_lock:
            if seq <= self._snapshot_seq:
                return
            started = time.perf_counter()
            checkpoint.write_json(self.path, {**document, JOURNAL_KEY: seq})
            if self.on_write is not None:
                deferred.later(self.on_write, "snapshot", time.perf_counter() - started)
            self._snapshot_seq = seq
            with self._io:
                self._broken = None  # the whole state is on disk: the journal starts afresh
            for old_seq, path in self._segments():  # oldest first: what stays is a run the newest end of
                if old_seq >= seq:
                    break
                try:
                    path.unlink()
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    log.warning("cannot remove journal segment %s (%s); it is read again at the next start", path, exc)
                    break

    def mark_clean(self) -> None:
        """Everything recorded so far is in the snapshot being written."""
        self.dirty_since = None

    def due(self) -> bool:
        """Whether the snapshot should be brought up to date now (changes idle for a moment)."""
        return self.dirty_since is not None and self._clock() - self.dirty_since >= self._idle

    def close(self) -> None:
        """Write what is staged, close the open segments (the spare one is removed)."""
        with self._io:
            while self._flushing:
                self._io.wait()
            with contextlib.suppress(OSError):
                self._flush_locked(release=False)
        if self._segment is not None:
            self._segment.close()
            self._segment = None
        if self._spare is not None:
            self._spare.discard()
            self._spare = None


#: How many times a reader starts again when the running agent compacts the journal under it.
READ_ATTEMPTS = 20


def _files_version(path: Path) -> tuple[tuple[int, int, int] | None, tuple[str, ...]]:
    """The snapshot's identity (inode, size, mtime) and the segment names: what a compaction changes."""
    try:
        st = path.stat()
        snapshot: tuple[int, int, int] | None = (st.st_ino, st.st_size, st.st_mtime_ns)
    except FileNotFoundError:
        snapshot = None
    return snapshot, tuple(sorted(str(p) for _, p in CheckpointStore(path)._segments()))


def read_document(path: Path) -> dict[str, Any] | None:
    """The current checkpoint document at ``path``: the snapshot with its journal applied (for tools).

    The agent may be running: a compaction that replaces the snapshot and removes segments while they
    are read would give a document missing changes, or a segment gone half-way; the read starts again
    until the files stayed the same throughout. Raises OSError when they never do."""
    for _ in range(READ_ATTEMPTS):
        before = _files_version(path)
        try:
            document = CheckpointStore(path).load(quarantine=False).document
        except FileNotFoundError:
            continue
        if _files_version(path) == before:
            return document
    raise OSError(f"{path}: the checkpoint kept changing while it was read ({READ_ATTEMPTS} attempts)")
