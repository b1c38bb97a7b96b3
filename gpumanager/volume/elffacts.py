"""The few ELF facts the mirror needs, read with pyelftools: class, soname, needed libraries, ABI tag."""

from __future__ import annotations

import logging
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpumanager import lazy_imports
from gpumanager.volume.errors import NotElfError

#: What pyelftools loads at import for what the mirror never reads: DWARF debug information and ARM
#: unwind tables (``ELFFile``'s module imports their readers) and the interactive debugger of its
#: parsing library (``pdb``): about 1.2 MiB for good. Each loads if it is ever used.
PYELFTOOLS_UNUSED = {
    "elftools.elf.elffile": ("elftools.dwarf.dwarfinfo", "elftools.dwarf.dwarf_util", "elftools.ehabi.ehabiinfo"),
    "elftools.construct.debug": ("pdb",),
}
for _importer, _targets in PYELFTOOLS_UNUSED.items():
    lazy_imports.defer_imports(_importer, *_targets)

from elftools.elf.dynamic import DynamicSection, DynamicSegment  # noqa: E402
from elftools.elf.elffile import ELFFile  # noqa: E402

log = logging.getLogger(__name__)

ELF_MAGIC = b"\x7fELF"
ABI_TAG_SECTION = ".note.ABI-tag"
NT_GNU_ABI_TAG = 1


@dataclass(frozen=True)
class AbiTag:
    """The ``.note.ABI-tag`` of an object: OS (0 = Linux) and the minimum kernel ABI (major, minor, sub)."""

    os: int
    version: tuple[int, int, int]

    def __str__(self) -> str:
        return ".".join(str(v) for v in self.version)


@dataclass(frozen=True)
class ElfFacts:
    """What the mirror reads from one ELF object."""

    path: Path
    bits: int
    machine: str
    soname: str | None
    needed: tuple[str, ...]
    abi_tag: AbiTag | None
    has_abi_tag_section: bool


def read_elf_facts(path: Path) -> ElfFacts:
    """Read ``path``'s ELF facts; NotElfError names the file when it is not a readable ELF object."""
    try:
        with path.open("rb") as stream:
            if stream.read(4) != ELF_MAGIC:
                raise NotElfError(f"{path} is not an ELF file")
            stream.seek(0)
            return _facts(path, ELFFile(stream))
    except NotElfError:
        raise
    except OSError as err:
        raise NotElfError(f"cannot read {path}: {err.strerror or err}") from err
    except Exception as err:
        # pyelftools raises a variety of errors on damaged files (ELFError, struct.error, and asserts
        # on a .dynamic section linked to no string table, which the loader never reads); any of
        # them means "not usable".
        raise NotElfError(f"{path} is not a valid ELF object: {type(err).__name__}: {err}") from err


def _facts(path: Path, elf: ELFFile) -> ElfFacts:
    soname: str | None = None
    needed: list[str] = []
    dynamic = _dynamic(elf)
    if dynamic is not None:
        for tag in dynamic.iter_tags():
            if tag.entry.d_tag == "DT_SONAME":
                soname = str(tag.soname)
            elif tag.entry.d_tag == "DT_NEEDED":
                needed.append(str(tag.needed))
    note = elf.get_section_by_name(ABI_TAG_SECTION)
    abi_tag = _abi_tag(note.data(), elf.little_endian) if note is not None else None
    return ElfFacts(
        path=path,
        bits=int(elf.elfclass),
        machine=str(elf["e_machine"]),
        soname=soname,
        needed=tuple(needed),
        abi_tag=abi_tag,
        has_abi_tag_section=note is not None,
    )


def _dynamic(elf: ELFFile) -> Any:
    section = elf.get_section_by_name(".dynamic")
    if isinstance(section, DynamicSection):
        return section
    for segment in elf.iter_segments():  # objects whose section headers were stripped
        if isinstance(segment, DynamicSegment):
            return segment
    return None


def _abi_tag(data: bytes, little_endian: bool) -> AbiTag | None:
    """Parse an ELF note ``{namesz, descsz, type, "GNU\\0", {os, major, minor, sub}}``; None if malformed."""
    order = "<" if little_endian else ">"
    if len(data) < 12:
        return None
    namesz, descsz, ntype = struct.unpack_from(order + "III", data, 0)
    desc_at = 12 + ((namesz + 3) & ~3)
    if ntype != NT_GNU_ABI_TAG or data[12 : 12 + namesz].rstrip(b"\0") != b"GNU" or descsz < 16:
        return None
    if len(data) < desc_at + 16:
        return None
    os_id, major, minor, sub = struct.unpack_from(order + "IIII", data, desc_at)
    return AbiTag(os=os_id, version=(major, minor, sub))
