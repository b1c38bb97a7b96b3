"""The simulated GPU node from Python: node specs, the shared run-time state file, and helpers.

The simulated driver (``vcuda/sim``, a stand-in ``libnvidia-ml.so.1``) reads a node spec, named
by ``GPUSIM_SPEC``, and keeps run-time state (lost GPUs, XID events, processes, utilisation) in
a binary file named by ``GPUSIM_STATE`` that every process on the simulated node shares.  This
module reads and writes that file with the same layout and the same lock as the C code, so
tests and demos can change what NVML reports while programs run.

State file layout (``vcuda/sim/gpusim_state_layout.h`` is the reference; all integers native
little-endian)::

    0      header (256 bytes): magic "GPUSIMST", layout_version=1, header_size=4096, file_size,
           change_counter, event_next_seq, created_us, section_count, reserved
    256    section directory: 16 x {id, entry_size, entry_count, flags, offset, reserved}
    4096   GPUS   (id 1):   64 x 2048 bytes: flags (bit 0 lost), util_gpu, util_memory,
                            util_updated_us, sample_count, lost_since_us, used_peak (highest
                            memory in use, all processes: a diagnostic), 120 util samples
    135168 EVENTS (id 2): ring of 1024 x 48 bytes {seq, event_type, event_data, time_us, gpu};
                            event ``seq`` lives in slot ``seq % entry_count``
    184320 PROCS  (id 3): 1024 x 48 bytes {pid, gpu, used_bytes, flags (bit 0 in use, bit 1
                            written by the simulated libcuda: reaped when the process is gone),
                            sm_util, mem_util, updated_us, owner_start}
    233472 TIMELINE (id 4): 64 x 188416 bytes: simulated GPU time per GPU (a process-shared
                            mutex, seqlock counter, device and per-process busy time, run queues);
                            read here without the mutex through the seqlock (``timeline()``)

Readers locate sections through the directory and index entries with its ``entry_size``, so
later layouts may append fields to entries or add sections.  Every access holds
``flock(LOCK_EX)`` on the file (and a thread lock, since flock does not separate threads
sharing one open file); every mutation increments ``change_counter`` and wakes the processes
blocked on it (a futex on its low half: the simulated driver's ``nvmlEventSetWait``).
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import logging
import mmap
import os
import platform
import re
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

logger = logging.getLogger(__name__)

STATE_MAGIC = b"GPUSIMST"
LAYOUT_VERSION = 1
HEADER_SIZE = 4096
MAX_SECTIONS = 16
MAX_GPUS = 64
EVENT_RING = 1024
MAX_PROCS = 1024
UTIL_SAMPLES = 120
SECTION_GPUS = 1
SECTION_EVENTS = 2
SECTION_PROCS = 3
SECTION_TIMELINE = 4
TL_SLOTS = 16  # per GPU: processes with simulated kernels
TL_DEPTH = 1024
TL_ENDS = 256
TL_CKPTS = 128
GPU_LOST = 0x1
#: Calls that take the GPU block while set (a GPU stuck in reset): ``gpusim hang``.
GPU_HUNG = 0x2
#: MIG mode on (answered by MIG-capable models only: compute capability 8.0, 9.0, 10.0): ``gpusim mig``.
GPU_MIG = 0x4
#: Bits 8-9 of a GPU's flags: its compute mode (``gpusim compute-mode``), as nvmlComputeMode_t numbers them.
GPU_COMPUTE_MODE_SHIFT = 8
GPU_COMPUTE_MODE_MASK = 0x300
COMPUTE_MODES = {"DEFAULT": 0, "EXCLUSIVE_THREAD": 1, "PROHIBITED": 2, "EXCLUSIVE_PROCESS": 3}
PROC_IN_USE = 0x1
PROC_CUDA = 0x2  # entry of a simulated-libcuda process (its device memory); reaped when it is gone
PROC_GRAPHICS = 0x4  # a graphics context: listed by nvmlDeviceGetGraphicsRunningProcesses, not the compute list
EVENT_TYPE_XID = 0x8  # nvmlEventTypeXidCriticalError
NVLINK_MAX_LINKS = 18  # NVML_NVLINK_MAX_LINKS of the nvml.h the simulator is built against
TOPOLOGY_LEVELS = (0, 10, 20, 30, 40, 50)  # NVML_TOPOLOGY_INTERNAL .. NVML_TOPOLOGY_SYSTEM
SERIAL_BASE = 1320224000000  # the simulated serial of GPU i is f"{SERIAL_BASE + i:013d}"

_HEADER = struct.Struct("<8sIIQQQQII200s")
_SECTION = struct.Struct("<IIIIQQ")
_GPU_HEAD = struct.Struct("<IIIIQQQ88s")
_SAMPLE = struct.Struct("<QII")
_EVENT = struct.Struct("<QQQQIIQ")
_PROC = struct.Struct("<IIQIIIIQQ")
_OFF_CHANGE_COUNTER = 24
_OFF_EVENT_NEXT_SEQ = 32
_GPU_ENTRY_SIZE = _GPU_HEAD.size + UTIL_SAMPLES * _SAMPLE.size
_GPUS_OFFSET = HEADER_SIZE
_EVENTS_OFFSET = _GPUS_OFFSET + MAX_GPUS * _GPU_ENTRY_SIZE
_PROCS_OFFSET = _EVENTS_OFFSET + EVENT_RING * _EVENT.size
# TIMELINE entry (gpusim_state_layout.h struct gpusim_tl_gpu): mutex[64], init, active, seq, now_ns,
# busy_ns, kernels_done, cur, reserved, slice_left_ns, ck_count, ck_next_ns, ...; slots at 2304.
_TL_HEAD = struct.Struct("<64xIIQQQQ")
_TL_SLOT_HEAD = struct.Struct("<IIQQQQQ")  # pid, flags, owner_start, busy_ns, head_seq, tail_seq, head_left_ns
_TL_SLOTS_OFFSET = 2304
_TL_SLOT_SIZE = 128 + 8 * (TL_CKPTS + TL_ENDS + TL_DEPTH)
_TL_ENTRY_SIZE = 188416
_TIMELINE_OFFSET = _PROCS_OFFSET + MAX_PROCS * _PROC.size
FILE_SIZE = _TIMELINE_OFFSET + MAX_GPUS * _TL_ENTRY_SIZE

_UUID_RE = re.compile(r"GPU-[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
_BUS_RE = re.compile(r"([0-9a-fA-F]{4}|[0-9a-fA-F]{8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])")


# ---- node spec --------------------------------------------------------------------------------


# Device memory of one CUDA context per known GPU model (MiB), as vcuda/sim/sim_spec.c's model table has it.
_CONTEXT_MIB_BY_CC = {(7, 5): 250, (7, 0): 300, (8, 6): 250, (8, 0): 400, (8, 9): 250, (9, 0): 500}
_MODEL_CC = {
    "Tesla T4": (7, 5),
    "Tesla V100-PCIE-16GB": (7, 0),
    "Tesla V100-PCIE-32GB": (7, 0),
    "Tesla V100-SXM2-16GB": (7, 0),
    "Tesla V100-SXM2-32GB": (7, 0),
    "NVIDIA A10": (8, 6),
    "NVIDIA A100-SXM4-40GB": (8, 0),
    "NVIDIA A100-SXM4-80GB": (8, 0),
    "NVIDIA A100-PCIE-40GB": (8, 0),
    "NVIDIA A100 80GB PCIe": (8, 0),
    "NVIDIA L4": (8, 9),
    "NVIDIA H100 PCIe": (9, 0),
    "NVIDIA H100 80GB HBM3": (9, 0),
    "NVIDIA H200": (9, 0),
}
DEFAULT_CONTEXT_MIB = 300  # a model the table does not know


def context_mib_of_model(name: str) -> int:
    """The simulator's context size for a GPU model name (MiB)."""
    cc = _MODEL_CC.get(name)
    return _CONTEXT_MIB_BY_CC[cc] if cc is not None else DEFAULT_CONTEXT_MIB


class SpecError(ValueError):
    """An invalid node spec; the message reads ``<file>: <field>: <problem>``."""


@dataclass(frozen=True)
class GpuSpec:
    """One GPU of a node spec; ``index`` is its NVML index."""

    index: int
    uuid: str
    name: str
    minor: int
    memory_mib: int
    pci_bus_id: str  # normalised: 8-digit domain, upper case, e.g. "00000000:18:00.0"
    numa_node: int
    sm_count: int
    multi_gpu_board: bool
    sm_threads_per_us: int = 1024  # the simulated kernel cost model's rate (optional spec field)
    context_mib: int | None = None  # device memory one CUDA context takes (optional; None: the model's)

    @property
    def context_bytes(self) -> int:
        """Device memory each CUDA context takes on this GPU (the spec's, else its model's)."""
        mib = self.context_mib if self.context_mib is not None else context_mib_of_model(self.name)
        return mib * 1024 * 1024

    @property
    def serial(self) -> str:
        """The serial number the simulator invents for this GPU."""
        return f"{SERIAL_BASE + self.index:013d}"

    @property
    def memory_bytes(self) -> int:
        """Total device memory in bytes."""
        return self.memory_mib * 1024 * 1024


@dataclass(frozen=True)
class NvLinkSpec:
    """``active_links`` NVLink links between two GPUs."""

    gpu_a: int
    gpu_b: int
    links: int


@dataclass(frozen=True)
class NodeSpec:
    """A validated node spec (see vcuda/sim/README.md for the format)."""

    source: str
    driver_version: str
    cuda_driver_version: int
    gpus: tuple[GpuSpec, ...]
    topology: tuple[tuple[int, ...], ...]
    nvlink: tuple[NvLinkSpec, ...]

    def nvlink_links(self, a: int, b: int) -> int:
        """Number of NVLink links between GPUs a and b (0 when not linked)."""
        for link in self.nvlink:
            if {link.gpu_a, link.gpu_b} == {a, b}:
                return link.links
        return 0


def _is_int(value: object, lo: int, hi: int) -> bool:
    return type(value) is int and lo <= value <= hi


class _SpecChecker:
    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, field: str, problem: str) -> SpecError:
        return SpecError(f"{self.source}: {field}: {problem}")

    def integer(self, obj: Mapping[str, object], key: str, field: str, lo: int, hi: int, expect: str) -> int:
        if key not in obj:
            raise self.fail(field, f"missing (expected {expect})")
        value = obj[key]
        if not _is_int(value, lo, hi):
            raise self.fail(field, f"expected {expect}")
        assert isinstance(value, int)
        return value

    def string(self, obj: Mapping[str, object], key: str, field: str, max_len: int, expect: str) -> str:
        if key not in obj:
            raise self.fail(field, f"missing (expected {expect})")
        value = obj[key]
        if not isinstance(value, str) or not value or len(value.encode()) > max_len:
            raise self.fail(field, f"expected {expect}")
        return value

    def gpu(self, index: int, raw: object, seen: list[GpuSpec]) -> GpuSpec:
        if not isinstance(raw, dict):
            raise self.fail(f"gpus[{index}]", "expected an object")
        f = f"gpus[{index}]."
        uuid_expect = "a UUID string like GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"
        uuid = self.string(raw, "uuid", f + "uuid", 47, uuid_expect)
        if not _UUID_RE.fullmatch(uuid):
            raise self.fail(f + "uuid", f'expected {uuid_expect}, got "{uuid}"')
        name = self.string(raw, "name", f + "name", 95, "a non-empty string of at most 95 characters")
        minor = self.integer(raw, "minor", f + "minor", 0, 254, "an integer from 0 to 254")
        memory = self.integer(raw, "memory_mib", f + "memory_mib", 1, 1 << 30, "a positive integer")
        bus_expect = "a PCI bus id like 00000000:18:00.0"
        bus = self.string(raw, "pci_bus_id", f + "pci_bus_id", 63, bus_expect)
        m = _BUS_RE.fullmatch(bus)
        if not m or int(m.group(3), 16) > 0x1F:
            raise self.fail(f + "pci_bus_id", f'expected {bus_expect}, got "{bus}"')
        bus = f"{int(m.group(1), 16):08X}:{m.group(2).upper()}:{m.group(3).upper()}.{m.group(4)}"
        numa = self.integer(raw, "numa_node", f + "numa_node", 0, 1023, "an integer from 0 to 1023")
        sms = self.integer(raw, "sm_count", f + "sm_count", 1, 1_000_000, "a positive integer")
        board = raw.get("multi_gpu_board")
        if not isinstance(board, bool):
            problem = "missing (expected a boolean)" if "multi_gpu_board" not in raw else "expected a boolean"
            raise self.fail(f + "multi_gpu_board", problem)
        rate = 1024
        if "sm_threads_per_us" in raw:
            rate = self.integer(raw, "sm_threads_per_us", f + "sm_threads_per_us", 1, 10**9, "a positive integer")
        ctx = None
        if "context_mib" in raw:
            ctx = self.integer(raw, "context_mib", f + "context_mib", 0, 1 << 20, "an integer from 0 to 1048576")
        gpu = GpuSpec(index, uuid, name, minor, memory, bus, numa, sms, board, rate, ctx)
        for other in seen:
            if other.uuid.lower() == gpu.uuid.lower():
                raise self.fail(f + "uuid", f"duplicate of gpus[{other.index}].uuid ({gpu.uuid})")
            if other.minor == gpu.minor:
                raise self.fail(f + "minor", f"duplicate of gpus[{other.index}].minor ({gpu.minor})")
            if other.pci_bus_id == gpu.pci_bus_id:
                raise self.fail(f + "pci_bus_id", f"duplicate of gpus[{other.index}].pci_bus_id ({bus})")
        return gpu

    def topology(self, raw: object, n: int) -> tuple[tuple[int, ...], ...]:
        if not isinstance(raw, list):
            what = "missing" if raw is None else "not an array"
            raise self.fail("topology", f"{what} (expected an array of {n} rows of {n} levels)")
        if len(raw) != n:
            raise self.fail("topology", f"expected {n} rows (one per GPU), got {len(raw)}")
        rows: list[tuple[int, ...]] = []
        for i, row in enumerate(raw):
            if not isinstance(row, list) or len(row) != n:
                raise self.fail(f"topology[{i}]", f"expected an array of {n} levels")
            for j, level in enumerate(row):
                if not (type(level) is int and level in TOPOLOGY_LEVELS):
                    raise self.fail(f"topology[{i}][{j}]", "expected one of 0, 10, 20, 30, 40, 50")
                if i == j and level != 0:
                    raise self.fail(f"topology[{i}][{j}]", "expected 0 on the diagonal")
            rows.append(tuple(row))
        for i in range(n):
            for j in range(i):
                if rows[i][j] != rows[j][i]:
                    raise self.fail(
                        f"topology[{i}][{j}]",
                        f"expected {rows[j][i]}, the value of topology[{j}][{i}] (the matrix must be symmetric)",
                    )
        return tuple(rows)

    def nvlink(self, raw: object, n: int) -> tuple[NvLinkSpec, ...]:
        if raw is None:
            return ()
        if not isinstance(raw, list):
            raise self.fail("nvlink", "expected an array of [gpu_a, gpu_b, active_links]")
        links: list[NvLinkSpec] = []
        for k, entry in enumerate(raw):
            if not isinstance(entry, list) or len(entry) != 3:
                raise self.fail(f"nvlink[{k}]", "expected [gpu_a, gpu_b, active_links]")
            if n == 0:
                raise self.fail(f"nvlink[{k}][0]", "GPU index out of range (the spec has no GPUs)")
            pair = []
            for pos in (0, 1):
                if not _is_int(entry[pos], 0, n - 1):
                    raise self.fail(f"nvlink[{k}][{pos}]", f"expected a GPU index from 0 to {n - 1}")
                pair.append(entry[pos])
            count = entry[2]
            if not _is_int(count, 1, NVLINK_MAX_LINKS):
                raise self.fail(f"nvlink[{k}][2]", "expected an integer from 1 to 18 (NVML_NVLINK_MAX_LINKS)")
            a, b = pair
            if a == b:
                raise self.fail(f"nvlink[{k}]", f"GPU {a} cannot link to itself")
            for j, other in enumerate(links):
                if {other.gpu_a, other.gpu_b} == {a, b}:
                    raise self.fail(f"nvlink[{k}]", f"duplicate of nvlink[{j}] (GPUs {a} and {b})")
            links.append(NvLinkSpec(a, b, count))
        return tuple(links)


def _reject_duplicate_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f'duplicate key "{key}"')
        out[key] = value
    return out


def _reject_constant(name: str) -> object:
    raise ValueError(f"{name} is not valid JSON")


def parse_spec(data: object, *, source: str = "<spec>") -> NodeSpec:
    """Validates an already-decoded spec document with the simulator's rules.

    Raises SpecError naming ``source`` and the offending field.
    """
    check = _SpecChecker(source)
    if not isinstance(data, dict):
        raise check.fail("(document)", f"expected an object, got {type(data).__name__}")
    driver = check.string(data, "driver_version", "driver_version", 79, "a non-empty string of at most 79 characters")
    if "proc_version_path" in data:
        check.string(data, "proc_version_path", "proc_version_path", 4095, "a file path")
    cuda = check.integer(
        data, "cuda_driver_version", "cuda_driver_version", 1, 2**31 - 1, "a positive integer such as 12040"
    )
    raw_gpus = data.get("gpus")
    if not isinstance(raw_gpus, list) or len(raw_gpus) > MAX_GPUS:
        what = "missing" if raw_gpus is None else "invalid"
        raise check.fail("gpus", f"{what} (expected an array of at most {MAX_GPUS} GPUs)")
    gpus: list[GpuSpec] = []
    for i, raw in enumerate(raw_gpus):
        gpus.append(check.gpu(i, raw, gpus))
    topology = check.topology(data.get("topology"), len(gpus))
    nvlink = check.nvlink(data.get("nvlink"), len(gpus))
    return NodeSpec(source, driver, cuda, tuple(gpus), topology, nvlink)


def load_spec(path: str | os.PathLike[str]) -> NodeSpec:
    """Reads and validates a node spec file (the GPUSIM_SPEC format).

    Applies the same rules as the simulated driver, so a spec accepted here is accepted by
    ``nvmlInit`` and vice versa.  Raises SpecError.
    """
    source = os.fspath(path)
    try:
        text = Path(source).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"{source}: cannot read the spec file: {exc}") from exc
    try:
        data = json.loads(text, object_pairs_hook=_reject_duplicate_keys, parse_constant=_reject_constant)
    except ValueError as exc:
        raise SpecError(f"{source}: invalid JSON: {exc}") from exc
    return parse_spec(data, source=source)


# ---- run-time state ---------------------------------------------------------------------------


class StateError(RuntimeError):
    """The state file cannot be used (wrong format, I/O failure, full table, bad argument)."""


@dataclass(frozen=True)
class UtilSample:
    """One utilisation sample as nvmlDeviceGetSamples reports it."""

    timestamp_us: int
    gpu_percent: int
    memory_percent: int


@dataclass(frozen=True)
class GpuState:
    """Run-time state of one GPU."""

    index: int
    lost: bool
    lost_since_us: int
    util_gpu: int
    util_memory: int
    util_updated_us: int
    samples: tuple[UtilSample, ...]  # oldest first
    used_peak: int = 0  # highest device memory in use (all processes) the simulated driver saw


@dataclass(frozen=True)
class Event:
    """One queued event (XID events have event_type EVENT_TYPE_XID and the XID as data)."""

    seq: int
    gpu: int
    event_type: int
    data: int
    time_us: int


@dataclass(frozen=True)
class ProcessEntry:
    """One process using a GPU."""

    pid: int
    gpu: int
    used_bytes: int
    sm_util: int
    mem_util: int
    updated_us: int
    cuda: bool = False  # written by the simulated libcuda (reaped when the process is gone)
    graphics: bool = False  # a graphics process (nvmlDeviceGetGraphicsRunningProcesses lists it)


@dataclass(frozen=True)
class StateSnapshot:
    """A consistent copy of the whole state, taken under the lock."""

    change_counter: int
    event_next_seq: int
    gpus: tuple[GpuState, ...]
    events: tuple[Event, ...]  # still in the ring, oldest first
    processes: tuple[ProcessEntry, ...]

    def used_bytes(self, gpu: int) -> int:
        """Device memory in use on a GPU: the sum over its processes."""
        return sum(p.used_bytes for p in self.processes if p.gpu == gpu)


@dataclass(frozen=True)
class TimelineProcess:
    """One process's run queue on a simulated GPU."""

    pid: int
    busy_ns: int  # GPU time its kernels ran, cumulative
    pending: int  # kernels queued, not finished


@dataclass(frozen=True)
class Timeline:
    """Simulated GPU time of one GPU, as of ``now_ns`` (CLOCK_MONOTONIC ns)."""

    gpu: int
    active: bool  # a simulated kernel ever ran (NVML reports utilisation from here)
    now_ns: int
    busy_ns: int  # time with a kernel running, cumulative
    kernels_done: int
    processes: tuple[TimelineProcess, ...]

    def busy_of(self, pids: set[int] | frozenset[int]) -> int:
        """Cumulative GPU time of the given processes."""
        return sum(p.busy_ns for p in self.processes if p.pid in pids)


@dataclass(frozen=True)
class _Section:
    offset: int
    stride: int
    count: int


def _now_us() -> int:
    return time.time_ns() // 1000


def _fresh_header() -> bytes:
    header = bytearray(HEADER_SIZE)
    sections = [
        (SECTION_GPUS, _GPU_ENTRY_SIZE, MAX_GPUS, _GPUS_OFFSET),
        (SECTION_EVENTS, _EVENT.size, EVENT_RING, _EVENTS_OFFSET),
        (SECTION_PROCS, _PROC.size, MAX_PROCS, _PROCS_OFFSET),
        (SECTION_TIMELINE, _TL_ENTRY_SIZE, MAX_GPUS, _TIMELINE_OFFSET),
    ]
    _HEADER.pack_into(
        header, 0, STATE_MAGIC, LAYOUT_VERSION, HEADER_SIZE, FILE_SIZE, 1, 1, _now_us(), len(sections), 0, b""
    )
    for i, (sid, size, count, offset) in enumerate(sections):
        _SECTION.pack_into(header, _HEADER.size + i * _SECTION.size, sid, size, count, 0, offset, 0)
    return bytes(header[: _HEADER.size + len(sections) * _SECTION.size])


#: futex(2) system call numbers, to wake waiters of the simulated driver's event wait.
_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine())
_FUTEX_WAKE = 1
_libc = ctypes.CDLL(None, use_errno=True) if _SYS_FUTEX is not None else None


def _futex_wake(address: int) -> None:
    """Wakes every process blocked on the futex word at ``address`` (a shared mapping).

    On an architecture not listed in _SYS_FUTEX nobody is woken: waiters then notice a change
    only when their own timeout ends.
    """
    if _libc is not None:
        _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAKE, 0x7FFFFFFF, None, None, 0)


def _flock(fd: int) -> None:
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            return
        except InterruptedError:
            continue


class GpuSimState:
    """An open, mapped state file.  Safe to share between threads; use as a context manager.

    Opening creates and initialises the file when it is missing or empty (as the simulated
    driver does), and validates it otherwise.  GPU arguments are NVML indices (0..63); this
    class does not know the spec, so callers check indices against their spec.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._mutex = threading.Lock()
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        self._pid = os.getpid()
        try:
            _flock(self._fd)
            try:
                self._size, self._gpus, self._events, self._procs, self._timeline = self._validate()
                self._map = mmap.mmap(self._fd, self._size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                # The simulated driver's event wait blocks on the low half of change_counter.
                view = ctypes.c_char.from_buffer(self._map, _OFF_CHANGE_COUNTER)
                self._change_word = ctypes.addressof(view)
                del view  # releases the buffer export, so that close() may unmap
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
        except BaseException:
            os.close(self._fd)
            raise

    def _validate(self) -> tuple[int, _Section, _Section, _Section, _Section | None]:
        size = os.fstat(self._fd).st_size
        head = os.pread(self._fd, HEADER_SIZE, 0) if size else b""
        if size == 0 or head[:8] == bytes(8):
            os.ftruncate(self._fd, 0)
            os.ftruncate(self._fd, FILE_SIZE)
            os.pwrite(self._fd, _fresh_header(), 0)
            logger.debug("initialised state file %s", self.path)
            size = FILE_SIZE
            head = os.pread(self._fd, HEADER_SIZE, 0)
        if len(head) < _HEADER.size + MAX_SECTIONS * _SECTION.size:
            raise StateError(f"{self.path}: not a gpusim state file (too short); delete it to start afresh")
        magic, version, header_size, file_size, *_rest = _HEADER.unpack_from(head, 0)
        if magic != STATE_MAGIC:
            raise StateError(f"{self.path}: not a gpusim state file (bad magic); delete it to start afresh")
        if version != LAYOUT_VERSION:
            raise StateError(
                f"{self.path}: state layout version {version}, this code reads version {LAYOUT_VERSION}; "
                "delete the file"
            )
        if header_size != HEADER_SIZE or file_size != size:
            raise StateError(
                f"{self.path}: corrupt state file (header says {file_size} bytes, file has {size}); delete it"
            )
        section_count = _HEADER.unpack_from(head, 0)[7]
        found: dict[int, _Section] = {}
        for i in range(min(section_count, MAX_SECTIONS)):
            sid, stride, count, _flags, offset, _res = _SECTION.unpack_from(head, _HEADER.size + i * _SECTION.size)
            found.setdefault(sid, _Section(offset, stride, count))
        need = {
            SECTION_GPUS: (_GPU_ENTRY_SIZE, MAX_GPUS),
            SECTION_EVENTS: (_EVENT.size, 1),
            SECTION_PROCS: (_PROC.size, 1),
        }
        for sid, (min_size, min_count) in need.items():
            sec = found.get(sid)
            if (
                sec is None
                or sec.stride < min_size
                or sec.count < min_count
                or sec.stride % 8
                or sec.offset % 8
                or sec.offset < HEADER_SIZE
                or sec.offset + sec.stride * sec.count > size
            ):
                raise StateError(f"{self.path}: corrupt state file (section directory); delete it")
        timeline = found.get(SECTION_TIMELINE)
        if timeline is not None and (
            timeline.stride < _TL_ENTRY_SIZE
            or timeline.count < MAX_GPUS
            or timeline.offset + timeline.stride * timeline.count > size
        ):
            timeline = None  # unusable: treated as absent (an older writer's file)
        return size, found[SECTION_GPUS], found[SECTION_EVENTS], found[SECTION_PROCS], timeline

    # -- plumbing --

    def close(self) -> None:
        """Unmaps and closes the file."""
        with self._mutex:
            if self._fd >= 0:
                self._map.close()
                os.close(self._fd)
                self._fd = -1

    def __enter__(self) -> GpuSimState:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    @contextmanager
    def _locked(self) -> Iterator[mmap.mmap]:
        with self._mutex:
            if self._fd < 0:
                raise StateError(f"{self.path}: state file is closed")
            if self._pid != os.getpid():
                # A forked child shares the parent's open file, and with it the flock.
                fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
                os.close(self._fd)
                self._fd, self._pid = fd, os.getpid()
            _flock(self._fd)
            try:
                yield self._map
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _touch(self, m: mmap.mmap) -> None:
        (counter,) = struct.unpack_from("<Q", m, _OFF_CHANGE_COUNTER)
        struct.pack_into("<Q", m, _OFF_CHANGE_COUNTER, counter + 1)
        _futex_wake(self._change_word)

    def _gpu_offset(self, gpu: int) -> int:
        if not _is_int(gpu, 0, min(self._gpus.count, MAX_GPUS) - 1):
            raise StateError(f"GPU index {gpu!r} out of range (0..{MAX_GPUS - 1})")
        return self._gpus.offset + gpu * self._gpus.stride

    # -- mutations --

    def queue_event(self, gpu: int, event_type: int, data: int) -> int:
        """Appends an event to the ring; returns its sequence number."""
        self._gpu_offset(gpu)
        if not _is_int(data, 0, 2**64 - 1) or not _is_int(event_type, 1, 2**64 - 1):
            raise StateError(f"invalid event type {event_type!r} or data {data!r}")
        with self._locked() as m:
            seq: int = max(struct.unpack_from("<Q", m, _OFF_EVENT_NEXT_SEQ)[0], 1)
            slot = self._events.offset + (seq % self._events.count) * self._events.stride
            m[slot : slot + self._events.stride] = bytes(self._events.stride)
            _EVENT.pack_into(m, slot, seq, event_type, data, _now_us(), gpu, 0, 0)
            struct.pack_into("<Q", m, _OFF_EVENT_NEXT_SEQ, seq + 1)
            self._touch(m)
        logger.debug("queued event %d on GPU %d: type %#x data %d", seq, gpu, event_type, data)
        return seq

    def queue_xid(self, gpu: int, xid: int) -> int:
        """Queues an XID critical-error event for a GPU; returns its sequence number."""
        return self.queue_event(gpu, EVENT_TYPE_XID, xid)

    def set_lost(self, gpu: int, lost: bool = True) -> None:
        """Marks a GPU lost (NVML answers GPU_IS_LOST) or brings it back."""
        off = self._gpu_offset(gpu)
        with self._locked() as m:
            flags, u_gpu, u_mem, res0, updated, count, since, pad = _GPU_HEAD.unpack_from(m, off)
            if bool(flags & GPU_LOST) != lost:  # keep the time of the first loss when already lost
                since = _now_us() if lost else 0
            flags = (flags | GPU_LOST) if lost else (flags & ~GPU_LOST)
            _GPU_HEAD.pack_into(m, off, flags, u_gpu, u_mem, res0, updated, count, since, pad)
            self._touch(m)

    def set_hung(self, gpu: int, hung: bool = True) -> None:
        """Makes every NVML call that takes the GPU (its handle, or its handle by index) block until it is
        released, as calls on a GPU stuck in reset do; ``hung=False`` releases them."""
        off = self._gpu_offset(gpu)
        with self._locked() as m:
            flags, *rest = _GPU_HEAD.unpack_from(m, off)
            flags = (flags | GPU_HUNG) if hung else (flags & ~GPU_HUNG)
            _GPU_HEAD.pack_into(m, off, flags, *rest)
            self._touch(m)

    def _set_flags(self, gpu: int, clear: int, add: int) -> None:
        off = self._gpu_offset(gpu)
        with self._locked() as m:
            flags, *rest = _GPU_HEAD.unpack_from(m, off)
            _GPU_HEAD.pack_into(m, off, (flags & ~clear) | add, *rest)
            self._touch(m)

    def set_mig(self, gpu: int, enabled: bool = True) -> None:
        """Turns MIG mode on or off (``nvmlDeviceGetMigMode`` of a MIG-capable model answers it)."""
        self._set_flags(gpu, GPU_MIG, GPU_MIG if enabled else 0)

    def set_compute_mode(self, gpu: int, mode: int) -> None:
        """Sets the compute mode ``nvmlDeviceGetComputeMode`` answers (0 DEFAULT .. 3 EXCLUSIVE_PROCESS)."""
        if not _is_int(mode, 0, 3):
            raise StateError(f"compute mode {mode!r} out of range (0..3: {', '.join(COMPUTE_MODES)})")
        self._set_flags(gpu, GPU_COMPUTE_MODE_MASK, mode << GPU_COMPUTE_MODE_SHIFT)

    def set_utilization(self, gpu: int, gpu_percent: int, memory_percent: int = 0) -> None:
        """Sets a GPU's current utilisation and records it as a sample."""
        off = self._gpu_offset(gpu)
        if not (_is_int(gpu_percent, 0, 100) and _is_int(memory_percent, 0, 100)):
            raise StateError(f"utilisation must be 0..100 percent, got {gpu_percent!r}/{memory_percent!r}")
        with self._locked() as m:
            flags, _g, _m, res0, _upd, count, since, pad = _GPU_HEAD.unpack_from(m, off)
            now = _now_us()
            _SAMPLE.pack_into(
                m, off + _GPU_HEAD.size + (count % UTIL_SAMPLES) * _SAMPLE.size, now, gpu_percent, memory_percent
            )
            _GPU_HEAD.pack_into(m, off, flags, gpu_percent, memory_percent, res0, now, count + 1, since, pad)
            self._touch(m)

    def _proc_slots(self, m: mmap.mmap) -> Iterator[tuple[int, tuple[int, ...]]]:
        for i in range(self._procs.count):
            off = self._procs.offset + i * self._procs.stride
            yield off, _PROC.unpack_from(m, off)

    def set_process(
        self, gpu: int, pid: int, used_bytes: int, *, sm_util: int = 0, mem_util: int = 0, graphics: bool = False
    ) -> None:
        """Adds or updates the (pid, gpu) entry of the process table (``graphics``: a graphics process, which
        nvmlDeviceGetGraphicsRunningProcesses lists instead of the compute processes' query)."""
        self._gpu_offset(gpu)
        if not _is_int(pid, 1, 2**32 - 1) or not _is_int(used_bytes, 0, 2**64 - 1):
            raise StateError(f"invalid pid {pid!r} or used bytes {used_bytes!r}")
        if not (_is_int(sm_util, 0, 100) and _is_int(mem_util, 0, 100)):
            raise StateError(f"utilisation must be 0..100 percent, got {sm_util!r}/{mem_util!r}")
        with self._locked() as m:
            target = free = None
            for off, (p_pid, p_gpu, _used, flags, *_rest) in self._proc_slots(m):
                if flags & PROC_IN_USE and p_pid == pid and p_gpu == gpu:
                    target = off
                    break
                if free is None and not flags & PROC_IN_USE:
                    free = off
            target = target if target is not None else free
            if target is None:
                raise StateError(f"{self.path}: process table full ({self._procs.count} entries)")
            m[target : target + self._procs.stride] = bytes(self._procs.stride)
            flags = PROC_IN_USE | (PROC_GRAPHICS if graphics else 0)
            _PROC.pack_into(m, target, pid, gpu, used_bytes, flags, sm_util, mem_util, 0, _now_us(), 0)
            self._touch(m)

    def remove_process(self, pid: int, gpu: int | None = None) -> int:
        """Removes a process from one GPU (or from all); returns how many entries went."""
        removed = 0
        with self._locked() as m:
            for off, (p_pid, p_gpu, _used, flags, *_rest) in self._proc_slots(m):
                if flags & PROC_IN_USE and p_pid == pid and (gpu is None or p_gpu == gpu):
                    m[off : off + self._procs.stride] = bytes(self._procs.stride)
                    removed += 1
            if removed:
                self._touch(m)
        return removed

    # -- queries --

    def is_lost(self, gpu: int) -> bool:
        """Whether a GPU is marked lost."""
        off = self._gpu_offset(gpu)
        with self._locked() as m:
            return bool(_GPU_HEAD.unpack_from(m, off)[0] & GPU_LOST)

    def snapshot(self, gpu_count: int = MAX_GPUS) -> StateSnapshot:
        """A consistent copy of the state of the first ``gpu_count`` GPUs, the event ring and processes."""
        if not _is_int(gpu_count, 0, min(self._gpus.count, MAX_GPUS)):
            raise StateError(f"gpu_count {gpu_count!r} out of range (0..{MAX_GPUS})")
        with self._locked() as m:
            _magic, _v, _hs, _fs, counter, next_seq, *_rest = _HEADER.unpack_from(m, 0)
            gpus = [self._read_gpu(m, i) for i in range(gpu_count)]
            events: list[Event] = []
            first = max(1, next_seq - self._events.count)
            for seq in range(first, next_seq):
                slot = self._events.offset + (seq % self._events.count) * self._events.stride
                e_seq, e_type, e_data, e_time, e_gpu, _r0, _r1 = _EVENT.unpack_from(m, slot)
                if e_seq == seq:
                    events.append(Event(seq, e_gpu, e_type, e_data, e_time))
            procs = [
                ProcessEntry(pid, gpu, used, sm, mem, updated, bool(flags & PROC_CUDA), bool(flags & PROC_GRAPHICS))
                for _off, (pid, gpu, used, flags, sm, mem, _r0, updated, _r1) in self._proc_slots(m)
                if flags & PROC_IN_USE
            ]
        return StateSnapshot(counter, next_seq, tuple(gpus), tuple(events), tuple(procs))

    def timeline(self, gpu: int) -> Timeline | None:
        """Simulated GPU time of one GPU (None when the file has no TIMELINE section).

        Read without the simulator's mutex: the entry's seqlock counter is read before and
        after, and the copy is retried until both agree and are even.  Counters are as of
        ``now_ns`` (CLOCK_MONOTONIC), the time the simulation last advanced to.
        """
        self._gpu_offset(gpu)
        if self._timeline is None:
            return None
        off = self._timeline.offset + gpu * self._timeline.stride
        with self._mutex:
            m = self._map
            for _ in range(100000):
                seq1 = struct.unpack_from("<Q", m, off + 72)[0]
                if seq1 & 1:
                    continue
                _init, active, _seq, now_ns, busy_ns, done = _TL_HEAD.unpack_from(m, off)
                procs = []
                for i in range(TL_SLOTS):
                    pid, flags, _start, busy, head, tail, _left = _TL_SLOT_HEAD.unpack_from(
                        m, off + _TL_SLOTS_OFFSET + i * _TL_SLOT_SIZE
                    )
                    if flags & 1:
                        procs.append(TimelineProcess(pid, busy, tail - head))
                if struct.unpack_from("<Q", m, off + 72)[0] == seq1:
                    return Timeline(gpu, bool(active), now_ns, busy_ns, done, tuple(procs))
                time.sleep(0)
        raise StateError(f"{self.path}: timeline of GPU {gpu} kept changing while read")

    def _read_gpu(self, m: mmap.mmap, index: int) -> GpuState:
        off = self._gpus.offset + index * self._gpus.stride
        flags, u_gpu, u_mem, _r0, updated, count, since, pad = _GPU_HEAD.unpack_from(m, off)
        samples = []
        for n in range(max(0, count - UTIL_SAMPLES), count):
            ts, g, mem = _SAMPLE.unpack_from(m, off + _GPU_HEAD.size + (n % UTIL_SAMPLES) * _SAMPLE.size)
            samples.append(UtilSample(ts, g, mem))
        peak = struct.unpack_from("<Q", pad, 0)[0]  # used_peak: the first 8 of the reserved bytes
        return GpuState(index, bool(flags & GPU_LOST), since, u_gpu, u_mem, updated, tuple(samples), peak)


# ---- running programs on the simulated node -------------------------------------------------


class SimBuildError(RuntimeError):
    """Building vcuda/ failed; the message carries make's output."""


def repo_root() -> Path:
    """The source tree this module lives in."""
    return Path(__file__).resolve().parents[1]


def sim_library_dir() -> Path:
    """Directory holding the built simulated ``libnvidia-ml.so.1``."""
    return repo_root() / "vcuda" / "build" / "sim"


def spec_dir() -> Path:
    """Directory of the shipped node specs (``deploy/sim``)."""
    return repo_root() / "deploy" / "sim"


def sim_env(
    spec: str | os.PathLike[str],
    state: str | os.PathLike[str],
    *,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Environment for a process that should see the simulated node.

    Copies ``base`` (default: ``os.environ``), puts the simulated driver first on
    ``LD_LIBRARY_PATH`` and sets ``GPUSIM_SPEC`` / ``GPUSIM_STATE`` to absolute paths.  Pass it
    when starting the process: the dynamic loader reads LD_LIBRARY_PATH only at start-up.
    """
    env = dict(os.environ if base is None else base)
    paths = [str(sim_library_dir()), *filter(None, env.get("LD_LIBRARY_PATH", "").split(os.pathsep))]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(paths)
    env["GPUSIM_SPEC"] = str(Path(spec).resolve())
    env["GPUSIM_STATE"] = str(Path(state).resolve())
    return env


def _newest_source_mtime(vcuda: Path) -> float:
    dirs = [vcuda / name for name in ("sim", "common", "tools") if (vcuda / name).is_dir()]
    sources = [vcuda / "Makefile", *(p for d in dirs for p in d.iterdir() if p.suffix in {".c", ".h", ".py"})]
    return max(p.stat().st_mtime for p in sources)


def ensure_sim_built(*, python: str | None = None, timeout: float = 300.0) -> Path:
    """Builds the simulated driver unless it is present and newer than its sources.

    The simulated driver is ``libnvidia-ml.so.1`` and ``libcuda.so.1``.  Runs ``make -C vcuda sim``
    (with ``PYTHON`` set to ``python``, default this interpreter)
    under a file lock, so concurrent callers build once.  Returns the library path; raises
    SimBuildError when make fails.
    """
    vcuda = repo_root() / "vcuda"
    lib = sim_library_dir() / "libnvidia-ml.so.1"
    libs = [lib, sim_library_dir() / "libcuda.so.1"]

    def stale() -> bool:
        newest = _newest_source_mtime(vcuda)
        return any(not p.exists() or p.stat().st_mtime < newest for p in libs)

    if not stale():
        return lib
    (vcuda / "build").mkdir(exist_ok=True)
    lock_fd = os.open(vcuda / "build" / ".sim-build.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    try:
        _flock(lock_fd)
        if stale():
            cmd = ["make", "-C", str(vcuda), "sim", f"PYTHON={python or sys.executable}"]
            logger.info("building the simulated driver: %s", " ".join(cmd))
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise SimBuildError(f"{' '.join(cmd)}: {exc}") from exc
            if done.returncode != 0 or not all(p.exists() for p in libs):
                raise SimBuildError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout}{done.stderr}")
    finally:
        os.close(lock_fd)
    return lib
