"""Building the driver volumes: the entry point :func:`build_vdriver`.

On-disk layout under each volume base (``/etc/gpu-manager/vdriver``)::

    nvidia -> .trees/nvidia-<fingerprint>      stable paths, the mount sources of Allocate
    origin -> .trees/origin-<fingerprint>
    .trees/nvidia-<fingerprint>/{bin,lib,lib64}
    .trees/nvidia-<fingerprint>.json           manifest; a tree without one is incomplete
    .vdriver.lock

The fingerprint covers the volume's configuration, the share mode, the identity (device, inode,
size, mtime, mode) of every driver file, and the content (sha256) of the agent's own files, the
interceptor and ``gpu-client``: they lie in the agent's image, whose device and inodes change at
every start of its container. An unchanged driver gives the same
fingerprint, and the run touches nothing; a changed one gives a new tree, written beside the old
and published by an atomic symlink swap (see :mod:`gpumanager.volume.publish`). Old trees are
removed once they are neither current, nor mapped by a process, nor mounted in a container.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import secrets
import shutil
import stat
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from gpumanager.volume.config import NVIDIA_VOLUME, VolumeSpec, load_volume_config
from gpumanager.volume.discovery import BIN_DIR, Discovery, Identity, SourceFile, driver_version, identity_of
from gpumanager.volume.elffacts import ElfFacts, read_elf_facts
from gpumanager.volume.errors import NotElfError, VolumeError
from gpumanager.volume.inuse import Place, ProcScan, place_of, scan_proc
from gpumanager.volume.ldcache import CacheArch, LdCache, host_lib_dirs, read_ldcache
from gpumanager.volume.mirror import CONTROL_LIBRARY, DIR_FOR_BITS, Interceptor, plan_volume
from gpumanager.volume.publish import current_target, publish, tidy_leftovers
from gpumanager.volume.rootfs import DEFAULT_SEARCH_PATH, DriverRoot, ResolveError
from gpumanager.volume.settle import check_install
from gpumanager.volume.tree import Manifest, build_tree, manifest_path, read_manifest, verify_tree, write_manifest
from gpumanager.volume.version import DriverVersion

log = logging.getLogger(__name__)

TREES_DIR = ".trees"
LOCK_FILE = ".vdriver.lock"
STAGING_PREFIX = ".staging-"
LAYOUT_VERSION = "vdriver-tree-3"  # bump when the mirror rules change, so trees are rebuilt
LD_SO_CACHE = "etc/ld.so.cache"
#: The registration client of upstream's library; the agent brings its own (--gpu-client).
GPU_CLIENT = "gpu-client"
#: sha256 of the agent's own files by (path, identity): they are read once, not at every check
_DIGESTS: dict[tuple[str, Identity], str] = {}
_MAX_DIGESTS = 16


@dataclass(frozen=True)
class VolumeOutcome:
    """One volume after the run.

    ``path`` is the stable path (mount source), ``tree`` the directory it names now. ``changed``:
    the path names another tree than before the run; ``built``: that tree was written by this run.
    """

    name: str
    path: Path
    tree: Path
    changed: bool
    built: bool
    previous_tree: Path | None
    files: int
    links: int


@dataclass(frozen=True)
class VdriverResult:
    """What :func:`build_vdriver` did.

    ``nvidia`` is the share-mode mount source (upstream's DriverLibraryPath), ``origin`` the one of
    exclusive containers (DriverOriginLibraryPath); either is None when not configured.
    """

    volumes: tuple[VolumeOutcome, ...]
    nvidia: Path | None
    origin: Path | None
    driver_version: DriverVersion | None
    removed_trees: tuple[Path, ...] = ()
    kept_trees: tuple[tuple[Path, str], ...] = ()
    warnings: tuple[str, ...] = ()
    #: share mode only: why shared containers get no interceptor under ``libcuda.so.1`` ('' when they do)
    share_problem: str = ""
    #: why the driver root looks half-installed ('' when it does not): no tree was built or
    #: published, ``volumes`` are the trees published before, and the root should be checked again soon
    install_in_progress: str = ""

    @property
    def changed(self) -> bool:
        """True when any volume path names another tree than before, or an old tree was removed."""
        return any(v.changed for v in self.volumes) or bool(self.removed_trees)


def build_vdriver(
    *,
    volume_config: Path,
    base_dir_override: Path | None = None,
    driver_root: Path = Path("/"),
    share_mode: bool,
    interceptor: Path | None,
    proc_root: Path = Path("/proc"),
    machine: str | None = None,
    search_path: Sequence[str] = DEFAULT_SEARCH_PATH,
    allow_hardlinks: bool = True,
    gpu_client: Path | None = None,
    now: float | None = None,
    settle_seconds: float = 0.0,
) -> VdriverResult:
    """Mirror the driver of ``driver_root`` into the volumes of ``volume_config``.

    ``base_dir_override`` replaces every volume's ``base``. ``interceptor`` (``libcuda-control.so``)
    is swapped in for ``libcuda.so.1`` in the share-mode volume (named ``nvidia``); when it is
    missing or unusable, that volume is left as it was (none is published without it), the others
    are built, and :attr:`VdriverResult.share_problem` names the file and why. ``machine``
    (default: this host) selects the cache entries used; ``search_path`` is where binaries are
    looked for in the root; ``allow_hardlinks=False`` copies every file. ``gpu_client``: the agent's own ``gpu-client``,
    used for that binary wherever volume.conf lists it (when missing, a warning, and the driver
    root's PATH is searched as for any binary). Raises VolumeError naming the file or value at fault.

    ``settle_seconds`` > 0: when the root looks half-installed (see :mod:`gpumanager.volume.settle`)
    and its driver files changed within that many seconds of ``now`` (default: the current time),
    nothing is built or published: :attr:`VdriverResult.install_in_progress` says why, and the
    result describes the trees published before.
    """
    config = load_volume_config(volume_config).with_base(base_dir_override)
    lib_dirs = host_lib_dirs(machine)
    if not config.volumes:
        log.warning("volume config %s has no volumes: nothing to mirror", volume_config)
        return VdriverResult((), None, None, None)
    root = DriverRoot(driver_root)
    cache = read_ldcache(_cache_path(root))
    cache_warnings: list[str] = []
    if cache.skipped:
        cache_warnings.append(
            f"{cache.path}: {cache.skipped} {'entry' if cache.skipped == 1 else 'entries'} skipped, their string "
            "offsets leading outside the file (glibc's loader skips them too); the rest of the cache is used"
        )
    nvidia_spec = next((v for v in config.volumes if v.name == NVIDIA_VOLUME), None)
    control: Interceptor | None = None
    control_problem = ""
    if share_mode and nvidia_spec is not None:
        try:
            control = _interceptor(interceptor, lib_dirs)
        except VolumeError as err:
            # Whole GPUs need no interceptor: the other volumes are still built. The share-mode
            # tree is left as it was (none is published without the interceptor), and shares are
            # refused through share_problem.
            control_problem = str(err)
    skipped = nvidia_spec if control_problem else None
    built_volumes = [v for v in config.volumes if v is not skipped]
    provided: dict[str, SourceFile] = {}
    client_warnings: list[str] = []
    if gpu_client is not None and any(GPU_CLIENT in v.binaries for v in config.volumes):
        try:
            provided[GPU_CLIENT] = _own_binary(gpu_client, GPU_CLIENT)
        except VolumeError as err:
            log.debug("%s", err)
            client_warnings.append(str(err))
    discovery = Discovery(root, cache, lib_dirs, search_path, provided)
    sources = {v: discovery.sources(v) for v in config.volumes}
    all_sources = [s for v in config.volumes for s in sources[v]]
    run = _Run(share_mode, control, allow_hardlinks, proc_root, machine or "")
    prefixes = sorted({p for v in config.volumes for p in v.libraries})
    install = check_install(
        root, cache, all_sources, prefixes, now=time.time() if now is None else now, settle=settle_seconds
    )
    outcomes: list[VolumeOutcome] = []
    if install.in_progress:
        # A tree built now could miss libraries or mix versions, and containers keep theirs for
        # life: the published trees stay, the caller checks again soon.
        outcomes = _published(built_volumes)
        log.debug("driver mirror: %s; the published trees are kept", install.in_progress)
    else:
        if install.mixed:
            run.warn(f"{install.mixed} (no change for {settle_seconds:g} s: mirrored as the host has them)")
        for base, volumes in _by_base(built_volumes).items():
            try:
                outcomes.extend(run.sync_base(base, volumes, sources))
            except OSError as err:
                raise VolumeError(f"driver mirror under {base}: {err}") from err
    version = driver_version(all_sources)
    if version is None:
        run.warn(f"no libcuda.so.<version> found through {cache.path}: driver version unknown")
    nvidia_outcome = next((o for o in outcomes if o.name == NVIDIA_VOLUME), None)
    nvidia = nvidia_outcome.path if nvidia_outcome else None
    if skipped is not None and skipped.path.exists():
        nvidia = skipped.path  # an earlier tree, left as it was
    origin = next((o.path for o in reversed(outcomes) if o.name != NVIDIA_VOLUME), None)
    problem = ""
    if share_mode:
        if install.in_progress and nvidia_outcome is None and nvidia_spec is not None and skipped is None:
            problem = f"share mode has no interceptor: the share-mode tree {nvidia_spec.path} is not built yet: "
            problem += install.in_progress
        elif skipped is not None:
            kept = "is left as it was" if nvidia else "is not built"
            problem = f"share mode has no interceptor: {control_problem}; the share-mode tree {skipped.path} {kept}"
        elif nvidia_outcome is None or nvidia_spec is None or control is None:
            problem = f"volume config {volume_config} has no volume named {NVIDIA_VOLUME!r}, the share-mode tree"
        else:
            problem = _missing_interceptor(nvidia_outcome.tree, nvidia_spec, control, cache, lib_dirs, run)
    result = VdriverResult(
        volumes=tuple(outcomes),
        nvidia=nvidia,
        origin=origin,
        driver_version=version,
        removed_trees=tuple(run.removed),
        kept_trees=tuple(run.kept),
        # while an install goes on, the files it has not finished are not warned about
        warnings=tuple(
            cache_warnings + client_warnings
            if install.in_progress
            else cache_warnings + client_warnings + discovery.warnings + run.warnings
        ),
        share_problem=problem,
        install_in_progress=install.in_progress,
    )
    # The caller (gpumanager.volume.keeper) logs a change of trees and a share problem once: this runs
    # at every recheck of the host.
    log.debug(
        "driver mirror: version %s, %s",
        version or "unknown",
        ", ".join(f"{o.name} -> {o.tree.name}{' (new)' if o.changed else ''}" for o in outcomes),
    )
    return result


def _published(volumes: Sequence[VolumeSpec]) -> list[VolumeOutcome]:
    """The trees the volumes' paths name now, left as they are (a volume without one is left out)."""
    outcomes: list[VolumeOutcome] = []
    for volume in volumes:
        target = current_target(volume.path)
        if not target or not target.startswith(TREES_DIR + "/"):
            continue
        tree = volume.path.parent / target
        manifest = read_manifest(tree)
        if manifest is not None:
            outcomes.append(_outcome(volume, tree, manifest, changed=False, built=False, previous=None))
    return outcomes


def _cache_path(root: DriverRoot) -> Path:
    """Where the agent reads the host's ``/etc/ld.so.cache``: its symlinks are resolved inside the root."""
    try:
        return root.agent_path(root.resolve("/" + LD_SO_CACHE))
    except ResolveError as err:
        raise VolumeError(f"cannot read ld.so.cache {root.agent_path(LD_SO_CACHE)}: {err}") from err


def _missing_interceptor(
    tree: Path, volume: VolumeSpec, control: Interceptor, cache: LdCache, lib_dirs: dict[CacheArch, str], run: _Run
) -> str:
    """Why the share-mode ``tree`` holds no interceptor under ``libcuda.so.1`` ('' when it does).

    A missing ``libnvidia-ml.so.1`` is only warned about: the container then has no NVML, but
    nothing to escape its limits with either.
    """
    home = DIR_FOR_BITS[control.bits]
    missing: list[str] = []
    for soname in ("libcuda.so.1", "libnvidia-ml.so.1"):
        try:
            swapped = os.stat(tree / home / soname).st_ino == os.stat(tree / home / CONTROL_LIBRARY).st_ino
        except OSError:
            swapped = False
        if swapped:
            continue
        stem = soname.split(".so", 1)[0] + ".so"
        found = [e for e in cache.entries if e.is_elf and e.key.startswith(stem)]
        here = [e.value for e in found if lib_dirs.get(e.arch) == home]
        if not soname.startswith(tuple(volume.libraries)):
            why = f"the {volume.name} volume of the volume config lists no {stem}"
        elif here:
            why = f"{cache.path} names {', '.join(here)}, but none could be mirrored (see the warnings)"
        elif found:
            dirs = sorted(
                {
                    f"{lib_dirs[e.arch]}/" if e.arch in lib_dirs else f"{e.arch.name.lower()} (foreign here)"
                    for e in found
                }
            )
            why = (
                f"{cache.path} has no {stem}.* for {home}/ (only for {', '.join(dirs)}), "
                f"and the interceptor {control.path} is {control.bits}-bit"
            )
        else:
            why = f"{cache.path} has no {stem}.* entry"
        message = f"the share-mode tree {tree} has no {soname} swapped for the interceptor: {why}"
        if soname == "libcuda.so.1":
            missing.append(message)
        else:
            run.warn(message)
    return f"share mode has no interceptor: {missing[0]}" if missing else ""


def _foreign(arch: CacheArch) -> str:
    return f"{arch.name.lower()} (foreign here)"


#: The ELF machine (pyelftools' name) of the objects of each cache ABI the mirror uses.
_ELF_MACHINE = {
    CacheArch.X86_64: "EM_X86_64",
    CacheArch.I386: "EM_386",
    CacheArch.AARCH64: "EM_AARCH64",
    CacheArch.PPC64: "EM_PPC64",
}


def _interceptor(path: Path | None, lib_dirs: dict[CacheArch, str]) -> Interceptor:
    if path is None:
        raise VolumeError("no interceptor library (libcuda-control.so) was given")
    try:
        os.stat(path)  # a missing file is named as missing, not as an unusable library
    except OSError as err:
        raise VolumeError(f"interceptor library {path}: {err.strerror or err}") from err
    try:
        facts = read_elf_facts(path)
    except NotElfError as err:
        raise VolumeError(f"interceptor library {path} is unusable: {err}") from err
    if facts.bits not in DIR_FOR_BITS:
        raise VolumeError(f"interceptor library {path} has an unknown ELF class ({facts.bits}-bit)")
    machines = {_ELF_MACHINE[arch] for arch in lib_dirs if arch in _ELF_MACHINE}
    if machines and facts.machine not in machines:
        raise VolumeError(
            f"interceptor library {path} is built for {facts.machine}, this host loads "
            f"{', '.join(sorted(machines))} libraries"
        )
    try:
        identity, digest = _own_file(path)
    except OSError as err:
        raise VolumeError(f"interceptor library {path}: {err.strerror or err}") from err
    return Interceptor(path, identity, facts.bits, digest)


def _own_file(path: Path) -> tuple[Identity, str]:
    """The identity and sha256 of one of the agent's own files, read through one descriptor.

    The digest is remembered by path and identity, so an unchanged file is read once per agent.
    """
    with path.open("rb") as stream:
        identity = identity_of(os.fstat(stream.fileno()))
        key = (str(path), identity)
        digest = _DIGESTS.get(key)
        if digest is None:
            digest = hashlib.file_digest(stream, "sha256").hexdigest()
            if len(_DIGESTS) >= _MAX_DIGESTS:
                _DIGESTS.clear()
            _DIGESTS[key] = digest
    return identity, digest


def _own_binary(path: Path, name: str) -> SourceFile:
    """A binary of the agent's own (gpu-client) as a source file of the mirror."""
    try:
        st = os.stat(path)
    except OSError as err:
        raise VolumeError(f"{name} {path}: {err.strerror or err}; looking for it in the driver root instead") from err
    if not stat.S_ISREG(st.st_mode):
        raise VolumeError(f"{name} {path} is not a regular file; looking for it in the driver root instead")
    try:
        identity, digest = _own_file(path)
    except OSError as err:
        raise VolumeError(f"{name} {path}: {err.strerror or err}; looking for it in the driver root instead") from err
    return SourceFile(BIN_DIR, str(path), path, identity, name, copy_only=True, digest=digest)


def _by_base(volumes: Sequence[VolumeSpec]) -> dict[Path, list[VolumeSpec]]:
    groups: dict[Path, list[VolumeSpec]] = {}
    for volume in volumes:
        groups.setdefault(volume.base, []).append(volume)
    return groups


def _make_dirs(path: Path) -> None:
    """Create ``path`` and its missing parents with mode 0755 whatever the umask; existing ones are left as they are."""
    missing: list[Path] = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for directory in reversed(missing):
        try:
            directory.mkdir()
        except FileExistsError:  # made meanwhile by someone else: theirs
            continue
        os.chmod(directory, 0o755)


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


@dataclass
class _Run:
    share_mode: bool
    interceptor: Interceptor | None
    allow_hardlinks: bool
    proc_root: Path
    machine: str
    warnings: list[str] = field(default_factory=list)
    removed: list[Path] = field(default_factory=list)
    kept: list[tuple[Path, str]] = field(default_factory=list)
    _facts: dict[str, ElfFacts | NotElfError] = field(default_factory=dict)
    _reusable: dict[Identity, Path] | None = None

    def warn(self, message: str) -> None:
        log.debug("%s", message)  # reported by the caller from VdriverResult.warnings
        self.warnings.append(message)

    def facts_of(self, source: SourceFile) -> ElfFacts:
        if source.host_path not in self._facts:
            try:
                self._facts[source.host_path] = read_elf_facts(source.path)
            except NotElfError as err:
                self._facts[source.host_path] = err
        facts = self._facts[source.host_path]
        if isinstance(facts, NotElfError):
            raise facts
        return facts

    def sync_base(
        self, base: Path, volumes: Sequence[VolumeSpec], sources: dict[VolumeSpec, list[SourceFile]]
    ) -> list[VolumeOutcome]:
        trees = base / TREES_DIR
        try:
            # A base that exists is the operator's (it may be a shared directory such as /var/tmp):
            # its mode is left alone, containers only ever see the trees.
            _make_dirs(base)
            trees.mkdir(exist_ok=True)
            if stat.S_IMODE(os.stat(trees).st_mode) != 0o755:
                os.chmod(trees, 0o755)
        except OSError as err:
            raise VolumeError(f"cannot create the volume base {base}: {err.strerror or err}") from err
        self._reusable = None
        with _locked(base / LOCK_FILE):
            tidy_leftovers(base, trees)
            outcomes = [self.sync_volume(v, trees, sources[v]) for v in volumes]
            self.collect_garbage(base, trees)
        return outcomes

    def fingerprint(self, volume: VolumeSpec, sources: Sequence[SourceFile]) -> str:
        swap = self.share_mode and volume.name == NVIDIA_VOLUME
        data = {
            "layout": LAYOUT_VERSION,
            "machine": self.machine,
            "volume": volume.name,
            "binaries": volume.binaries,
            "libraries": volume.libraries,
            "share_mode": swap,
            "interceptor": self.interceptor.digest if swap and self.interceptor else None,
            # the agent's own files by name and content: where they lie changes with every start
            "sources": [
                [s.dir, s.found_as, s.digest] if s.digest else [s.dir, s.host_path, list(s.identity)] for s in sources
            ],
        }
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()

    def sync_volume(self, volume: VolumeSpec, trees: Path, sources: Sequence[SourceFile]) -> VolumeOutcome:
        fingerprint = self.fingerprint(volume, sources)
        target = current_target(volume.path)
        current = trees.parent / target if target and target.startswith(TREES_DIR + "/") else None
        if current is not None:
            manifest = read_manifest(current)
            if manifest is not None and manifest.fingerprint == fingerprint and verify_tree(current, manifest) is None:
                log.debug("volume %s: %s is up to date", volume.name, current)
                return _outcome(volume, current, manifest, changed=False, built=False, previous=None)
        name = f"{volume.name}-{fingerprint[:16]}"
        tree, manifest, built = self._find_or_build(volume, trees, name, fingerprint, sources)
        legacy = publish(volume.path, f"{TREES_DIR}/{tree.name}", trees)
        previous = legacy or current
        log.info(
            "volume %s: %s now names %s (%s)", volume.name, volume.path, tree.name, "new tree" if built else "reused"
        )
        return _outcome(volume, tree, manifest, changed=True, built=built, previous=previous)

    def _find_or_build(
        self, volume: VolumeSpec, trees: Path, name: str, fingerprint: str, sources: Sequence[SourceFile]
    ) -> tuple[Path, Manifest, bool]:
        for attempt in range(100):
            tree = trees / (name if attempt == 0 else f"{name}-{attempt}")
            if not tree.exists() and not manifest_path(tree).exists():
                return tree, self._build(volume, tree, fingerprint, sources), True
            manifest = read_manifest(tree)
            if manifest is not None and manifest.fingerprint == fingerprint:
                problem = verify_tree(tree, manifest)
                if problem is None:
                    return tree, manifest, False
                log.warning("volume %s: tree %s is damaged (%s); building another", volume.name, tree, problem)
        raise VolumeError(f"volume {volume.name}: no free tree name for {name} under {trees}")

    def _build(self, volume: VolumeSpec, tree: Path, fingerprint: str, sources: Sequence[SourceFile]) -> Manifest:
        swap = self.share_mode and volume.name == NVIDIA_VOLUME
        plan = plan_volume(volume, sources, self.facts_of, share_mode=swap, interceptor=self.interceptor)
        self.warnings.extend(plan.warnings)
        staging = tree.with_name(f"{STAGING_PREFIX}{tree.name}-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            reusable = self._reusable_files(tree.parent)
            entries = build_tree(staging, plan, reusable, allow_hardlinks=self.allow_hardlinks)
            os.rename(staging, tree)
            for rel, item in plan.files.items():  # later trees of this run link to these files
                reusable.setdefault(item.identity, tree / rel)
        except OSError as err:
            shutil.rmtree(staging, ignore_errors=True)
            raise VolumeError(f"volume {volume.name}: cannot build {tree}: {err}") from err
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        versions = [s for s in sources if f"{s.dir}/{s.name}" in plan.files]
        version = driver_version(versions)
        manifest = Manifest(tree.name, volume.name, fingerprint, version.full if version else None, entries)
        write_manifest(tree, manifest)
        return manifest

    def _reusable_files(self, trees: Path) -> dict[Identity, Path]:
        """Files of complete trees by source identity: hard-linking them is safe, they never change."""
        if self._reusable is None:
            self._reusable = {}
            for manifest_file in sorted(trees.glob("*.json")):
                tree = manifest_file.with_suffix("")
                manifest = read_manifest(tree)
                if manifest is None:
                    continue
                for rel, entry in manifest.entries.items():
                    ident = entry.get("identity")
                    if entry.get("type") == "file" and isinstance(ident, list) and len(ident) == 5:
                        self._reusable.setdefault(tuple(int(v) for v in ident), tree / rel)  # type: ignore[arg-type]
        return self._reusable

    def collect_garbage(self, base: Path, trees: Path) -> None:
        current = _current_trees(base)
        stale: list[Path] = []
        for entry in sorted(os.scandir(trees), key=lambda e: e.name):
            path = Path(entry.path)
            if entry.name.startswith(STAGING_PREFIX):
                log.info("removing the unfinished tree %s", path)
                shutil.rmtree(path, ignore_errors=True)
            elif entry.name.startswith("."):
                if entry.name.endswith(".tmp"):
                    path.unlink(missing_ok=True)
            elif entry.name.endswith(".json"):
                if not path.with_suffix("").is_dir():
                    path.unlink(missing_ok=True)
            elif entry.is_dir(follow_symlinks=False) and entry.name not in current:
                stale.append(path)
        if not stale:
            return
        try:
            scan = scan_proc(self.proc_root)
        except OSError as err:
            for tree in stale:
                self._keep(tree, f"cannot read {self.proc_root}: {err.strerror or err}")
            return
        current_inodes: set[tuple[int, int]] = set()
        for name in current:
            current_inodes |= _inodes(trees / name)
        for tree in stale:
            reason = _in_use(tree, scan, current_inodes, place_of(self.proc_root, tree))
            if reason is not None:
                self._keep(tree, reason)
                continue
            manifest_path(tree).unlink(missing_ok=True)
            shutil.rmtree(tree, ignore_errors=True)
            log.info("removed the unused driver tree %s", tree)
            self.removed.append(tree)

    def _keep(self, tree: Path, reason: str) -> None:
        log.info("keeping the old driver tree %s: %s", tree, reason)
        self.kept.append((tree, reason))


def _in_use(tree: Path, scan: ProcScan, current_inodes: set[tuple[int, int]], place: Place | None) -> str | None:
    if scan.unreadable:
        return f"{len(scan.unreadable)} process(es) could not be inspected (pid {scan.unreadable[0]})"
    mount = scan.mounts_tree(tree.name, place)
    if mount is not None:
        return f"mounted by a container ({mount})"
    for key in _inodes(tree) - current_inodes:
        pid = scan.mapped.get(key)
        if pid is not None:
            return f"mapped by process {pid}"
    return None


def _current_trees(base: Path) -> set[str]:
    names: set[str] = set()
    for entry in os.scandir(base):
        if entry.is_symlink():
            target = os.readlink(entry.path)
            if target.startswith(TREES_DIR + "/"):
                names.add(target[len(TREES_DIR) + 1 :].split("/", 1)[0])
    return names


def _inodes(tree: Path) -> set[tuple[int, int]]:
    found: set[tuple[int, int]] = set()
    for directory, _dirs, files in os.walk(tree):
        for name in files:
            try:
                st = os.lstat(os.path.join(directory, name))
            except OSError:
                continue
            if not os.path.islink(os.path.join(directory, name)):
                found.add((st.st_dev, st.st_ino))
    return found


def _outcome(
    volume: VolumeSpec, tree: Path, manifest: Manifest, *, changed: bool, built: bool, previous: Path | None
) -> VolumeOutcome:
    links = sum(1 for e in manifest.entries.values() if e.get("type") == "link")
    return VolumeOutcome(
        name=volume.name,
        path=volume.path,
        tree=tree,
        changed=changed,
        built=built,
        previous_tree=previous,
        files=len(manifest.entries) - links,
        links=links,
    )
