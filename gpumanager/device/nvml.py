"""NVML through pynvml: library loading, start-up, and the node's GPU inventory and topology."""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pynvml

from gpumanager.device.types import GPUInfo, NodeTopology

log = logging.getLogger(__name__)

NVMLError = pynvml.NVMLError


class NVMLUnavailableError(RuntimeError):
    """NVML could not be loaded or initialised; the message says why."""


class NVMLLibraryError(NVMLUnavailableError):
    """The NVML library named by the operator cannot be loaded or is not NVML."""


@dataclass(frozen=True)
class DriverInfo:
    """Versions reported by the driver."""

    driver_version: str
    cuda_driver_version: int  # e.g. 12040 for CUDA 12.4


#: Seconds NVML may take to describe one GPU at start (all GPUs are asked at once) before that GPU is
#: counted as lost: a GPU stuck in reset blocks every call on it, and the others are to be served.
DESCRIBE_TIMEOUT = 10.0

#: Seconds before the first new attempt of an NVML start that the driver's kernel module not being loaded
#: yet refused (a driver being installed); doubled at each attempt, up to RETRY_MAX_DELAY.
RETRY_FIRST_DELAY = 1.0
RETRY_MAX_DELAY = 10.0

_init_lock = threading.Lock()
_preloaded: ctypes.CDLL | None = None


def init(library_path: str = "", *, wait_for_driver: float = 0.0, stopping: threading.Event | None = None) -> None:
    """Load and initialise NVML.

    ``library_path`` names a ``libnvidia-ml.so.1`` to use instead of the one the
    dynamic linker finds (for a driver installed under a host root). pynvml opens
    the library by soname, so a library loaded first by path is the one it gets.
    While NVML says the driver's kernel module is not loaded (a driver being installed), it is asked
    again with backoff for up to ``wait_for_driver`` seconds (said once in the log), until ``stopping``
    is set. Raises NVMLUnavailableError.
    """
    global _preloaded
    with _init_lock:
        if library_path and _preloaded is None:
            try:
                lib = ctypes.CDLL(library_path, mode=ctypes.RTLD_GLOBAL)
            except OSError as exc:
                raise NVMLLibraryError(f"cannot load NVML library {library_path!r}: {exc}") from exc
            if not hasattr(lib, "nvmlInit_v2"):
                # pynvml would quietly open whatever libnvidia-ml.so.1 the linker finds instead.
                raise NVMLLibraryError(f"{library_path!r} is not an NVML library (it has no nvmlInit_v2)")
            _preloaded = lib
        deadline = time.monotonic() + wait_for_driver
        delay = RETRY_FIRST_DELAY
        waited = False
        while True:
            try:
                pynvml.nvmlInit()
            except pynvml.NVMLError as exc:
                left = deadline - time.monotonic()
                message = f"NVML initialisation failed: {exc}{_what_to_do(exc)}"
                if exc.value != pynvml.NVML_ERROR_DRIVER_NOT_LOADED or left <= 0:
                    raise NVMLUnavailableError(message) from exc
                if not waited:
                    log.warning("%s; trying again for up to %.0f s", message, left)
                    waited = True
                if stopping is not None and stopping.wait(min(delay, left)):
                    raise NVMLUnavailableError(f"{message}; stopped while waiting for the driver") from exc
                if stopping is None:
                    time.sleep(min(delay, left))
                delay = min(delay * 2, RETRY_MAX_DELAY)
                continue
            if waited:
                log.info("NVML initialised: the driver's kernel module is loaded")
            return


def _what_to_do(exc: pynvml.NVMLError) -> str:
    """What an operator can do about an NVML start failure whose cause is known ("" otherwise)."""
    if exc.value == pynvml.NVML_ERROR_LIBRARY_NOT_FOUND:
        return (
            " (the dynamic linker found no libnvidia-ml.so.1: install the NVIDIA driver on the node, or name"
            " the library with --nvml-lib, e.g. under the host's root mounted in the container)"
        )
    if exc.value == pynvml.NVML_ERROR_DRIVER_NOT_LOADED:
        return " (the NVIDIA kernel module is not loaded on the node: nvidia-smi there says the same)"
    if exc.value == pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH:
        return (
            " (the driver's libraries were upgraded but the old kernel module is still loaded: reboot the node, or"
            " unload and load the nvidia kernel modules once nothing uses the GPUs; nvidia-smi there says the same)"
        )
    if exc.value == pynvml.NVML_ERROR_NO_PERMISSION:
        return " (the agent needs read and write access to /dev/nvidiactl and /dev/nvidia*: run it as root)"
    return ""


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
    """An NVML string; bytes that are not UTF-8 become U+FFFD (label values must be valid UTF-8)."""
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else value


def _string(call: Callable[..., str | bytes], *args: object) -> str:
    """The string an NVML call returns. pynvml decodes C strings strictly (UnicodeDecodeError on a
    name that is not UTF-8): the undecodable bytes are then decoded with replacement instead."""
    try:
        return _text(call(*args))
    except UnicodeDecodeError as exc:
        return _text(bytes(exc.object))


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
        driver_version=_string(pynvml.nvmlSystemGetDriverVersion),
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


def _describe(index: int, handle: object) -> GPUInfo:
    try:
        multi_board = bool(pynvml.nvmlDeviceGetMultiGpuBoard(handle))
    except pynvml.NVMLError as exc:
        if is_gpu_lost(exc):
            raise
        log.debug("GPU %d: nvmlDeviceGetMultiGpuBoard: %s", index, exc)
        multi_board = False
    return GPUInfo(
        index=index,
        uuid=_string(pynvml.nvmlDeviceGetUUID, handle),
        name=_string(pynvml.nvmlDeviceGetName, handle),
        minor=int(pynvml.nvmlDeviceGetMinorNumber(handle)),
        memory_total=int(pynvml.nvmlDeviceGetMemoryInfo(handle).total),
        pci_bus_id=normalize_bus_id(pynvml.nvmlDeviceGetPciInfo(handle).busId),
        numa_node=_numa_node(handle),
        multi_gpu_board=multi_board,
    )


def describe(index: int) -> GPUInfo:
    """One GPU as NVML describes it now (raises NVMLError, e.g. while it is lost)."""
    return dataclasses.replace(_describe(index, handle(index)), index=index)


#: The agent's GPU index (the GPU's place: its device IDs) -> NVML's index of that GPU now; None for a
#: GPU NVML no longer counts. Set by :func:`discover`; a place not in it is NVML's index itself.
_nvml_index: dict[int, int | None] = {}


def nvml_index(index: int) -> int | None:
    """NVML's index of the agent's GPU ``index`` (they differ once NVML numbers the GPUs otherwise than
    when the device IDs were laid out); None while NVML does not count that GPU."""
    return _nvml_index.get(index, index)


def handle(index: int) -> object:
    """The NVML handle of the agent's GPU ``index``: by NVML's index of that GPU now. A GPU NVML no
    longer counts raises NVMLError GPU_IS_LOST, as a GPU that is counted but lost does."""
    now = nvml_index(index)
    if now is None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
    return pynvml.nvmlDeviceGetHandleByIndex(now)


def _stand_in(index: int, known: dict[int, GPUInfo], found: list[GPUInfo]) -> GPUInfo:
    """A lost GPU as last seen (saved inventory), else shaped like its healthy peers."""
    saved = known.get(index)
    if saved is not None:
        return saved
    sizes = sorted({g.memory_total for g in found})
    used_minors = {g.minor for g in found} | {g.minor for g in known.values()}
    minor = index if index not in used_minors else max(used_minors, default=-1) + 1
    log.warning(
        "GPU %d is lost and was never seen whole: counted with %d MiB (as its peers) and minor %d, so the other "
        "GPUs' device IDs stay where they are",
        index,
        (sizes[-1] if sizes else 0) >> 20,
        minor,
    )
    return GPUInfo(
        index=index,
        uuid=f"GPU-lost-{index}",
        name=found[0].name if found else "lost GPU",
        minor=minor,
        memory_total=sizes[-1] if sizes else 0,
        pci_bus_id="",
    )


def _places(known: dict[int, GPUInfo], counted: list[GPUInfo | None]) -> dict[int, int | None] | None:
    """Where each GPU NVML counts now (by NVML index) goes among the saved places (the agent's indexes,
    which number the device IDs): place -> NVML index now (None: a saved GPU NVML no longer counts).
    A GPU keeps its place by UUID; a new one takes the place of a saved GPU no longer counted at the
    same PCI address (swapped in place), else a place after the saved ones; a GPU counted but lost
    takes a saved place no other GPU took, in order. None when no GPU NVML describes is a saved one
    (the inventory is of other GPUs)."""
    if sorted(known) != list(range(len(known))):
        return None
    by_uuid = {g.uuid: g.index for g in known.values()}
    described = {i: g for i, g in enumerate(counted) if g is not None}
    if known and described and not any(g.uuid in by_uuid for g in described.values()):
        return None
    places: dict[int, int | None] = {}
    for i, g in described.items():
        if g.uuid in by_uuid:
            places[by_uuid[g.uuid]] = i
    new = [i for i in described if described[i].uuid not in by_uuid]
    for i in list(new):
        free = [p for p, g in sorted(known.items()) if p not in places and g.pci_bus_id == described[i].pci_bus_id]
        if free:
            places[free[0]] = i
            new.remove(i)
    free_known = [p for p in sorted(known) if p not in places]
    lost_counted = [i for i, g in enumerate(counted) if g is None]
    for i in lost_counted:
        place = free_known.pop(0) if free_known else max([*known, *places], default=-1) + 1
        places[place] = i
    for i in new:
        places[max([*known, *places], default=-1) + 1] = i
    for p in free_known:
        places[p] = None
    return places


def _log_moved(known: dict[int, GPUInfo], places: dict[int, int | None], counted: list[GPUInfo | None]) -> None:
    """One line for each GPU not where it was: gone, new, or counted at another NVML index."""
    for place, now in sorted(places.items()):
        saved = known.get(place)
        if now is None and saved is not None:
            log.error(
                "GPU %d (%s) is no longer counted by NVML (fallen off the bus?): its device IDs are kept and "
                "listed Unhealthy (minor %d), the GPUs after it keep theirs though NVML numbers them one lower",
                place,
                saved.uuid,
                saved.minor,
            )
        elif now is not None and saved is None:
            g = counted[now]
            log.warning(
                "a GPU NVML did not count before (%s) takes device IDs after the others", g.uuid if g else "lost"
            )
        elif now is not None and saved is not None and now != place:
            log.warning("GPU %d (%s) is counted by NVML at index %d now; its device IDs stay", place, saved.uuid, now)
        elif now is not None and saved is not None and (g := counted[now]) is not None and g.uuid != saved.uuid:
            log.warning(
                "GPU %d at %s is another GPU (%s, was %s); it takes its IDs", place, g.pci_bus_id, g.uuid, saved.uuid
            )


class _Unanswered(Exception):
    """NVML did not describe a GPU within DESCRIBE_TIMEOUT."""


def _describe_all(count: int) -> list[GPUInfo | BaseException]:
    """Each GPU NVML counts as it describes it, or the error it raised (_Unanswered when it did not answer
    within DESCRIBE_TIMEOUT: its thread, a daemon, is left to finish)."""
    answers: list[GPUInfo | BaseException | None] = [None] * count

    def one(index: int) -> None:
        try:
            answers[index] = _describe(index, pynvml.nvmlDeviceGetHandleByIndex(index))
        except BaseException as exc:  # handed to discover
            answers[index] = exc

    threads = [threading.Thread(target=one, args=(i,), name=f"nvml-describe-{i}", daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + DESCRIBE_TIMEOUT
    out: list[GPUInfo | BaseException] = []
    for index, thread in enumerate(threads):
        thread.join(max(0.0, deadline - time.monotonic()))
        answer = None if thread.is_alive() else answers[index]
        out.append(answer if answer is not None else _Unanswered())
    return out


def discover(known: dict[int, GPUInfo] | None = None) -> tuple[list[GPUInfo], list[int]]:
    """Every GPU, by the agent's index (the place of its device IDs), and the indices of those that are lost.

    A GPU that NVML cannot describe (lost, or any other error of that GPU) does not stop
    discovery: it is counted as lost, described from ``known`` (the saved inventory) or like its
    peers, so that its device IDs are kept. A GPU of ``known`` keeps its index when NVML numbers the
    GPUs otherwise or no longer counts it (then it is lost, as last saved); :func:`handle` finds it at
    NVML's index now. Errors of NVML itself (the GPU count) are raised.
    """
    global _nvml_index
    known = known or {}
    counted: list[GPUInfo | None] = []
    for index, answer in enumerate(_describe_all(pynvml.nvmlDeviceGetCount())):
        if isinstance(answer, GPUInfo):
            counted.append(answer)
        elif isinstance(answer, _Unanswered):
            log.error(
                "GPU %d does not answer NVML within %.0f s at start (stuck in a reset?): serving the other GPUs "
                "and listing its devices as Unhealthy",
                index,
                DESCRIBE_TIMEOUT,
            )
            counted.append(None)
        elif isinstance(answer, pynvml.NVMLError):
            # A lost GPU may have no handle at all (GPU_IS_LOST here), or one whose queries fail.
            exc = answer
            # Any error of one GPU (lost, Unknown Error, a timeout, no permission) is that GPU's: the
            # others are served; only the driver's own failures (init, the count) fail the start.
            log.error(
                "GPU %d cannot be read at start (%s: %s); serving the other GPUs and listing its devices as Unhealthy",
                index,
                "lost" if is_gpu_lost(exc) else f"NVML error {exc.value}",
                exc,
            )
            counted.append(None)
        else:
            raise answer
    places = _places(known, counted) if known else None
    if places is None:
        if known:
            log.warning(
                "the saved GPU inventory is of other GPUs (%d saved, %d counted now); not using it",
                len(known),
                len(counted),
            )
        known = {}
        places = {i: i for i in range(len(counted))}
    else:
        _log_moved(known, places, counted)
    gpus: list[GPUInfo] = []
    lost: list[int] = []
    healthy = [g for g in counted if g is not None]
    for place in range(len(places)):
        now = places[place]
        g = counted[now] if now is not None else None
        if g is None:
            lost.append(place)
            gpus.append(_stand_in(place, known, healthy))
        else:
            gpus.append(dataclasses.replace(g, index=place))
    _nvml_index = {p: n for p, n in places.items() if n != p}
    return _unique_minors(gpus, lost), lost


def _unique_minors(gpus: list[GPUInfo], lost: list[int]) -> list[GPUInfo]:
    """``gpus`` with each lost GPU's minor moved where a GPU NVML describes now has it.

    The driver numbers the GPUs (their minors, ``/dev/nvidia<minor>``) in the order it finds them at boot:
    a GPU no longer found takes its number with it and the GPUs after it move one lower, so the minor
    saved for a lost GPU may be a live GPU's now. That number names the live GPU's device node; the lost
    GPU (which has no node) gets a number above every GPU's, and the live one keeps its own."""
    live = {g.minor for g in gpus if g.index not in lost}
    taken = {g.minor for g in gpus}
    out = []
    for g in gpus:
        if g.index in lost and g.minor in live:
            minor = max(taken) + 1  # above every number the driver gave (as a stand-in without a saved minor)
            taken.add(minor)
            log.warning(
                "GPU %d (%s) is lost, and its minor %d is GPU %s's now (the driver numbered the GPUs again "
                "without it): it is counted with minor %d, which no GPU has",
                g.index,
                g.uuid,
                g.minor,
                next(o.index for o in gpus if o.minor == g.minor and o.index not in lost),
                minor,
            )
            g = dataclasses.replace(g, minor=minor)
        out.append(g)
    return out


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


#: NVML's loosest level (SYSTEM): what a pair with a lost GPU counts as when nothing better is known.
_SYSTEM_LEVEL = 50


def _common_ancestor(handles: Sequence[object], a: int, b: int) -> int:
    """NVML's level between GPUs ``a`` and ``b``; SYSTEM when NVML cannot tell (logged)."""
    try:
        return int(pynvml.nvmlDeviceGetTopologyCommonAncestor(handles[a], handles[b]))
    except pynvml.NVMLError as exc:
        log.error("GPUs %d and %d: NVML gives no topology level (%s); the pair counts as SYSTEM", a, b, exc)
        return _SYSTEM_LEVEL


def topology(gpus: list[GPUInfo], lost: Sequence[int] = (), saved: NodeTopology | None = None) -> NodeTopology:
    """Common-ancestor levels between every pair of GPUs, and their NVLink connections.

    Direct GPU-to-GPU links are counted per peer. GPUs whose links end at an
    NVSwitch are joined to each other when NVML confirms NVLink peer-to-peer
    between them; such a pair counts the smaller of the two GPUs' switch links.
    A lost GPU's pairs come from ``saved`` (the last inventory) when it has them,
    else count as SYSTEM with no NVLink.
    """
    n = len(gpus)
    gone = set(lost)
    handles: list[object] = []
    for g in gpus:
        found: object = None
        if g.index not in gone:
            try:
                found = handle(g.index)
            except pynvml.NVMLError as exc:
                log.error(
                    "GPU %d gave no handle while the topology was read (%s): its pairs count as SYSTEM", g.index, exc
                )
                gone.add(g.index)
        handles.append(found)
    usable_saved = saved is not None and len(saved.levels) == n
    levels = [[0] * n for _ in range(n)]
    for a in range(n):
        for b in range(a + 1, n):
            if a in gone or b in gone:
                level = saved.levels[a][b] if saved is not None and usable_saved else _SYSTEM_LEVEL
            else:
                level = _common_ancestor(handles, a, b)
            levels[a][b] = levels[b][a] = level
    by_bus = {g.pci_bus_id: g.index for g in gpus if g.index not in gone}
    per_gpu = [
        _nvlinks(h, g.index, by_bus) if g.index not in gone else _Links(peers={})
        for g, h in zip(gpus, handles, strict=True)
    ]
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
    if saved is not None and usable_saved:
        for a, b, count in saved.nvlink:
            if a in gone or b in gone:
                links[(a, b)] = count
    nvlink = tuple((a, b, c) for (a, b), c in sorted(links.items()))
    return NodeTopology(levels=tuple(tuple(row) for row in levels), nvlink=nvlink)
