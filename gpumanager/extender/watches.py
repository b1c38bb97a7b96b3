"""The extender's list+watch of one resource: a :class:`Reflector` that also tells what each relist
showed, and for how long it has been failing."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Set
from typing import Any

from gpumanager.kube.reflector import Reflector

log = logging.getLogger(__name__)

#: ``on_relist(since, keys)``: a list asked for at ``since`` (``time.monotonic()``) showed the objects ``keys``.
RelistListener = Callable[[float, Set[str]], object]


#: A watch open this long (or one that brought an event, or a complete list) ends a failure.
HEALTHY_WATCH_SECONDS = 1.0


class Watch(Reflector):
    """A :class:`Reflector` calling ``on_relist`` after each complete list (after its events), and
    telling how long it has failed (:meth:`failing`)."""

    def __init__(self, *args: Any, on_relist: RelistListener | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._on_relist = on_relist
        self._failing_since: float | None = None
        self._failure = ""
        self._opened: float | None = None
        call = self._call

        def opening(**kw: Any) -> Any:
            response = call(**kw)
            if kw.get("watch"):
                self._opened = time.monotonic()
            return response

        self._call = opening

    def failing(self) -> tuple[float, str] | None:
        """``(seconds, last error)`` while listing or watching has failed since it last worked, else None."""
        since, opened = self._failing_since, self._opened
        if since is None:
            return None
        now = time.monotonic()
        if opened is not None and now - opened >= HEALTHY_WATCH_SECONDS:
            self._working()
            return None
        return now - since, self._failure

    def _working(self) -> None:
        if self._failing_since is not None:
            self._failing_since = None
            self._failure = ""

    def _report(self, message: str) -> None:
        super()._report(message)
        if message:  # an empty one only says a call is about to be made again
            self._failure = message
            if self._failing_since is None:
                self._failing_since = time.monotonic()

    def _listed(self, since: float, keys: Set[str]) -> None:
        # Before the watch reads as synced: the verbs answer once it is, and must not count what this
        # list tells is gone (the choices recorded for pods deleted before the extender started).
        self._working()
        if self._on_relist is not None:
            try:
                self._on_relist(since, set(keys))
            except Exception:  # as a listener's failure: logged, the watch goes on
                log.exception("%s: the relist listener failed", self.name)

    def _watch(self) -> None:
        try:
            super()._watch()
        finally:
            self._opened = None

    def _apply(self, event: dict[str, Any]) -> None:
        super()._apply(event)
        self._working()
