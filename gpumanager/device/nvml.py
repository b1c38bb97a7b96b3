"""NVML through pynvml: library loading, start-up, and the node's GPU inventory and topology."""

from __future__ import annotations

import ctypes
import logging
import threading
from dataclasses import dataclass

import pynvml

from gpumanager.device.types import GPUInfo, NodeTopology

log = logging.getLogger(__name__)

NVMLError = pynvml.NVMLError


class NVMLUnavailableError(RuntimeError):
    """NVML could not be loaded or initialised; the message says why."""


@dataclass(frozen=True)
class DriverInfo:
    """Versions reported by the driver."""

    driver_version: str
    cuda_driver_version: int  # e.g. 12040 for CUDA 12.4


_init_lock = threading.Lock()
_preloaded: ctypes.CDLL | None = None


def init(library_path: str = "") -> None:
    """Load and initialise NVML.

    ``library_path`` names a ``libnvidia-ml.so.1`` to use instead of the one the
    dynamic linker finds (for a driver installed under a host root). pynvml opens
    the library by soname, so a library loaded first by path is the one it gets.
    """
    global _preloaded
    with _init_lock:
        if library_path and _preloaded is None:
            try:
                _preloaded = ctypes.CDLL(library_path, mode=ctypes.RTLD_GLOBAL)
            except OSError as exc:
                raise NVMLUnavailableError(f"cannot load NVML library {library_path!r}: {exc}") from exc
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise NVMLUnavailableError(f"NVML initialisation failed: {exc}") from exc


def shutdown() -> None:
    """Release NVML (errors are logged, never raised)."""
    try:
        pynvml.nvmlShutdown()
    except pynvml.NVMLError as exc:
        log.debug("nvmlShutdown: %s", exc)


def is_gpu_lost(exc: BaseException) -> bool:
    """Whether an NVML error means the GPU has fallen off the bus."""
    return isinstance(exc, pynvml.NVMLError) and exc.value == pynvml.NVML_ERROR_GPU_IS_LOST


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def normalize_bus_id(bus_id: str | bytes) -> str:
    """Canonical PCI bus id: 8-hex-digit domain, lower case (``00000000:18:00.0``)."""
    text = _text(bus_id).strip().lower()
    domain, _, rest = text.partition(":")
    if not rest:
        return text
    return f"{int(domain, 16):08x}:{rest}"


def driver_info() -> DriverInfo:
    """The driver and CUDA driver versions."""
    return DriverInfo(
        driver_version=_text(pynvml.nvmlSystemGetDriverVersion()),
        cuda_driver_version=int(pynvml.nvmlSystemGetCudaDriverVersion()),
    )


def _numa_node(handle: object) -> int | None:
    try:
        node = int(pynvml.nvmlDeviceGetNumaNodeId(handle))
        return node if node >= 0 else None
    except pynvml.NVMLError as exc:
        log.debug("nvmlDeviceGetNumaNodeId: %s; trying memory affinity", exc)
    try:
        mask = pynvml.nvmlDeviceGetMemoryAffinity(handle, 64, pynvml.NVML_AFFINITY_SCOPE_NODE)
    except pynvml.NVMLError as exc:
        log.debug("nvmlDeviceGetMemoryAffinity: %s", exc)
        return None
    for word_index, word in enumerate(mask):
        if word:
            return word_index * 64 + (int(word) & -int(word)).bit_length() - 1
    return None


def discover() -> list[GPUInfo]:
    """Every GPU NVML reports, in NVML index order."""
    gpus = []
    for index in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        try:
            multi_board = bool(pynvml.nvmlDeviceGetMultiGpuBoard(handle))
        except pynvml.NVMLError as exc:
            log.debug("GPU %d: nvmlDeviceGetMultiGpuBoard: %s", index, exc)
            multi_board = False
        gpus.append(
            GPUInfo(
                index=index,
                uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
                name=_text(pynvml.nvmlDeviceGetName(handle)),
                minor=int(pynvml.nvmlDeviceGetMinorNumber(handle)),
                memory_total=int(pynvml.nvmlDeviceGetMemoryInfo(handle).total),
                pci_bus_id=normalize_bus_id(pynvml.nvmlDeviceGetPciInfo(handle).busId),
                numa_node=_numa_node(handle),
                multi_gpu_board=multi_board,
            )
        )
    return gpus


def _nvlink_peers(handle: object, index: int, by_bus: dict[str, int]) -> dict[int, int]:
    """Active NVLink links of one GPU, counted per peer GPU index."""
    peers: dict[int, int] = {}
    for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
        try:
            if pynvml.nvmlDeviceGetNvLinkState(handle, link) != pynvml.NVML_FEATURE_ENABLED:
                continue
            remote = normalize_bus_id(pynvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId)
        except pynvml.NVMLError as exc:
            if exc.value not in (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_INVALID_ARGUMENT):
                log.warning("GPU %d NVLink %d: %s", index, link, exc)
            if link == 0 or exc.value == pynvml.NVML_ERROR_INVALID_ARGUMENT:
                break
            continue
        peer = by_bus.get(remote)
        if peer is not None and peer != index:
            peers[peer] = peers.get(peer, 0) + 1
    return peers


def topology(gpus: list[GPUInfo]) -> NodeTopology:
    """Common-ancestor levels between every pair of GPUs, and their NVLink connections."""
    handles = [pynvml.nvmlDeviceGetHandleByIndex(g.index) for g in gpus]
    n = len(gpus)
    levels = [[0] * n for _ in range(n)]
    for a in range(n):
        for b in range(a + 1, n):
            level = int(pynvml.nvmlDeviceGetTopologyCommonAncestor(handles[a], handles[b]))
            levels[a][b] = levels[b][a] = level
    by_bus = {g.pci_bus_id: g.index for g in gpus}
    links: dict[tuple[int, int], int] = {}
    for gpu, handle in zip(gpus, handles, strict=True):
        for peer, count in _nvlink_peers(handle, gpu.index, by_bus).items():
            key = (min(gpu.index, peer), max(gpu.index, peer))
            # Each side reports the pair; keep the larger count if they disagree.
            links[key] = max(links.get(key, 0), count)
    nvlink = tuple((a, b, c) for (a, b), c in sorted(links.items()))
    return NodeTopology(levels=tuple(tuple(row) for row in levels), nvlink=nvlink)
