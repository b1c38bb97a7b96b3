"""GetPreferredAllocation: steer the kubelet's pick of fake IDs towards the GPUs the allocator would choose.

The kubelet offers the free IDs of a resource and asks for ``size`` of them.
For vcuda-core the GPU(s) the allocator's next Allocate of that size would place
on come first (the container it would match, with its memory and its
``predicate-gpu-idx``), when the kubelet offers enough of their IDs. Otherwise
a multiple of 100 means whole GPUs: the link/fragment
evaluators run on a copy of the topology tree in which every GPU without all
of its 100 core IDs free is taken; a smaller size is a share and goes to the
GPU the share evaluator picks (tightest fit). For vcuda-memory (which does not
advertise the call; answered if asked) the IDs come from the GPU with the fewest
free blocks that still fits the request. IDs are
taken lowest first, so the answer is deterministic. The answer is advisory:
anything we cannot place is left for the kubelet to fill.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet

from gpumanager import names
from gpumanager.allocation import ids as device_ids
from gpumanager.deviceplugin.devices import DeviceLayout, UnknownDeviceError
from gpumanager.topology import TopologyTree, choose

log = logging.getLogger(__name__)

#: How many of the unknown IDs offered in one call its log line names.
UNKNOWN_IDS_NAMED = 3


class Preference:
    """Computes preferred device IDs from the topology tree and the device layout."""

    def __init__(
        self,
        scratch_tree: Callable[[], TopologyTree],
        layout: DeviceLayout,
        *,
        preview: Callable[[int, AbstractSet[str]], list[int] | None] | None = None,
    ) -> None:
        self._scratch_tree = scratch_tree  # a copy of the allocator's tree, taken under its lock
        self._layout = layout
        # The GPUs the next Allocate of a size would place on, given the IDs the kubelet offers
        # (Allocator.preview), or None.
        self._preview = preview

    def _by_gpu(self, resource: str, ids: Sequence[str]) -> tuple[dict[int, list[str]], dict[str, int]]:
        """The IDs per GPU in the order offered, and the number of each ID not spelt as this node spells its
        own. The kubelet offers up to thousands of IDs a call: only the GPUs taken from are sorted
        (:meth:`_lowest`)."""
        positions = self._layout.positions(resource)
        grouped: dict[int, list[str]] = {}
        odd: dict[str, int] = {}
        unknown: list[UnknownDeviceError] = []
        for device_id in ids:
            position = positions.get(device_id)
            if position is None:  # not as this node spells its IDs
                try:
                    position = (self._layout.gpu_of(resource, device_id), device_ids.number(device_id))
                except UnknownDeviceError as exc:
                    unknown.append(exc)
                    continue
                odd[device_id] = position[1]
            group = grouped.get(position[0])
            if group is None:
                group = grouped[position[0]] = []
            group.append(device_id)
        if unknown:
            # One line a call: the kubelet may offer thousands of IDs this node does not have.
            log.warning(
                "GetPreferredAllocation: ignoring %d offered %s IDs this node does not have, e.g. %s",
                len(unknown),
                resource,
                "; ".join(str(exc) for exc in unknown[:UNKNOWN_IDS_NAMED]),
            )
        return grouped, odd

    def _lowest(self, resource: str, ids: list[str], count: int, odd: dict[str, int]) -> list[str]:
        """The ``count`` IDs of lowest number (then name) among ``ids``, lowest first."""
        positions = self._layout.positions(resource)

        def key(device_id: str) -> tuple[int, str]:
            position = positions.get(device_id)
            return (position[1] if position is not None else odd[device_id], device_id)

        return heapq.nsmallest(count, ids, key=key)

    def choose(self, resource: str, available: Sequence[str], must_include: Sequence[str], size: int) -> list[str]:
        """Up to ``size`` IDs from ``available``, starting with ``must_include``; from each GPU chosen, its
        IDs of lowest number first; none for a size of 0 or less."""
        if size <= 0:
            return []
        chosen = list(dict.fromkeys(must_include))[:size]
        if len(chosen) >= size:
            return chosen
        taken = set(chosen)
        need = size - len(chosen)
        offered = set(available)
        offered -= taken
        counts = self._counts(resource, offered)
        if counts is None:  # some IDs not spelt as this node spells its own: one at a time
            return self._choose_each(resource, chosen, [d for d in dict.fromkeys(available) if d in offered], need)
        for gpu in self._gpus(resource, counts, need, chosen, offered):
            if len(chosen) >= size:
                break
            for device_id in self._layout.ids_by_gpu(resource)[gpu][0]:
                if device_id in offered:
                    chosen.append(device_id)
                    if len(chosen) >= size:
                        break
        return chosen

    def _counts(self, resource: str, offered: set[str]) -> dict[int, int] | None:
        """Offered IDs per GPU, counted against each GPU's own set of IDs (the kubelet offers thousands
        of IDs a call: each is hashed once, to make ``offered``); None when some offered ID is not one
        this node spells."""
        counts: dict[int, int] = {}
        for gpu, (_ordered, ids) in self._layout.ids_by_gpu(resource).items():
            counts[gpu] = len(ids & offered) if len(ids) <= len(offered) else len(offered & ids)
        return counts if sum(counts.values()) == len(offered) else None

    def _gpus(
        self, resource: str, counts: dict[int, int], need: int, chosen: list[str], offered: AbstractSet[str]
    ) -> list[int]:
        if resource == names.VCORE_RESOURCE:
            if not chosen:
                planned = self._planned(counts, need, offered)
                if planned:
                    return planned
            return self._core_gpus(counts, need, self._by_gpu(resource, chosen)[0])
        return self._memory_gpus(counts, need)

    def _planned(self, free: dict[int, int], need: int, offered: AbstractSet[str]) -> list[int]:
        """The GPUs Allocate would place ``need`` cores on, if the kubelet offers enough IDs of each
        (all 100 of a whole GPU, ``need`` of a share's); else []."""
        if self._preview is None:
            return []
        try:
            planned = self._preview(need, offered)
        except Exception:
            log.exception("GetPreferredAllocation: the allocator's preview of %d cores failed", need)
            return []
        if not planned:
            return []
        per_gpu = names.HUNDRED_CORES if need >= names.HUNDRED_CORES else need
        if len(planned) * per_gpu != need or any(free.get(g, 0) < per_gpu for g in planned):
            return []
        return list(planned)

    def _choose_each(self, resource: str, chosen: list[str], offered: list[str], need: int) -> list[str]:
        """:meth:`choose` with each offered ID looked up by itself (some are not spelt as ours)."""
        free, odd = self._by_gpu(resource, offered)
        for gpu in self._gpus(resource, {g: len(ids) for g, ids in free.items()}, need, chosen, frozenset(offered)):
            if need <= 0:
                break
            picked = self._lowest(resource, free.get(gpu, []), need, odd)
            chosen.extend(picked)
            need -= len(picked)
        return chosen

    def _core_gpus(self, free: dict[int, int], need: int, already: dict[int, list[str]]) -> list[int]:
        # GPUs that already hold must-include IDs are filled first.
        head = sorted(already)
        scratch = self._scratch_tree()
        whole = need % names.HUNDRED_CORES == 0
        # The scratch tree carries the allocator's shares already; each GPU keeps no more room than the
        # kubelet offers IDs for (a whole GPU: all of it or none).
        for leaf in scratch.leaves:
            room = min(free.get(leaf.index, 0), leaf.allocatable_cores)
            if whole and room < names.HUNDRED_CORES:
                room = 0
            if room < leaf.allocatable_cores:
                scratch.occupy(leaf.index, leaf.allocatable_cores - room, 0)
        try:
            picked = choose(scratch, need, 0) if whole or need < names.HUNDRED_CORES else []
        except ValueError as exc:
            log.debug("no topology preference for %d cores: %s", need, exc)
            picked = []
        return head + [g for g in picked if g not in head]

    @staticmethod
    def _memory_gpus(free: dict[int, int], need: int) -> list[int]:
        fitting = sorted((count, gpu) for gpu, count in free.items() if count >= need)
        if fitting:
            return [fitting[0][1]]
        # Nothing fits on one GPU: take from the fullest-free GPUs first.
        return [gpu for count, gpu in sorted((-count, gpu) for gpu, count in free.items()) if count]
