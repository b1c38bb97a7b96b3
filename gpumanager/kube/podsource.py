"""The pod source the allocator is given at start, before the API server is connected.

The device plugin is served before the Kubernetes client is even loaded; until
the pod cache exists this source knows no pod and says why. Once attached it
passes every call to the cache.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from gpumanager.allocation.pods import Pod


class _Cache(Protocol):
    def synced(self) -> bool: ...
    def pods(self) -> list[Pod]: ...
    def get(self, uid: str) -> Pod | None: ...
    def changes(self, since: int) -> tuple[int, frozenset[str] | None]: ...
    def find(self, namespace: str, name: str) -> Pod | None: ...
    def lookup(self, namespace: str, name: str, since: float | None = None) -> Pod | None: ...
    def refresh(self) -> list[Pod]: ...
    def recent(self, within: float, since: float) -> list[Pod] | None: ...
    def wait_synced(self, timeout: float) -> bool: ...


class PodSourceProxy:
    """Pods of this node: from the pod cache once attached, none before (refresh says why)."""

    def __init__(self) -> None:
        self._cache: _Cache | None = None
        self._reason = "the agent is still connecting to the API server"
        self._settled = threading.Event()

    def attach(self, cache: _Cache) -> None:
        """From now on, ask ``cache``."""
        self._cache = cache
        self._settled.set()

    def fail(self, reason: str) -> None:
        """No API server can be used: every list says ``reason``."""
        self._reason = reason
        self._settled.set()

    @property
    def attached(self) -> bool:
        """Whether a pod cache answers."""
        return self._cache is not None

    @property
    def reason(self) -> str:
        """Why no pod cache answers ('' once attached)."""
        return "" if self._cache is not None else self._reason

    def synced(self) -> bool:
        """Whether the pod cache has a complete view."""
        return self._cache is not None and self._cache.synced()

    def wait_synced(self, timeout: float) -> bool:
        """Wait (at most ``timeout``) for a complete view; False at once when there is no API server."""
        if not self._settled.wait(timeout):
            return False
        return self._cache is not None and self._cache.wait_synced(timeout)

    def pods(self) -> list[Pod]:
        """Every known pod of this node."""
        return self._cache.pods() if self._cache is not None else []

    def get(self, uid: str) -> Pod | None:
        """A pod by UID."""
        return self._cache.get(uid) if self._cache is not None else None

    def changes(self, since: int) -> tuple[int, frozenset[str] | None]:
        """The pod cache's generation and the pods changed since ``since`` (None: look at every pod)."""
        return self._cache.changes(since) if self._cache is not None else (-1, None)

    def find(self, namespace: str, name: str) -> Pod | None:
        """A cached pod by namespace and name."""
        return self._cache.find(namespace, name) if self._cache is not None else None

    def lookup(self, namespace: str, name: str, since: float | None = None) -> Pod | None:
        """A pod by namespace and name, listing again (briefly) when the cache does not have it (with
        ``since``, a list sent since then serves first: :meth:`PodCache.lookup`)."""
        return self._cache.lookup(namespace, name, since) if self._cache is not None else None

    def refresh(self) -> list[Pod]:
        """Pods freshly listed (bounded); raises when there is no API server."""
        if self._cache is None:
            raise RuntimeError(self._reason)
        return self._cache.refresh()

    def recent(self, within: float, since: float) -> list[Pod] | None:
        """The last fresh list's pods when sent since ``since`` and nothing newer is known
        (:meth:`PodCache.recent`); None before the cache is attached."""
        return self._cache.recent(within, since) if self._cache is not None else None
