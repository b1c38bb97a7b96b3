"""GETs from the API server bounded as a whole, not per read of the answer."""

from __future__ import annotations

import threading
from typing import Any


def get_within(rest: Any, path: str, timeout: float) -> Any:
    """``rest.get_object(path)`` (a :class:`gpumanager.kube.rest.KubeRest`), its whole answer within
    ``timeout`` seconds; TimeoutError past it.

    The client's timeout bounds each read of the answer: a server (or a proxy) that trickles its answer
    a byte at a time held the caller for as long as it liked. The GET runs in a thread of its own; past
    the deadline the caller gets its error, and the thread ends with the connection.
    """
    box: dict[str, Any] = {}
    done = threading.Event()

    def fetch() -> None:
        try:
            box["out"] = rest.get_object(path, timeout=timeout)
        except BaseException as exc:  # handed to the caller below
            box["exc"] = exc
        finally:
            done.set()

    threading.Thread(target=fetch, name="api-get", daemon=True).start()
    if not done.wait(timeout):
        raise TimeoutError(f"no whole answer within {timeout:g} s")
    if "exc" in box:
        raise box["exc"]
    return box["out"]
