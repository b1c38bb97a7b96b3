"""gpu-manager selftest: missing pieces, hanging children and NVML answers that cannot tell."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from gpumanager.selftest import command


def test_no_cuda_package_at_all_is_a_clear_exit_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # Neither cuda-bindings nor any other package of the ``cuda`` namespace is installed.
    monkeypatch.setitem(sys.modules, "cuda", None)  # type: ignore[arg-type]
    monkeypatch.delitem(sys.modules, "cuda.bindings", raising=False)
    assert command.main(["--driver-root", str(tmp_path)]) == command.EXIT_USAGE
    err = capsys.readouterr().err
    assert "cuda-bindings" in err
    assert "Traceback" not in err
