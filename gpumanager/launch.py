"""Entry point of the ``gpu-manager`` command: stop signals are taken before the command line loads.

Loading :mod:`gpumanager.cli` and what it imports takes 50 ms on an idle node and a few hundred on a
busy one. A SIGTERM in that time would end the process with status 143 unannounced, and a SIGINT
with a KeyboardInterrupt traceback from whatever module was being imported. Here only modules the
interpreter has already loaded are used before the handlers are set; :func:`gpumanager.cli.main`
then sets its own.
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType

#: Exit status of a stop during the start (as :data:`gpumanager.cli.EXIT_OK`).
_EXIT_OK = 0


def _stop(signum: int, _frame: FrameType | None) -> None:
    os.write(2, f"gpu-manager: received {signal.Signals(signum).name} while starting; exiting\n".encode())
    os._exit(_EXIT_OK)


def main() -> int:
    """Take SIGTERM and SIGINT, load the command line, hand the signals back and run it."""
    previous = {signum: signal.signal(signum, _stop) for signum in (signal.SIGTERM, signal.SIGINT)}
    from gpumanager import cli

    for signum, handler in previous.items():  # cli.main (or selftest) takes them from here on
        signal.signal(signum, handler)
    return cli.main(sys.argv[1:])
