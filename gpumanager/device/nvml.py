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


@dataclass
class _Links:
    """Active NVLink links of one GPU: to peer GPUs directly, and to NVSwitches."""

    peers: dict[int, int]
    to_switch: int = 0


def _remote_is_switch(handle: object, link: int) -> bool:
    try:
        kind = pynvml.nvmlDeviceGetNvLinkRemoteDeviceType(handle, link)
    except (pynvml.NVMLError, AttributeError):
        return False
    return bool(kind == pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH)


def _nvlinks(handle: object, index: int, by_bus: dict[str, int]) -> _Links:
    links = _Links(peers={})
    for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
        try:
            if pynvml.nvmlDeviceGetNvLinkState(handle, link) != pynvml.NVML_FEATURE_ENABLED:
                continue
            if _remote_is_switch(handle, link):
                links.to_switch += 1
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
            links.peers[peer] = links.peers.get(peer, 0) + 1
    return links


def _p2p_nvlink(a: object, b: object) -> bool:
    try:
        status = pynvml.nvmlDeviceGetP2PStatus(a, b, pynvml.NVML_P2P_CAPS_INDEX_NVLINK)
    except pynvml.NVMLError:
        return False
    return bool(status == pynvml.NVML_P2P_STATUS_OK)


def topology(gpus: list[GPUInfo]) -> NodeTopology:
    """Common-ancestor levels between every pair of GPUs, and their NVLink connections.

    Direct GPU-to-GPU links are counted per peer. GPUs whose links end at an
    NVSwitch are joined to each other when NVML confirms NVLink peer-to-peer
    between them; such a pair counts the smaller of the two GPUs' switch links.
    """
    handles = [pynvml.nvmlDeviceGetHandleByIndex(g.index) for g in gpus]
    n = len(gpus)
    levels = [[0] * n for _ in range(n)]
    for a in range(n):
        for b in range(a + 1, n):
            level = int(pynvml.nvmlDeviceGetTopologyCommonAncestor(handles[a], handles[b]))
            levels[a][b] = levels[b][a] = level
    by_bus = {g.pci_bus_id: g.index for g in gpus}
    per_gpu = [_nvlinks(h, g.index, by_bus) for g, h in zip(gpus, handles, strict=True)]
    links: dict[tuple[int, int], int] = {}
    for gpu, found in zip(gpus, per_gpu, strict=True):
        for peer, count in found.peers.items():
            key = (min(gpu.index, peer), max(gpu.index, peer))
            # Each side reports the pair; keep the larger count if they disagree.
            links[key] = max(links.get(key, 0), count)
    for a in range(n):
        for b in range(a + 1, n):
            switch_links = min(per_gpu[a].to_switch, per_gpu[b].to_switch)
            if switch_links and (a, b) not in links and _p2p_nvlink(handles[a], handles[b]):
                links[(a, b)] = switch_links
    nvlink = tuple((a, b, c) for (a, b), c in sorted(links.items()))
    return NodeTopology(levels=tuple(tuple(row) for row in levels), nvlink=nvlink)
