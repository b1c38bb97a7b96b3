"""A stop signal while the ``gpu-manager`` command is still loading its modules (``textwrap``, which the
command line imports, made slow): one line, status 0."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.slow_import import command, stopped_while_loading


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_while_the_command_loads_exits_0_with_one_line(tmp_path: Path, signum: signal.Signals) -> None:
    status, err = stopped_while_loading(tmp_path, command("gpu-manager", "--version"), "textwrap", signum)
    assert "Traceback" not in err, err
    assert status == 0, (status, err)
    assert err.strip() == f"gpu-manager: received {signum.name} while starting; exiting", err
