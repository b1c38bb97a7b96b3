"""The kubelet's calls before the allocation state is loaded: each waits (bounded) for it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import grpc

from gpumanager.api import deviceplugin_v1beta1_pb2 as pb
from gpumanager.deviceplugin.servicer import RequestError

if TYPE_CHECKING:
    from gpumanager.deviceplugin.handlers import Handlers

#: (resource, available IDs, IDs that must be included, size) -> preferred IDs
PreferenceFn = Callable[[str, Sequence[str], Sequence[str], int], list[str]]


class LateHandlers:
    """The kubelet calls of both resources, served before the allocation state is loaded.

    The device plugin registers before the allocator exists (loading the checkpoint and the
    modules behind it is not on the registration path). Until :meth:`attach` each call waits
    for it, until ``wait_seconds`` after this object was made (the agent's start), then is
    refused with UNAVAILABLE. PreStartContainer waits at most ``pre_start_seconds`` of that and
    GetPreferredAllocation at most ``prefer_seconds`` (then it answers no preference, which the
    kubelet treats as "choose yourself").
    """

    def __init__(
        self, wait_seconds: float, *, pre_start_seconds: float | None = None, prefer_seconds: float | None = None
    ) -> None:
        self._wait = wait_seconds
        self._deadline = time.monotonic() + wait_seconds
        self._most = {"PreStartContainer": pre_start_seconds, "GetPreferredAllocation": prefer_seconds}
        self._attached = threading.Event()
        self._handlers: Handlers | None = None
        self._preference: PreferenceFn | None = None
        self._problem = "the agent is still loading its allocation state"

    def attach(self, handlers: Handlers, preference: PreferenceFn) -> None:
        """The allocation state is ready: serve every call from now on."""
        self._handlers, self._preference = handlers, preference
        self._attached.set()

    def fail(self, problem: str) -> None:
        """The allocation state cannot be loaded: refuse at once with ``problem``."""
        self._problem = problem
        self._attached.set()

    def remaining(self) -> float:
        """Seconds left until the start's deadline (0 once past it)."""
        return max(0.0, self._deadline - time.monotonic())

    def _get(self, what: str) -> tuple[Handlers, PreferenceFn]:
        most = self._most.get(what)
        wait = self.remaining() if most is None else min(most, self.remaining())
        if not self._attached.is_set() and not self._attached.wait(wait):
            raise RequestError(
                grpc.StatusCode.UNAVAILABLE,
                f"{what}: {self._problem} (waited {wait:.3g} s; the start may take {self._wait:g} s)",
            )
        if self._handlers is None or self._preference is None:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, f"{what}: {self._problem}")
        return self._handlers, self._preference

    def allocate_core(self, request: pb.AllocateRequest) -> pb.AllocateResponse:
        """:meth:`Handlers.allocate_core`, once attached."""
        return self._get("Allocate")[0].allocate_core(request)

    def allocate_memory(self, request: pb.AllocateRequest) -> pb.AllocateResponse:
        """:meth:`Handlers.allocate_memory`, once attached."""
        return self._get("Allocate")[0].allocate_memory(request)

    def pre_start_core(self, request: pb.PreStartContainerRequest) -> pb.PreStartContainerResponse:
        """:meth:`Handlers.pre_start_core`, once attached."""
        return self._get("PreStartContainer")[0].pre_start_core(request)

    def pre_start_memory(self, request: pb.PreStartContainerRequest) -> pb.PreStartContainerResponse:
        """:meth:`Handlers.pre_start_memory`, once attached."""
        return self._get("PreStartContainer")[0].pre_start_memory(request)

    def prefer(self, resource: str, available: Sequence[str], must_include: Sequence[str], size: int) -> list[str]:
        """The preferred IDs, once attached (raises before: the servicer then answers no preference)."""
        return self._get("GetPreferredAllocation")[1](resource, available, must_include, size)
