"""ELF facts (pyelftools), the blacklist, the driver version and volume.conf validation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpumanager.volume import NotElfError, VolumeError, load_volume_config
from gpumanager.volume.blacklist import blacklist_reason
from gpumanager.volume.config import VolumeSpec
from gpumanager.volume.discovery import SourceFile, identity_of
from gpumanager.volume.elffacts import AbiTag, ElfFacts, read_elf_facts
from gpumanager.volume.mirror import TreePlan, devname, plan_volume
from gpumanager.volume.tree import build_tree
from gpumanager.volume.version import DriverVersion, version_from_libcuda
from tests.fresh_python import run_json
from tests.volume_fixtures import DEFAULT_VOLUME_CONF, LIB32, LIB64, MESA, V1, DriverStore, build_shared, driver_store

__all__ = ["driver_store"]


def built(store: DriverStore, host_path: str, version: str = V1) -> Path:
    return store.files[f"{version}:{host_path}"]


def test_facts_of_64_32_and_x32_objects(driver_store: DriverStore) -> None:
    cuda = read_elf_facts(built(driver_store, f"{LIB64}/libcuda.so.{V1}"))
    assert (cuda.bits, cuda.machine, cuda.soname, cuda.needed) == (64, "EM_X86_64", "libcuda.so.1", ())
    cuda32 = read_elf_facts(built(driver_store, f"{LIB32}/libcuda.so.{V1}"))
    assert (cuda32.bits, cuda32.machine, cuda32.soname) == (32, "EM_386", "libcuda.so.1")
    x32 = read_elf_facts(built(driver_store, f"/usr/libx32/libcuda.so.{V1}"))
    assert (x32.bits, x32.machine) == (32, "EM_X86_64")
    gl = read_elf_facts(built(driver_store, f"{LIB64}/libGL.so.1.7.0"))
    assert gl.soname == "libGL.so.1" and gl.needed[0] == "libGLdispatch.so.0"
    tls = read_elf_facts(built(driver_store, f"{LIB64}/libnvidia-tls.so.{V1}"))
    assert tls.abi_tag == AbiTag(os=0, version=(2, 3, 99)) and str(tls.abi_tag) == "2.3.99"
    assert cuda.abi_tag is None and not cuda.has_abi_tag_section


def test_non_elf_and_damaged_files(tmp_path: Path, driver_store: DriverStore) -> None:
    text = tmp_path / "libnvidia-fbc.so.1"
    text.write_text("INPUT(libnvidia-fbc.so.550)\n")
    with pytest.raises(NotElfError, match=f"{text} is not an ELF file"):
        read_elf_facts(text)
    cut = tmp_path / "libcut.so"
    cut.write_bytes(built(driver_store, f"{LIB64}/libcuda.so.{V1}").read_bytes()[:100])
    with pytest.raises(NotElfError, match=str(cut)):
        read_elf_facts(cut)
    with pytest.raises(NotElfError, match="cannot read"):
        read_elf_facts(tmp_path / "missing.so")


def test_a_dynamic_section_linked_to_no_string_table_is_a_damaged_file(
    tmp_path: Path, driver_store: DriverStore
) -> None:
    # The loader reads no section headers, so such a library loads; pyelftools asserts on it.
    from elftools.elf.elffile import ELFFile

    data = bytearray(built(driver_store, f"{LIB64}/libcuda.so.{V1}").read_bytes())
    with (tmp_path / "src.so").open("wb") as out:
        out.write(data)
    with (tmp_path / "src.so").open("rb") as stream:
        elf = ELFFile(stream)
        index = next(i for i, s in enumerate(elf.iter_sections()) if s.name == ".dynamic")
        link = elf["e_shoff"] + index * elf["e_shentsize"] + 40  # sh_link of an Elf64_Shdr
    data[link : link + 4] = (0).to_bytes(4, "little")
    odd = tmp_path / "libnvidia-odd.so.1"
    odd.write_bytes(bytes(data))
    with pytest.raises(NotElfError, match=str(odd)):
        read_elf_facts(odd)


def test_blacklist_rules(tmp_path: Path, driver_store: DriverStore) -> None:
    def reason(host_path: str, file: Path | None = None) -> str | None:
        return blacklist_reason(host_path, read_elf_facts(file or built(driver_store, host_path)))

    assert reason(f"{LIB64}/libGL.so.1.7.0") is None  # GLVND: needs libGLdispatch
    assert reason(f"{LIB64}/libEGL.so.1.1.0") is None
    assert "not NVIDIA" in (reason(f"{MESA}/libGL.so.1.2.0") or "")
    assert reason(f"{LIB64}/libnvidia-tls.so.{V1}") is None
    assert "ABI 2.6.0" in (reason(f"{LIB64}/tls/libnvidia-tls.so.{V1}") or "")
    assert reason(f"{LIB64}/libcuda.so.{V1}") is None
    # an NVIDIA (non-GLVND) libGL needs libnvidia-glcore
    stub = build_shared(tmp_path / f"libnvidia-glcore.so.{V1}", f"libnvidia-glcore.so.{V1}", marker="glcore")
    legacy = build_shared(tmp_path / f"libGLESv2.so.{V1}", "libGLESv2.so.2", marker="gles", needed=[stub])
    assert reason(f"/usr/lib64/libGLESv2.so.{V1}", legacy) is None
    no_note = build_shared(tmp_path / "libnvidia-tls.so.1", "libnvidia-tls.so.1", marker="no note")
    assert "without a .note.ABI-tag" in (reason("/usr/lib64/libnvidia-tls.so.1", no_note) or "")


def test_driver_version_keeps_every_component() -> None:
    assert version_from_libcuda("libcuda.so.550.54.15") == DriverVersion("550.54.15", 550, 54)
    assert version_from_libcuda("libcuda.so.470.82.01") == DriverVersion("470.82.01", 470, 82)
    assert version_from_libcuda("libcuda.so.418.87") == DriverVersion("418.87", 418, 87)
    assert str(version_from_libcuda("libcuda.so.560.35.03")) == "560.35.03"
    for name in ("libcuda.so", "libcuda.so.1", "libcuda-control.so", "libcuda.so.x"):
        assert version_from_libcuda(name) is None


def test_devname() -> None:
    assert devname("libcuda.so.1") == "libcuda.so"
    assert devname("libnvidia-glcore.so.550.54.15") == "libnvidia-glcore.so"
    assert devname("libGLESv1_CM.so.1") == "libGLESv1_CM.so"


def test_an_empty_soname_makes_no_link_and_no_tree_name_leaves_the_tree(tmp_path: Path) -> None:
    lib = tmp_path / "libnvidia-x.so.9"
    lib.write_bytes(b"x")
    source = SourceFile("lib64", "/usr/lib64/libnvidia-x.so.9", lib, identity_of(lib.stat()), "libnvidia-x.so.1")
    volume = VolumeSpec("origin", tmp_path, "ro", (), ("libnvidia-x.so",))

    def facts(soname: str) -> ElfFacts:
        return ElfFacts(lib, 64, "EM_X86_64", soname, (), None, False)

    plan = plan_volume(volume, [source], lambda _: facts(""), share_mode=False, interceptor=None)
    assert list(plan.files) == ["lib64/libnvidia-x.so.9"] and plan.links == {}
    assert plan.warnings == [f"volume origin: {source.host_path} has the soname '', not a file name; "
                             "mirrored without soname links"]  # fmt: skip
    # The tree writer refuses any name that is not <dir>/<file name>, whatever the plan says.
    for links in ({"lib64/../../x": "libnvidia-x.so.9"}, {"lib64/": "libnvidia-x.so.9"}, {"lib64/x": "../../x"}):
        bad = TreePlan("origin", dict(plan.files), links=links)
        with pytest.raises(VolumeError, match="refusing"):
            build_tree(tmp_path / "staging", bad, {}, allow_hardlinks=False)
        assert not (tmp_path / "staging").exists() and not (tmp_path / "x").exists()


def test_default_volume_conf_is_upstreams() -> None:
    config = load_volume_config(DEFAULT_VOLUME_CONF)
    nvidia, origin = config.volumes
    assert (nvidia.name, origin.name) == ("nvidia", "origin")
    assert nvidia.base == origin.base == Path("/etc/gpu-manager/vdriver")
    assert nvidia.binaries == (*origin.binaries, "gpu-client")
    # Upstream's lists, plus the helpers libcuda dlopens (libnvidia-nvvm; libnvidia-gpucomp, which
    # upstream gave the nvidia volume only) in both: whole-GPU containers JIT-compile PTX too.
    assert set(nvidia.libraries) - set(origin.libraries) == {"libcuda-control.so"}
    assert {"libnvidia-gpucomp.so", "libnvidia-nvvm.so"} <= set(origin.libraries)
    assert len(nvidia.libraries) == 31 and nvidia.libraries[:3] == (
        "libnvidia-ml.so",
        "libcuda.so",
        "libcuda-control.so",
    )
    assert nvidia.path == Path("/etc/gpu-manager/vdriver/nvidia")
    assert config.with_base(Path("/x")).volumes[1].path == Path("/x/origin")
    extra = json.loads((DEFAULT_VOLUME_CONF.parent / "extra-config.json").read_text())
    assert extra == {}


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("{", "not valid JSON"),
        ("[]", 'with a "volume" list'),
        ('{"volume": [1]}', r"volume\[0\]: expected an object"),
        ('{"volume": [{"name": "../x", "base": "/b", "components": {"binaries": []}}]}', "name '../x'"),
        ('{"volume": [{"name": "n", "base": "rel", "components": {"binaries": []}}]}', "base 'rel'"),
        ('{"volume": [{"name": "n", "base": "/b", "components": {"libraries": "libcuda.so"}}]}', "libraries"),
        ('{"volume": [{"name": "n", "base": "/b", "components": {"libraries": [""]}}]}', "is not a file name"),
        ('{"volume": [{"name": "n", "base": "/b", "components": {"bins": []}}]}', "unknown component"),
        (
            '{"volume": [{"name": "n", "base": "/b", "components": {"binaries": []}},'
            ' {"name": "n", "base": "/b", "components": {"binaries": []}}]}',
            "appears twice",
        ),
    ],
)
def test_volume_conf_errors_name_the_file_and_value(tmp_path: Path, raw: str, message: str) -> None:
    path = tmp_path / "volume.conf"
    path.write_text(raw)
    with pytest.raises(VolumeError, match=message) as err:
        load_volume_config(path)
    assert str(path) in str(err.value)


def test_volume_without_components_is_not_registered(tmp_path: Path) -> None:
    path = tmp_path / "volume.conf"
    path.write_text(
        json.dumps(
            {
                "volume": [
                    {"name": "empty", "base": "/b"},
                    {"name": "n", "base": "/b", "components": {"binaries": ["x"]}},
                ]
            }
        )
    )
    assert [v.name for v in load_volume_config(path).volumes] == ["n"]
    with pytest.raises(VolumeError, match="cannot read volume config"):
        load_volume_config(tmp_path / "missing.conf")


ELF_IMPORTS = r"""
import json, sys
from pathlib import Path
from gpumanager.volume.elffacts import read_elf_facts
facts = read_elf_facts(Path(sys.argv[1]))
unused = ["elftools.dwarf.dwarfinfo", "elftools.ehabi.ehabiinfo", "pdb"]
before = [m for m in unused if m in sys.modules]
from elftools.elf.elffile import ELFFile
with open(sys.argv[1], "rb") as stream:
    dwarf = ELFFile(stream).get_dwarf_info()  # a part the mirror never reads still works
print(json.dumps({"soname": facts.soname, "before": before, "dwarf": type(dwarf).__name__,
                  "after": [m for m in unused if m in sys.modules]}))
"""


def test_reading_elf_facts_loads_no_dwarf_reader_nor_debugger(driver_store: DriverStore) -> None:
    library = built(driver_store, f"{LIB64}/libcuda.so.{V1}")
    got = run_json(ELF_IMPORTS, str(library))
    assert got == {"soname": "libcuda.so.1", "before": [], "dwarf": "DWARFInfo", "after": got["after"]}
    assert "elftools.dwarf.dwarfinfo" in got["after"]
