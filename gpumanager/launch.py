"""Entry points of the ``gpu-manager`` and ``gpu-manager-extender`` commands: stop signals are taken
before the command line loads.

Loading a command's module and what it imports takes 50 ms on an idle node and a few hundred on a
busy one. A SIGTERM in that time would end the process with status 143 unannounced, and a SIGINT
with a KeyboardInterrupt traceback from whatever module was being imported. Here only modules the
interpreter has already loaded are used before the handlers are set; the command's ``main`` then
sets its own.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable, Sequence
from types import FrameType

#: Exit status of a stop during the start (as the commands' ``EXIT_OK``).
_EXIT_OK = 0


def _stopper(prog: str) -> Callable[[int, FrameType | None], None]:
    def stop(signum: int, _frame: FrameType | None) -> None:
        os.write(2, f"{prog}: received {signal.Signals(signum).name} while starting; exiting\n".encode())
        os._exit(_EXIT_OK)

    return stop


def _launch(prog: str, load: Callable[[], Callable[[Sequence[str]], int]]) -> int:
    stop = _stopper(prog)
    previous = {signum: signal.signal(signum, stop) for signum in (signal.SIGTERM, signal.SIGINT)}
    command = load()
    for signum, handler in previous.items():  # the command takes them from here on
        signal.signal(signum, handler)
    return command(sys.argv[1:])


def main() -> int:
    """``gpu-manager``: take SIGTERM and SIGINT, load the command line, hand the signals back and run it."""

    def load() -> Callable[[Sequence[str]], int]:
        from gpumanager import cli

        return cli.main

    return _launch("gpu-manager", load)


def extender_main() -> int:
    """``gpu-manager-extender``, as :func:`main`."""

    def load() -> Callable[[Sequence[str]], int]:
        from gpumanager.extender import cli

        return cli.main

    return _launch("gpu-manager-extender", load)
