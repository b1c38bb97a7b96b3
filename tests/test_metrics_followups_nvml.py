"""NVML strings that are not UTF-8 (a GPU's name, its UUID, the driver version, a PCI bus id) are decoded
with replacement characters rather than failing device discovery; the result is valid UTF-8 for labels."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import pynvml
import pytest

from gpumanager.device import nvml


def _bytes_returning(value: bytes) -> Callable[..., str]:
    """A pynvml string function as pynvml defines it (its decorator decodes the C string strictly)."""
    decorated: Callable[..., str] = pynvml.convertStrBytes(lambda *_: value)
    return decorated


def _valid_label(text: str) -> bool:
    text.encode("utf-8")  # no lone surrogates
    return "\ufffd" in text


def test_a_gpu_with_a_name_that_is_not_utf8_is_still_described(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pynvml, "nvmlDeviceGetMultiGpuBoard", lambda h: 0)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetUUID", _bytes_returning(b"GPU-1234\xff"))
    monkeypatch.setattr(pynvml, "nvmlDeviceGetName", _bytes_returning(b"Tesla V100 \xe9dition"))
    monkeypatch.setattr(pynvml, "nvmlDeviceGetMinorNumber", lambda h: 3)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetMemoryInfo", lambda h: SimpleNamespace(total=16 << 30))
    monkeypatch.setattr(pynvml, "nvmlDeviceGetPciInfo", lambda h: SimpleNamespace(busId=b"00000000:18:00.0\xff"))
    monkeypatch.setattr(pynvml, "nvmlDeviceGetNumaNodeId", lambda h: 0)
    info = nvml._describe(0, object())
    assert info.name == "Tesla V100 \ufffddition"
    assert info.uuid == "GPU-1234\ufffd"
    assert info.minor == 3 and info.memory_total == 16 << 30
    assert info.pci_bus_id.startswith("00000000:18:00.0")
    assert _valid_label(info.name) and _valid_label(info.uuid) and _valid_label(info.pci_bus_id)


def test_a_driver_version_that_is_not_utf8(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pynvml, "nvmlSystemGetDriverVersion", _bytes_returning(b"550.54\xc3"))
    monkeypatch.setattr(pynvml, "nvmlSystemGetCudaDriverVersion", lambda: 12040)
    info = nvml.driver_info()
    assert info.driver_version == "550.54\ufffd" and info.cuda_driver_version == 12040


def test_text_decodes_with_replacement() -> None:
    assert nvml._text(b"A100 \x80") == "A100 \ufffd"
    assert nvml._text("T4") == "T4"
    assert nvml.normalize_bus_id(b"0000:3B:00.0") == "00000000:3b:00.0"
