"""The two resources served to the kubelet, vcuda-core and vcuda-memory: a servicer and a server each.

Both answer from the prepared device lists and pass the kubelet's calls to the late handlers
(which wait, bounded, until the allocation state is loaded). Every call is answered with the
same options: PreStartContainer is required, GetPreferredAllocation is offered.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

from gpumanager import names
from gpumanager.api import deviceplugin_v1beta1_pb2 as pb
from gpumanager.deviceplugin.devicelists import DeviceLists
from gpumanager.deviceplugin.dirlock import DirectoryLock
from gpumanager.deviceplugin.late import LateHandlers
from gpumanager.deviceplugin.manager import PluginManager
from gpumanager.deviceplugin.server import PluginServer
from gpumanager.deviceplugin.servicer import ResourceServicer


def vcuda_plugins(
    lists: DeviceLists,
    late: LateHandlers,
    plugin_dir: Path,
    kubelet_socket: Path,
    *,
    watch_period: float,
    dir_lock: DirectoryLock | None = None,
    also_follow: Sequence[DirectoryLock] = (),
) -> tuple[PluginManager, list[ResourceServicer]]:
    """The plugin manager of both resources (not started) and their servicers, in that order."""
    # The kubelet asks GetPreferredAllocation for vcuda-core only: those IDs say which GPU a container
    # gets. vcuda-memory IDs only count memory (the size comes from the pod spec, the GPU from the
    # vcuda-core IDs), and a call offers every free block of the node: 8,500 IDs on 16 x H200, built by
    # the kubelet and read by us for each container. The call is still answered if made.
    core_options = pb.DevicePluginOptions(pre_start_required=True, get_preferred_allocation_available=True)
    memory_options = pb.DevicePluginOptions(pre_start_required=True, get_preferred_allocation_available=False)
    servicers: list[ResourceServicer] = []
    servers = []
    for resource, sock, allocate, pre_start, options in (
        (names.VCORE_RESOURCE, names.VCORE_SOCKET, late.allocate_core, late.pre_start_core, core_options),
        (names.VMEMORY_RESOURCE, names.VMEMORY_SOCKET, late.allocate_memory, late.pre_start_memory, memory_options),
    ):
        servicer = ResourceServicer(
            resource,
            devices=functools.partial(lists.encoded, resource),
            options=options,
            preference=functools.partial(late.prefer, resource),
            allocate=allocate,
            pre_start=pre_start,
        )
        servicers.append(servicer)
        servers.append(PluginServer(servicer, plugin_dir / sock))
    manager = PluginManager(
        servers,
        kubelet_socket,
        options_for=lambda server: server.servicer.options,
        watch_period=watch_period,
        dir_lock=dir_lock,
        also_follow=also_follow,
    )
    return manager, servicers
