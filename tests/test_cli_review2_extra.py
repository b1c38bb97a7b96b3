"""gpu-manager v1.1 command lines as operators wrote them: Go/klog flag forms, klog's logging flags,
errors of one line, and extra-config.json files that are not text."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpumanager.config import ConfigError
from gpumanager.flagchecks import load_extra_devices

# -- extra-config.json ------------------------------------------------------------------------------


@pytest.mark.parametrize("content", [b"\xff\xfe{}", b"[" * 200000])
def test_an_extra_config_that_is_not_json_text_names_the_flag(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "extra-config.json"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=f"--extra-config={path}: "):
        load_extra_devices(str(path))
