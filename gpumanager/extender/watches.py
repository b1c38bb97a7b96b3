"""The extender's list+watch of one resource: a :class:`Reflector` that also tells what each relist showed."""

from __future__ import annotations

import time
from collections.abc import Callable, Set
from typing import Any

from gpumanager.kube.reflector import Reflector, object_key

#: ``on_relist(since, keys)``: a list asked for at ``since`` (``time.monotonic()``) showed the objects ``keys``.
RelistListener = Callable[[float, Set[str]], object]


class Watch(Reflector):
    """A :class:`Reflector` calling ``on_relist`` after each complete list (after its events)."""

    def __init__(self, *args: Any, on_relist: RelistListener | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._on_relist = on_relist

    def _relist(self) -> None:
        since = time.monotonic()
        super()._relist()
        if self._on_relist is not None:
            self._on_relist(since, {object_key(o) for o in self.objects()})
