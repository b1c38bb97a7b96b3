"""Host PIDs of a container, from its cgroup: v1 and v2, cgroupfs and systemd drivers, any CRI runtime.

The container's cgroup directory is looked up by the names the kubelet and the
runtimes use:

- cgroupfs: ``kubepods[/burstable|/besteffort]/pod<uid>/<container id>`` (containerd, docker), or
  ``.../pod<uid>/<prefix>-<id>[.scope]`` (CRI-O: ``crio-<id>``, beside its monitor's ``crio-conmon-<id>``)
- systemd:  ``kubepods.slice[/kubepods-<qos>.slice]/kubepods[-<qos>]-pod<uid, - as _>.slice/<prefix>-<id>.scope``
  with prefix ``docker``, ``cri-containerd`` (containerd) or ``crio`` (CRI-O)

under the unified hierarchy (v2) or a v1 controller (memory, pids, cpu,cpuacct,
systemd). When none exists (an unusual layout), the tree is searched for a
directory named after the container ID (alone, after a runtime's prefix, or
containerd's ``<pod slice>:<prefix>:<id>``) below one named after the pod. Every
``cgroup.procs`` below the container's directory is read.

A container whose cgroup is gone (its pod terminating) or not made yet is asked
for each second until its allocation ends; :class:`CgroupLocator` searches the
whole tree for it at most every :data:`SEARCH_BACKOFF_SECONDS` (a node with
hundreds of pods has thousands of cgroup directories), looking only at the
standard names in between (its pod's directory first: a pod that ended has none).
The containers missed within :data:`TREE_WALK_SECONDS` of a walk are searched for
in that walk: pods that end together cost a walk or two, not one each. Only a walk
made since a container was first missed starts its backoff (one made before may
not show a cgroup made since): the next ask searches again. A container ID that no pod status names (a caller's
claim, :meth:`CgroupLocator.find_claimed`) is looked for only below the pod's own
cgroup directory, listed at most every :data:`POD_LISTING_SECONDS` per pod, however
many IDs are asked for.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Collection, Iterator
from pathlib import Path

log = logging.getLogger(__name__)

_QOS = ("", "burstable", "besteffort")
_PREFIXES = ("cri-containerd", "crio", "docker", "containerd")
#: The prefixes runtimes put before a container ID in its cgroup's name.
RUNTIME_PREFIXES = _PREFIXES
_V1_CONTROLLERS = ("memory", "pids", "cpu,cpuacct", "cpuacct", "systemd")
#: After a search of the whole tree found no cgroup for a container, the next one waits this long.
SEARCH_BACKOFF_SECONDS = 30.0
#: How long one walk of the whole tree answers the searches of every container missed meanwhile: a sweep
#: asks for hundreds of containers within milliseconds, and those of pods that ended together would
#: otherwise each walk it.
TREE_WALK_SECONDS = 0.5
#: How long a listing of a pod's cgroup directory answers for every ID asked of that pod.
POD_LISTING_SECONDS = 1.0
#: How deep below the pod's cgroup directory a container's is looked for.
_POD_LISTING_DEPTH = 3


def _pod_candidates(pod_uid: str, qos: str | None) -> Iterator[str]:
    """The pod's own cgroup directory under the cgroupfs and systemd drivers."""
    classes = _QOS if qos is None else (("" if qos.lower() == "guaranteed" else qos.lower()),)
    under = pod_uid.replace("-", "_")
    for q in classes:
        yield "kubepods" + (f"/{q}" if q else "") + f"/pod{pod_uid}"
        slice_dir = "kubepods.slice" + (f"/kubepods-{q}.slice" if q else "")
        yield f"{slice_dir}/kubepods{'-' + q if q else ''}-pod{under}.slice"


def pod_cgroups(cgroup_root: Path, pod_uid: str, qos: str | None = None) -> list[Path]:
    """The pod's cgroup directories that exist (one per hierarchy: v2, or each v1 controller)."""
    return [
        Path(root, rel)
        for root in _roots(cgroup_root)
        for rel in _pod_candidates(pod_uid, qos)
        if os.path.isdir(f"{root}/{rel}")
    ]


def _list_below(directories: list[Path], max_depth: int = _POD_LISTING_DEPTH) -> list[Path]:
    """Every directory below these, to ``max_depth`` levels."""
    found: list[Path] = []
    for top in directories:
        base_depth = len(top.parts)
        for dirpath, dirnames, _ in os.walk(top):
            here = Path(dirpath)
            if here != top:
                found.append(here)
            if len(here.parts) - base_depth >= max_depth:
                dirnames[:] = []
    return found


def _roots(cgroup_root: Path) -> list[str]:
    """The unified hierarchy's root and every v1 controller's there is (paths as text: this is asked for
    every container not found, each second)."""
    top = str(cgroup_root)
    return [top, *(d for c in _V1_CONTROLLERS if os.path.isdir(d := f"{top}/{c}"))]


def find_container_cgroup(
    cgroup_root: Path, pod_uid: str, container_id: str, qos: str | None = None, *, search: bool = True
) -> Path | None:
    """The container's cgroup directory, or None. ``search=False``: by the standard names only, without
    searching the tree."""
    found = _standard_cgroup(cgroup_root, pod_uid, container_id, qos)
    if found is not None:
        return Path(found)
    return _search(cgroup_root, pod_uid, container_id) if search else None


def _standard_cgroup(cgroup_root: Path, pod_uid: str, container_id: str, qos: str | None) -> str | None:
    """The container's cgroup directory by the standard names (the module's list: for each hierarchy and
    QoS class, cgroupfs's, then systemd's), or None. A pod's directory is looked at before its
    containers': a pod that ended has none, and costs a look per hierarchy, not one per name (the
    pids.config refresh asks for its containers each second until their allocations end)."""
    classes = _QOS if qos is None else (("" if qos.lower() == "guaranteed" else qos.lower()),)
    under = pod_uid.replace("-", "_")
    isdir = os.path.isdir
    for top in _roots(cgroup_root):
        for q in classes:
            pod_dir = f"{top}/kubepods{'/' + q if q else ''}/pod{pod_uid}"
            if isdir(pod_dir):
                if isdir(found := f"{pod_dir}/{container_id}"):
                    return found
                for prefix in _PREFIXES:
                    for name in (f"{prefix}-{container_id}", f"{prefix}-{container_id}.scope"):
                        if isdir(found := f"{pod_dir}/{name}"):
                            return found
            slice_dir = f"{top}/kubepods.slice" + (f"/kubepods-{q}.slice" if q else "")
            pod_slice = f"{slice_dir}/kubepods{'-' + q if q else ''}-pod{under}.slice"
            if isdir(pod_slice):
                for prefix in _PREFIXES:
                    if isdir(found := f"{pod_slice}/{prefix}-{container_id}.scope"):
                        return found
    return None


def _search(cgroup_root: Path, pod_uid: str, container_id: str, max_depth: int = 8) -> Path | None:
    pod_marks = (pod_uid, pod_uid.replace("-", "_"))
    base_depth = len(cgroup_root.parts)
    for dirpath, dirnames, _ in os.walk(cgroup_root):
        here = Path(dirpath)
        if len(here.parts) - base_depth >= max_depth:
            dirnames[:] = []
            continue
        if _names_container(here.name, container_id) and any(m in str(here) for m in pod_marks):
            return here
    return None


def _index_tree(cgroup_root: Path, max_depth: int = 8) -> dict[str, list[str]]:
    """One walk of the tree (as deep as :func:`_search` looks, in the same order, not into links): every
    directory whose name may name a container, by each container ID it may name (:func:`_ids_named`)."""
    index: dict[str, list[str]] = {}

    def visit(path: str, name: str, depth: int) -> None:
        if depth >= max_depth:
            return
        try:
            with os.scandir(path) as entries:
                below = [(e.path, e.name) for e in entries if e.is_dir(follow_symlinks=False)]
        except OSError:
            return  # not listed, not taken (as os.walk leaves it out)
        for key in _ids_named(name):
            index.setdefault(key, []).append(path)
        for child, child_name in below:
            visit(child, child_name, depth + 1)

    visit(str(cgroup_root), cgroup_root.name, 0)
    return index


def _ids_named(name: str) -> set[str]:
    """Every container ID for which :func:`_names_container` may take a directory of this name for the
    container's: the name itself, what follows a runtime's prefix, what follows containerd's
    ``:<prefix>:`` (``.scope`` left out)."""
    base = name.removesuffix(".scope")
    ids = {base}
    for prefix in _PREFIXES:
        if base.startswith(f"{prefix}-"):
            ids.add(base[len(prefix) + 1 :])
        marker = f":{prefix}:"
        at = base.find(marker)
        while at >= 0:
            ids.add(base[at + len(marker) :])
            at = base.find(marker, at + 1)
    return ids


def _search_index(index: dict[str, list[str]], pod_uid: str, container_id: str) -> Path | None:
    """What :func:`_search` finds, from a walk's index (:func:`_index_tree`): a directory gone since the
    walk is not (a container that restarted meanwhile)."""
    pod_marks = (pod_uid, pod_uid.replace("-", "_"))
    for dirpath in index.get(container_id, ()):
        if (
            _names_container(os.path.basename(dirpath), container_id)
            and any(m in dirpath for m in pod_marks)
            and os.path.isdir(dirpath)
        ):
            return Path(dirpath)
    return None


def _names_container(name: str, container_id: str) -> bool:
    """Whether a cgroup directory is the container's: its ID whole, alone or after a runtime's own
    prefix (``cri-containerd-<id>.scope``, ``docker-<id>.scope``, ``crio-<id>``, containerd's
    ``<pod slice>:cri-containerd:<id>``), not a part of a longer name (``pod``, ``slice`` or a piece of
    another container's ID would match a substring), nor another prefix: CRI-O's ``crio-conmon-<id>``
    holds the container's monitor, not the container."""
    base = name.removesuffix(".scope")
    if base == container_id:
        return True
    return any(base == f"{p}-{container_id}" or base.endswith(f":{p}:{container_id}") for p in _PREFIXES)


def without_runtime_prefix(name: str) -> str | None:
    """The container ID in a cgroup directory name made of a runtime's prefix and the ID (CRI-O's
    cgroupfs ``crio-<id>``, ``docker-<id>``): what the vcuda-controller library sends as the container ID
    when it takes the last component of its cgroup path whole. None when there is no such prefix."""
    for prefix in _PREFIXES:
        if name.startswith(f"{prefix}-") and len(name) > len(prefix) + 1:
            return name[len(prefix) + 1 :]
    return None


def id_in_name(name: str) -> str | None:
    """The container ID a cgroup directory's name holds (:func:`_names_container`'s forms), or None: a
    control file, a slice, CRI-O's ``crio-conmon-<id>`` (the monitor's, not the container's)."""
    base = name.removesuffix(".scope")
    if ":" in base:
        parts = base.split(":")
        return parts[2] if len(parts) == 3 and parts[1] in _PREFIXES and parts[2] else None
    for prefix in _PREFIXES:
        if base.startswith(f"{prefix}-"):
            rest = base[len(prefix) + 1 :]
            if not rest or (prefix == "crio" and rest.startswith("conmon-")):
                return None
            return rest
    if not base or "." in base:
        return None
    return base


def pids_under(directory: Path | str) -> list[int]:
    """Every PID in ``cgroup.procs`` of a cgroup and its descendants, sorted."""
    found: set[int] = set()
    for dirpath, _, filenames in os.walk(directory):
        if "cgroup.procs" in filenames:
            found.update(_read_procs(os.path.join(dirpath, "cgroup.procs")))
    return sorted(found)


_READ_BYTES = 65536  # a cgroup.procs is read in pieces this large (the kernel may give less before its end)
_hidden_seen = False  # a cgroup.procs named a process outside the agent's PID namespace (as 0)


def hidden_processes_seen() -> bool:
    """Whether a ``cgroup.procs`` read named a process outside the agent's PID namespace (the agent does
    not run with hostPID: it cannot tell containers' host PIDs)."""
    return _hidden_seen


def _read_procs(path: str) -> list[int]:
    """The PIDs of one ``cgroup.procs`` (empty when it cannot be read). Under cgroup v2 a process outside
    the reader's PID namespace is listed as 0: no PID, left out (and reported once)."""
    global _hidden_seen
    try:
        # Plain system calls: no file object (this is read for every shared container each second).
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            chunks = []
            while chunk := os.read(fd, _READ_BYTES):
                chunks.append(chunk)
        finally:
            os.close(fd)
    except OSError as exc:
        log.debug("cannot read %s: %s", path, exc)
        return []
    data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    pids = [int(word) for word in data.split() if word.isdigit()]
    if 0 in pids:
        if not _hidden_seen:
            _hidden_seen = True
            log.warning(
                "%s names processes outside the agent's PID namespace (listed as 0): pids.config files cannot "
                "hold containers' host PIDs; run the agent with hostPID",
                path,
            )
        pids = [p for p in pids if p > 0]
    return pids


def _pids_of(directory: str, links: int) -> list[int]:
    """PIDs of a cgroup directory and its descendants, given the directory's link count.

    cgroupfs (kernfs), like ext4 and tmpfs, counts a directory's links as 2 plus its
    subdirectories: at 2 the cgroup has no child and its ``cgroup.procs`` is read alone,
    without listing the dozens of control files beside it. Any other count (a child, or a
    file system that does not count) walks the tree.
    """
    if links == 2:
        return sorted(set(_read_procs(directory + "/cgroup.procs")))
    return pids_under(directory)


def container_pids(cgroup_root: Path, pod_uid: str, container_id: str, qos: str | None = None) -> list[int]:
    """Host PIDs of a container (empty when its cgroup is not found)."""
    directory = find_container_cgroup(cgroup_root, pod_uid, container_id, qos)
    if directory is None:
        log.warning("no cgroup found for pod %s container %s under %s", pod_uid, container_id, cgroup_root)
        return []
    return pids_under(directory)


class CgroupLocator:
    """Finds containers' PIDs, remembering each container's cgroup directory while it exists.

    A container whose directory is known costs one ``stat`` and one read of its ``cgroup.procs``
    (see :func:`_pids_of`): the pids.config refresh and the metrics' process placement ask for
    every shared container each second. One whose directory is not found costs a look at the
    standard names, and a search of the whole tree at most every ``search_backoff`` seconds
    (``search=True`` searches at once). A container ID a caller claims is looked for by
    :meth:`find_claimed`, below its pod's cgroup.
    """

    def __init__(
        self,
        cgroup_root: Path,
        *,
        limit: int = 4096,
        search_backoff: float = SEARCH_BACKOFF_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.root = cgroup_root
        self._limit = limit
        self._backoff = search_backoff
        self._clock = clock
        self._dirs: dict[tuple[str, str], str] = {}
        self._searched: dict[tuple[str, str], float] = {}  # container -> when a whole-tree search missed it
        # pod UID -> (when, the directories below its cgroup then); for IDs no status names.
        self._listings: dict[str, tuple[float, list[Path]]] = {}
        # pod UID -> (its cgroup directory where its containers' are, the names in it when a container's
        # cgroup was first found there): what was there before a restart (the sandbox's, too).
        self._before: dict[str, tuple[str, frozenset[str]]] = {}
        # pod UID -> the names of those that no status named then (its sandbox's; see settle()), and the
        # pods whose names are not told yet.
        self._sandboxes: dict[str, frozenset[str]] = {}
        self._unsettled: set[str] = set()
        self._pod_searched: dict[str, float] = {}  # pod UID -> its last whole-tree search for a claimed ID
        self._walked: tuple[float, dict[str, list[str]]] | None = None  # the last walk of the tree, and when
        # container -> when the standard names first missed it, until a walk made since searched for it.
        self._missing: dict[tuple[str, str], float] = {}

    def find(self, pod_uid: str, container_id: str, qos: str | None = None, *, search: bool = False) -> Path | None:
        """The container's cgroup directory (below its pod's), or None when there is none."""
        key = (pod_uid, container_id)
        directory = self._dirs.get(key)
        if directory is not None and os.path.isdir(directory):
            return Path(directory)
        return self._find_again(key, qos, search)

    def _find_again(self, key: tuple[str, str], qos: str | None, search: bool) -> Path | None:
        now = self._clock()
        missed = self._searched.get(key)
        whole = search or missed is None or now - missed >= self._backoff
        found = find_container_cgroup(self.root, key[0], key[1], qos, search=False)
        walked = now
        if found is None and whole:
            found, walked = self._search(key[0], key[1], fresh=search)
        if found is None:
            self._dirs.pop(key, None)
            if whole:
                self._limit_memo(self._missing)
                if walked >= self._missing.setdefault(key, now):
                    # Searched for by a walk made since it was first missed: none again for the backoff. A
                    # walk made before (another container's) may not show a cgroup made since: the next
                    # ask searches again, in a walk of its own or one shared with it.
                    del self._missing[key]
                    self._limit_memo(self._searched)
                    self._searched[key] = now
            return None
        self._searched.pop(key, None)
        self._missing.pop(key, None)
        if len(self._dirs) >= self._limit:
            self._dirs.clear()
        self._dirs[key] = str(found)
        if key[0] not in self._before:
            self._note_pod(key[0], found.parent)
        return found

    def _search(self, pod_uid: str, container_id: str, *, fresh: bool) -> tuple[Path | None, float]:
        """The whole tree searched for the container, and when that walk was made: a walk made within
        :data:`TREE_WALK_SECONDS` answers (one walk for the containers a sweep misses), unless ``fresh``."""
        now = self._clock()
        walked = self._walked
        if fresh or walked is None or not 0 <= now - walked[0] < TREE_WALK_SECONDS:
            walked = self._walked = (now, _index_tree(self.root))
        return _search_index(walked[1], pod_uid, container_id), walked[0]

    def _note_pod(self, pod_uid: str, directory: Path) -> None:
        """Remember what the pod's cgroup directory holds now (once: a listing per pod, not per pass)."""
        if pod_uid not in directory.name and pod_uid.replace("-", "_") not in directory.name:
            return  # a container's cgroup not directly below its pod's (an unusual layout)
        try:
            names = frozenset(os.listdir(directory))
        except OSError:
            return
        self._limit_memo(self._before)
        if not self._before:
            self._sandboxes.clear()
            self._unsettled.clear()
        self._before[pod_uid] = (str(directory), names)
        self._unsettled.add(pod_uid)

    def unsettled(self, pod_uid: str) -> bool:
        """Whether the pod's cgroup was just seen and which of its entries no status names is not told yet
        (:meth:`settle`); a look at an empty set while none is."""
        return bool(self._unsettled) and pod_uid in self._unsettled

    def settle(self, pod_uid: str, ids: Collection[str]) -> None:
        """Tell what the pod's cgroup held when first seen that the pod's statuses do not name (``ids``, read
        at the same time): its sandbox's cgroup (the pause container's). Should one of them go, the sandbox
        was made again and every container starts again: :meth:`new_below_pod` tells nothing then."""
        entry = self._before.get(pod_uid)
        self._unsettled.discard(pod_uid)
        if entry is None:
            return
        unnamed = frozenset(n for n in entry[1] if (found := id_in_name(n)) is not None and found not in ids)
        self._sandboxes[pod_uid] = unnamed

    def located(self, pod_uid: str, container_id: str) -> bool:
        """Whether the container's cgroup was found at the last look (:meth:`pids`, :meth:`find`)."""
        return (pod_uid, container_id) in self._dirs

    def watches(self, pod_uid: str) -> bool:
        """Whether the pod's cgroup directory was seen holding a container's (:meth:`new_below_pod`)."""
        return pod_uid in self._before

    def new_below_pod(self, pod_uid: str, ids: Collection[str]) -> tuple[set[str], list[tuple[str, Path]]] | None:
        """Of the container IDs ``ids`` (those the pod's statuses name), the ones without a cgroup below the
        pod's now; and the containers' cgroups there that name none of them and were not there when the pod's
        cgroup was first seen (the sandbox's was): (their ID, directory). None when the pod's cgroup was
        never seen holding a container's (or :meth:`settle` was not called), is gone (it is not looked at
        again: a pod's does not return), or no longer holds its sandbox's.
        """
        entry = self._before.get(pod_uid)
        sandboxes = self._sandboxes.get(pod_uid)
        if entry is None or sandboxes is None:
            return None
        directory, before = entry
        try:
            listed = os.listdir(directory)
        except FileNotFoundError:
            self._forget_before(pod_uid)
            return None
        except OSError as exc:
            log.debug("cannot list %s: %s", directory, exc)
            return None
        if not sandboxes.issubset(listed):
            # The sandbox was made again (its new cgroup is not a container's): seen anew at the next
            # container found.
            self._forget_before(pod_uid)
            return None
        present = {}
        for name in listed:
            found = id_in_name(name)
            if found is not None:
                present[found] = name
        missing = {i for i in ids if i not in present}
        new = [
            (found, Path(directory, name))
            for found, name in present.items()
            if name not in before and found not in ids and os.path.isdir(os.path.join(directory, name))
        ]
        return missing, new

    def find_claimed(self, pod_uid: str, container_id: str, qos: str | None = None) -> Path | None:
        """The cgroup of a container ID that no pod status names (a caller's claim, maybe bogus).

        By the standard names, else among the directories below the pod's own cgroup, listed at
        most every :data:`POD_LISTING_SECONDS` for all IDs of the pod. A pod without a cgroup
        directory of a standard name (an unusual layout) has the whole tree searched, at most every
        ``search_backoff`` seconds for all its IDs.
        """
        key = (pod_uid, container_id)
        directory = self._dirs.get(key)
        if directory is not None and os.path.isdir(directory):
            return Path(directory)
        found = find_container_cgroup(self.root, pod_uid, container_id, qos, search=False)
        if found is None:
            now = self._clock()
            listing = self._listings.get(pod_uid)
            if listing is None or now - listing[0] >= POD_LISTING_SECONDS:
                pods = pod_cgroups(self.root, pod_uid, qos)
                if pods:
                    self._limit_memo(self._listings)
                    listing = (now, _list_below(pods))
                    self._listings[pod_uid] = listing
            if listing is not None:
                found = next((d for d in listing[1] if _names_container(d.name, container_id)), None)
                if found is not None and not found.is_dir():
                    found = None
            else:
                last = self._pod_searched.get(pod_uid)
                if last is None or now - last >= self._backoff:
                    self._limit_memo(self._pod_searched)
                    self._pod_searched[pod_uid] = now
                    found = _search(self.root, pod_uid, container_id)
        if found is not None:
            self._limit_memo(self._dirs)
            self._dirs[key] = str(found)
        return found

    def _forget_before(self, pod_uid: str) -> None:
        self._before.pop(pod_uid, None)
        self._sandboxes.pop(pod_uid, None)
        self._unsettled.discard(pod_uid)

    def _limit_memo(
        self,
        memo: dict[str, tuple[float, list[Path]]]
        | dict[str, float]
        | dict[tuple[str, str], str]
        | dict[tuple[str, str], float]
        | dict[str, tuple[str, frozenset[str]]],
    ) -> None:
        if len(memo) >= self._limit:
            memo.clear()

    def pids(self, pod_uid: str, container_id: str, qos: str | None = None, *, search: bool = False) -> list[int]:
        """Host PIDs of a container (empty when its cgroup is not found)."""
        key = (pod_uid, container_id)
        directory = self._dirs.get(key)
        if directory is not None:
            try:
                links = os.stat(directory).st_nlink
            except OSError:
                directory = None
        if directory is None:
            found = self._find_again(key, qos, search)
            if found is None:
                return []
            directory = str(found)
            try:
                links = os.stat(directory).st_nlink
            except OSError:
                return []
        return _pids_of(directory, links)

    def forget_pod(self, pod_uid: str) -> None:
        """Drop what is remembered of a pod's containers."""
        for memo in (self._dirs, self._searched, self._missing):
            for key in [k for k in list(memo) if k[0] == pod_uid]:  # list(): other threads add meanwhile
                memo.pop(key, None)
        self._listings.pop(pod_uid, None)
        self._pod_searched.pop(pod_uid, None)
        self._forget_before(pod_uid)
