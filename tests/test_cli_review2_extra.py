"""gpu-manager v1.1 command lines as operators wrote them: Go/klog flag forms, klog's logging flags,
errors of one line, and extra-config.json files that are not text."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpumanager import cli
from gpumanager.config import Config, ConfigError
from gpumanager.flagchecks import load_extra_devices


def parse(*argv: str) -> Config:
    args = cli.build_parser({}).parse_args(cli.normalize_argv(argv))
    return cli.config_from_args(args, {})


@pytest.fixture
def clean_logging() -> Iterator[None]:
    yield
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
        h.close()
    root.setLevel(logging.WARNING)
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = True


# -- extra-config.json ------------------------------------------------------------------------------


@pytest.mark.parametrize("content", [b"\xff\xfe{}", b"[" * 200000])
def test_an_extra_config_that_is_not_json_text_names_the_flag(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "extra-config.json"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=f"--extra-config={path}: "):
        load_extra_devices(str(path))
