"""Reader of glibc's ``ld.so.cache``: the old (``ld.so-1.7.0``) and new (``glibc-ld.so.cache1.1``) formats.

Layouts (all integers in the writer's byte order; only little-endian caches are accepted on a
little-endian host):

- old: ``"ld.so-1.7.0\\0"`` (12 bytes), ``uint32 nlibs``, then ``nlibs`` entries of
  ``{int32 flags; uint32 key; uint32 value}``; string offsets count from the end of that table.
- new: a 48-byte header ``magic[17]="glibc-ld.so.cache"``, ``version[3]="1.1"``, ``uint32 nlibs``,
  ``uint32 len_strings``, ``uint8 flags`` (2 little-endian, 3 big-endian, 0 unset), 3 pad bytes,
  ``uint32 extension_offset``, 3 unused ``uint32``; then ``nlibs`` entries of
  ``{int32 flags; uint32 key; uint32 value; uint32 osversion; uint64 hwcap}``; string offsets
  count from the start of the new header.
- combined ("compat"): an old table, padded to 8 bytes, followed by a new-format cache. The new
  part is read (it is what glibc's loader reads).

Entry flags: the low byte is the type (``1`` ELF, ``3`` ELF linked with glibc, ``2`` libc5, ``0``
a.out), the next byte the ABI/architecture (``0x0300`` x86-64, ``0x0000`` the default 32-bit ABI,
i.e. i386 on x86 hosts, ``0x0800`` x32, ``0x0500`` 64-bit PowerPC, ``0x0a00`` aarch64, ...). glibc's
loader (``_dl_cache_check_flags`` of its ``dl-cache.h``) compares the whole flags word: an ABI's
entries are used when it equals ``FLAG_ELF_LIBC6`` with that ABI's bits (``1`` or ``3`` for the
default 32-bit ABI); an entry with any other bit set is passed by, and so is it here.

The new header's flags byte holds the byte order in its two low bits (``2`` little-endian, ``3``
big-endian, ``1`` invalid); ``0`` as a whole means unknown. Its other bits are for future use and
ignored, as glibc's ``cache_file_new_matches_endian`` does.
"""

from __future__ import annotations

import enum
import logging
import os
import platform
import stat
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

from gpumanager.volume.errors import VolumeError

log = logging.getLogger(__name__)

OLD_MAGIC = b"ld.so-1.7.0\0"
NEW_MAGIC = b"glibc-ld.so.cache"
NEW_VERSION = b"1.1"
OLD_HEADER = struct.Struct("<12sI")
OLD_ENTRY = struct.Struct("<iII")
NEW_HEADER = struct.Struct("<17s3sIIB3xI12x")
NEW_ENTRY = struct.Struct("<iIIIQ")

FLAG_TYPE_MASK = 0x00FF
FLAG_ELF = 0x0001
FLAG_ELF_LIBC6 = 0x0003
FLAG_ARCH_MASK = 0xFF00
#: The new header's byte-order bits (glibc's cache_file_new_flags_endian_big, used as a mask).
ENDIAN_MASK = 0x03
#: hwcap bit of an entry found in a ``glibc-hwcaps/<level>`` subdirectory (glibc 2.33+): the loader
#: only uses it on a CPU of that level (x86-64-v2/v3/v4, power9, z15, ...).
HWCAP_GLIBC_HWCAPS = 1 << 62
#: A cache of half a million libraries takes about 64 MiB; a larger file is no cache to read whole.
MAX_CACHE_BYTES = 64 << 20
GLIBC_HWCAPS_DIR = "/glibc-hwcaps/"

# Byte-order values of the new header's flags byte.
_ENDIAN_UNSET, _ENDIAN_INVALID, _ENDIAN_LITTLE, _ENDIAN_BIG = 0, 1, 2, 3


class CacheArch(enum.Enum):
    """The ABI of a cache entry, from the high byte of its flags."""

    I386 = 0x0000  # the default 32-bit ABI: i386 on x86 hosts
    SPARC64 = 0x0100
    IA64 = 0x0200
    X86_64 = 0x0300
    S390X = 0x0400
    PPC64 = 0x0500  # 64-bit PowerPC, ppc64le included
    MIPS64_N32 = 0x0600
    MIPS64 = 0x0700
    X32 = 0x0800
    ARMHF = 0x0900
    AARCH64 = 0x0A00
    ARMSF = 0x0B00
    RISCV64_SOFT = 0x0F00
    RISCV64_DOUBLE = 0x1000
    LOONGARCH64_SOFT = 0x1100
    LOONGARCH64_DOUBLE = 0x1200
    UNKNOWN = -1


_BITS = {
    CacheArch.I386: 32,
    CacheArch.SPARC64: 64,
    CacheArch.IA64: 64,
    CacheArch.X86_64: 64,
    CacheArch.S390X: 64,
    CacheArch.PPC64: 64,
    CacheArch.MIPS64_N32: 32,
    CacheArch.MIPS64: 64,
    CacheArch.X32: 32,
    CacheArch.ARMHF: 32,
    CacheArch.AARCH64: 64,
    CacheArch.ARMSF: 32,
    CacheArch.RISCV64_SOFT: 64,
    CacheArch.RISCV64_DOUBLE: 64,
    CacheArch.LOONGARCH64_SOFT: 64,
    CacheArch.LOONGARCH64_DOUBLE: 64,
}
_BY_FLAG = {a.value: a for a in CacheArch if a is not CacheArch.UNKNOWN}

# Which cache ABIs a host uses, and the mirror directory each goes to. Anything else is foreign.
HOST_LIB_DIRS: dict[str, dict[CacheArch, str]] = {
    "x86_64": {CacheArch.X86_64: "lib64", CacheArch.I386: "lib"},
    "i386": {CacheArch.I386: "lib"},
    "ppc64le": {CacheArch.PPC64: "lib64"},
    "aarch64": {CacheArch.AARCH64: "lib64"},
}
_MACHINE_ALIASES = {"amd64": "x86_64", "i686": "i386", "i586": "i386", "arm64": "aarch64", "ppc64el": "ppc64le"}


def host_lib_dirs(machine: str | None = None) -> dict[CacheArch, str]:
    """The cache ABIs used on ``machine`` (default: this host) and their mirror directories.

    Raises VolumeError for a machine the mirror does not know.
    """
    name = (machine or platform.machine()).lower()
    name = _MACHINE_ALIASES.get(name, name)
    try:
        return HOST_LIB_DIRS[name]
    except KeyError:
        known = ", ".join(sorted(HOST_LIB_DIRS))
        raise VolumeError(f"machine {name!r} is not supported by the driver mirror (known: {known})") from None


@dataclass(frozen=True)
class CacheEntry:
    """One library of the cache: ``key`` is the soname, ``value`` the path the loader opens."""

    key: str
    value: str
    flags: int
    hwcap: int = 0

    @property
    def is_elf(self) -> bool:
        """True for the ELF entries glibc's loader uses, the only ones the mirror uses.

        As its ``_dl_cache_check_flags``: the whole flags are ``FLAG_ELF_LIBC6`` with an ABI's
        bits, or ``FLAG_ELF`` or ``FLAG_ELF_LIBC6`` alone (the default 32-bit ABI). Bits outside
        the type and ABI bytes, or another type, and the loader never picks the entry.
        """
        if self.flags & ~(FLAG_ARCH_MASK | FLAG_TYPE_MASK):
            return False
        kind = self.flags & FLAG_TYPE_MASK
        if self.flags & FLAG_ARCH_MASK:
            return kind == FLAG_ELF_LIBC6
        return kind in (FLAG_ELF, FLAG_ELF_LIBC6)

    @property
    def glibc_hwcaps(self) -> bool:
        """True for a build in a ``glibc-hwcaps`` subdirectory, which needs a CPU of its level.

        Old-format entries have no hwcap field, yet glibc 2.33+ lists those builds in them too:
        their path (``<dir>/glibc-hwcaps/<level>/<file>``) tells.
        """
        return bool(self.hwcap & HWCAP_GLIBC_HWCAPS) or GLIBC_HWCAPS_DIR in self.value

    @property
    def arch(self) -> CacheArch:
        """The entry's ABI; UNKNOWN for an architecture byte this reader does not name."""
        return _BY_FLAG.get(self.flags & FLAG_ARCH_MASK, CacheArch.UNKNOWN)

    @property
    def bits(self) -> int | None:
        """32 or 64 for a known ABI, None otherwise."""
        return _BITS.get(self.arch)


@dataclass(frozen=True)
class LdCache:
    """A parsed cache: its file, its format (``old``, ``new`` or ``compat``) and its entries in file order."""

    path: Path
    format: str
    entries: tuple[CacheEntry, ...]
    #: entries left out because a string offset of theirs leads to no terminated string inside the
    #: file (glibc's loader passes such entries by one by one, and the rest of the cache is used)
    skipped: int = 0


def read_ldcache(path: Path) -> LdCache:
    """Read and parse ``path``; VolumeError names the file and what is wrong with it."""
    try:
        # O_NONBLOCK: a FIFO in its place must not block the open until some writer comes.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:
        raise VolumeError(f"cannot read ld.so.cache {path}: {err.strerror or err}") from err
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise VolumeError(f"ld.so.cache {path} is not a regular file (mode {st.st_mode:o})")
        size = st.st_size
        if size <= MAX_CACHE_BYTES:
            with os.fdopen(fd, "rb", closefd=False) as stream:
                data = stream.read(MAX_CACHE_BYTES + 1)
            size = max(size, len(data))  # it may grow while read
        if size > MAX_CACHE_BYTES:
            raise VolumeError(
                f"ld.so.cache {path} is {size} bytes, more than any real cache ({MAX_CACHE_BYTES}); not read"
            )
    except OSError as err:
        raise VolumeError(f"cannot read ld.so.cache {path}: {err.strerror or err}") from err
    finally:
        os.close(fd)
    return parse_ldcache(data, path)


def parse_ldcache(data: bytes, path: Path) -> LdCache:
    """Parse the bytes of a cache file; ``path`` is used in error messages only."""
    if data.startswith(OLD_MAGIC):
        return _parse_old_or_compat(data, path)
    if data.startswith(NEW_MAGIC):
        return LdCache(path, "new", *_parse_new(data, 0, path))
    if len(data) < len(NEW_MAGIC) and (NEW_MAGIC.startswith(data) or OLD_MAGIC.startswith(data)):
        raise VolumeError(f"ld.so.cache {path} is truncated: {len(data)} bytes, shorter than its magic")
    raise VolumeError(f"{path} is not an ld.so.cache file (magic {data[:17]!r})")


def _parse_old_or_compat(data: bytes, path: Path) -> LdCache:
    if len(data) < OLD_HEADER.size:
        raise VolumeError(f"ld.so.cache {path} is truncated: {len(data)} bytes, old-format header needs 16")
    _, nlibs = OLD_HEADER.unpack_from(data, 0)
    table_end = OLD_HEADER.size + nlibs * OLD_ENTRY.size
    if table_end > len(data):
        raise VolumeError(
            f"ld.so.cache {path} is truncated or corrupt: the old-format header announces {nlibs} entries "
            f"({table_end} bytes) but the file has {len(data)} bytes"
        )
    new_at = (table_end + 7) & ~7
    if data[new_at : new_at + len(NEW_MAGIC)] == NEW_MAGIC:
        return LdCache(path, "compat", *_parse_new(data, new_at, path))
    # The old format gives the string table's size nowhere: a string past the end of the file
    # cannot be told from a file cut short, and fails the whole cache.
    entries: list[CacheEntry] = []
    for i, (flags, key, value) in enumerate(OLD_ENTRY.iter_unpack(data[OLD_HEADER.size : table_end])):
        entries.append(
            CacheEntry(
                _required(data, table_end, key, path, i, "key"),
                _required(data, table_end, value, path, i, "value"),
                flags,
            )
        )
    return LdCache(path, "old", tuple(entries))


def _parse_new(data: bytes, base: int, path: Path) -> tuple[tuple[CacheEntry, ...], int]:
    """The entries of the new-format cache at ``base``, and how many were skipped for a bad string."""
    if len(data) < base + NEW_HEADER.size:
        raise VolumeError(
            f"ld.so.cache {path} is truncated: the new-format header at byte {base} needs {NEW_HEADER.size} bytes, "
            f"the file has {len(data)}"
        )
    _, version, nlibs, len_strings, endian, _ext = NEW_HEADER.unpack_from(data, base)
    if version != NEW_VERSION:
        raise VolumeError(f"ld.so.cache {path} has unsupported version {version!r} (expected {NEW_VERSION!r})")
    table_end = base + NEW_HEADER.size + nlibs * NEW_ENTRY.size
    _check_byte_order(data, base, endian, table_end, path)
    if table_end > len(data):
        raise VolumeError(
            f"ld.so.cache {path} is truncated or corrupt: the header announces {nlibs} entries "
            f"(up to byte {table_end}) but the file has {len(data)} bytes"
        )
    if len_strings and table_end + len_strings > len(data):
        raise VolumeError(
            f"ld.so.cache {path} is truncated: its string table ends at byte {table_end + len_strings}, "
            f"the file has {len(data)} bytes"
        )
    # The header's string table size says the file is whole: an entry whose string lies outside it
    # is that entry's fault, and is skipped alone, as glibc's loader skips it.
    entries: list[CacheEntry] = []
    skipped = 0
    for i, (flags, key, value, _osv, hwcap) in enumerate(
        NEW_ENTRY.iter_unpack(data[base + NEW_HEADER.size : table_end])
    ):
        if not len_strings:  # no size given (no writer does that): as the old format
            entries.append(
                CacheEntry(
                    _required(data, base, key, path, i, "key"),
                    _required(data, base, value, path, i, "value"),
                    flags,
                    hwcap,
                )
            )
            continue
        key_s, value_s = _string(data, base, key), _string(data, base, value)
        if key_s is None or value_s is None:
            skipped += 1
        else:
            entries.append(CacheEntry(key_s, value_s, flags, hwcap))
    return tuple(entries), skipped


def _check_byte_order(data: bytes, base: int, flags: int, table_end: int, path: Path) -> None:
    native = _ENDIAN_LITTLE if sys.byteorder == "little" else _ENDIAN_BIG
    endian = flags & ENDIAN_MASK
    if flags and endian == _ENDIAN_UNSET:
        # glibc's loader takes 0 as "unknown", but refuses other flags without a byte order
        raise VolumeError(f"ld.so.cache {path} has header flags {flags:#04x}, which name no byte order")
    if endian in (_ENDIAN_LITTLE, _ENDIAN_BIG) and endian != native:
        order = "big" if endian == _ENDIAN_BIG else "little"
        raise VolumeError(
            f"ld.so.cache {path} is foreign: it was written {order}-endian, this host is {sys.byteorder}-endian"
        )
    if endian == _ENDIAN_INVALID:
        raise VolumeError(f"ld.so.cache {path} is marked as having an invalid byte order")
    if endian == _ENDIAN_UNSET and table_end > len(data):
        # Old writers leave the flag unset; a count that only fits when read the other way round
        # means the file comes from a machine of the other byte order.
        (swapped,) = struct.unpack_from(">I" if native == _ENDIAN_LITTLE else "<I", data, base + 20)
        if base + NEW_HEADER.size + swapped * NEW_ENTRY.size <= len(data):
            raise VolumeError(f"ld.so.cache {path} is foreign: its counts only make sense in the other byte order")


def _required(data: bytes, base: int, offset: int, path: Path, index: int, what: str) -> str:
    """The string at ``base + offset``; VolumeError for the whole file when there is none."""
    found = _string(data, base, offset)
    if found is None:
        raise VolumeError(
            f"ld.so.cache {path} is truncated or corrupt: entry {index} {what} at byte {base + offset} "
            f"has no terminated string inside the file ({len(data)} bytes)"
        )
    return found


def _string(data: bytes, base: int, offset: int) -> str | None:
    """The string at ``base + offset``; None when no terminated string starts there inside the file."""
    start = base + offset
    end = data.find(b"\0", start) if start < len(data) else -1
    if end < 0:
        return None
    return os.fsdecode(data[start:end])
