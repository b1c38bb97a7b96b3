"""The two resources served to the kubelet, vcuda-core and vcuda-memory: a servicer and a server each.

Both answer from the prepared device lists and pass the kubelet's calls to the late handlers
(which wait, bounded, until the allocation state is loaded). Every call is answered with the
same options: PreStartContainer is required, GetPreferredAllocation is offered.
"""

from __future__ import annotations

import functools
from pathlib import Path

from gpumanager import names
from gpumanager.api import deviceplugin_v1beta1_pb2 as pb
from gpumanager.deviceplugin.devicelists import DeviceLists
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
) -> tuple[PluginManager, list[ResourceServicer]]:
    """The plugin manager of both resources (not started) and their servicers, in that order."""
    options = pb.DevicePluginOptions(pre_start_required=True, get_preferred_allocation_available=True)
    servicers: list[ResourceServicer] = []
    servers = []
    for resource, sock, allocate, pre_start in (
        (names.VCORE_RESOURCE, names.VCORE_SOCKET, late.allocate_core, late.pre_start_core),
        (names.VMEMORY_RESOURCE, names.VMEMORY_SOCKET, late.allocate_memory, late.pre_start_memory),
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
    manager = PluginManager(servers, kubelet_socket, options_for=lambda _s: options, watch_period=watch_period)
    return manager, servicers
