"""vcuda.config and pids.config: byte layout read back by a C program using the library's struct."""

from __future__ import annotations

import struct
import subprocess
from pathlib import Path

import pytest

from gpumanager.vmanager import files

C_READER = r"""
#include <stdio.h>
#include <stdint.h>
#include <stddef.h>
#define FILENAME_MAX_ 4096
struct version_t { int major; int minor; } __attribute__((packed, aligned(8)));
struct resource_data_t {
  char pod_uid[48]; int limit; char occupied[4044]; char container_name[FILENAME_MAX_];
  char bus_id[16]; uint64_t gpu_memory; int utilization; int hard_limit;
  struct version_t driver_version; int enable;
} __attribute__((packed, aligned(8)));
_Static_assert(sizeof(struct resource_data_t) == 8240, "size");
_Static_assert(offsetof(struct resource_data_t, gpu_memory) == 8208, "gpu_memory");
_Static_assert(offsetof(struct resource_data_t, enable) == 8232, "enable");
int main(int argc, char **argv) {
  struct resource_data_t d; FILE *f = fopen(argv[1], "rb");
  if (!f || fread(&d, sizeof d, 1, f) != 1) return 2;
  printf("%s|%d|%s|%llu|%d|%d|%d|%d|%d\n", d.pod_uid, d.limit, d.container_name,
         (unsigned long long)d.gpu_memory, d.utilization, d.hard_limit,
         d.driver_version.major, d.driver_version.minor, d.enable);
  return 0;
}
"""


@pytest.fixture(scope="module")
def c_reader(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("reader")
    (d / "r.c").write_text(C_READER)
    subprocess.run(["gcc", "-std=c11", "-Wall", "-Werror", "-o", str(d / "r"), str(d / "r.c")], check=True)
    return d / "r"


def test_the_library_struct_reads_what_we_write(tmp_path: Path, c_reader: Path) -> None:
    cfg = files.VcudaConfig(
        pod_uid="0d7a6c3e-1f2b-4c5d-8e9f-001122334455",
        container_name="trainer",
        gpu_memory=4 * 268435456,
        utilization=30,
        limit=60,
        hard_limit=0,
        driver_major=550,
        driver_minor=0,
        enable=1,
    )
    path = tmp_path / "vcuda.config"
    files.write_config(path, cfg)
    assert path.stat().st_size == 8240
    out = subprocess.run([str(c_reader), str(path)], check=True, capture_output=True, text=True).stdout.strip()
    assert out == "0d7a6c3e-1f2b-4c5d-8e9f-001122334455|60|trainer|1073741824|30|0|550|0|1"
    assert files.unpack(path.read_bytes()) == cfg


def test_driver_version_fields_as_upstream() -> None:
    assert files.driver_version_fields("550.54.15") == (550, 0)
    assert files.driver_version_fields("418.87") == (418, 87)
    assert files.driver_version_fields("") == (0, 0)


def test_overlong_names_are_refused() -> None:
    with pytest.raises(ValueError, match="pod UID"):
        files.pack(files.VcudaConfig(pod_uid="x" * 48, container_name="c", gpu_memory=0, utilization=1))


def test_pids_are_sorted_int32(tmp_path: Path) -> None:
    path = tmp_path / "c" / "pids.config"
    assert files.write_pids(path, [300, 12, 7, 12], make_dir=True) == [7, 12, 300]
    assert path.read_bytes() == struct.pack("<3i", 7, 12, 300)
    assert files.read_pids(path) == [7, 12, 300]


def test_byte_for_byte_against_an_independent_layout() -> None:
    expected = bytearray(8240)
    expected[0:36] = b"0d7a6c3e-1f2b-4c5d-8e9f-001122334455"
    expected[48:52] = (0).to_bytes(4, "little")
    expected[4096 : 4096 + 4] = b"main"
    expected[8208:8216] = (1 << 30).to_bytes(8, "little")
    expected[8216:8220] = (25).to_bytes(4, "little")
    expected[8220:8224] = (1).to_bytes(4, "little")
    expected[8224:8228] = (550).to_bytes(4, "little")
    expected[8228:8232] = (0).to_bytes(4, "little")
    expected[8232:8236] = (1).to_bytes(4, "little")
    got = files.pack(
        files.VcudaConfig(
            pod_uid="0d7a6c3e-1f2b-4c5d-8e9f-001122334455",
            container_name="main",
            gpu_memory=1 << 30,
            utilization=25,
            driver_major=550,
        )
    )
    assert got == bytes(expected)
