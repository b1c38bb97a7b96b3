"""Registration of a device-plugin endpoint with the kubelet."""

from __future__ import annotations

from pathlib import Path

import grpc

from gpumanager import names
from gpumanager.api import deviceplugin_v1beta1_pb2 as pb
from gpumanager.api import deviceplugin_v1beta1_pb2_grpc as pb_grpc


class RegistrationError(RuntimeError):
    """The kubelet could not be reached or refused the registration."""


def register(
    kubelet_socket: Path,
    *,
    endpoint: str,
    resource: str,
    options: pb.DevicePluginOptions,
    timeout: float = 5.0,
) -> None:
    """Send one RegisterRequest to the kubelet; raise RegistrationError with the reason on failure.

    ``endpoint`` is the plugin's socket file name, relative to the device-plugin directory.
    """
    if not kubelet_socket.exists():
        raise RegistrationError(f"kubelet socket {kubelet_socket} does not exist")
    with grpc.insecure_channel(f"unix://{kubelet_socket}") as channel:
        try:
            grpc.channel_ready_future(channel).result(timeout=timeout)
        except grpc.FutureTimeoutError as exc:
            raise RegistrationError(f"cannot connect to the kubelet at {kubelet_socket} within {timeout:g} s") from exc
        stub = pb_grpc.RegistrationStub(channel)
        request = pb.RegisterRequest(
            version=names.DEVICE_PLUGIN_API_VERSION,
            endpoint=endpoint,
            resource_name=resource,
            options=options,
        )
        try:
            # The kubelet dials us back inside Register (up to 10 s); allow for that.
            stub.Register(request, timeout=timeout + 10.0)
        except grpc.RpcError as exc:
            raise RegistrationError(
                f"kubelet refused registration of {resource} ({endpoint}): {exc.code().name}: {exc.details()}"
            ) from exc
