"""Registration of a device-plugin endpoint with the kubelet."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from gpumanager import names
from gpumanager.api import deviceplugin_v1beta1_pb2 as pb
from gpumanager.api import deviceplugin_v1beta1_pb2_grpc as pb_grpc


class RegistrationError(RuntimeError):
    """The kubelet could not be reached or refused the registration."""


@dataclass(frozen=True)
class Endpoint:
    """One resource to register: its socket file name (relative to the directory) and options."""

    endpoint: str
    resource: str
    options: pb.DevicePluginOptions


def register(kubelet_socket: Path, endpoints: Sequence[Endpoint], *, timeout: float = 5.0) -> None:
    """Send one RegisterRequest per endpoint to the kubelet, in order, over one connection.

    Raises RegistrationError with the reason on the first failure.
    """
    if not kubelet_socket.exists():
        raise RegistrationError(f"kubelet socket {kubelet_socket} does not exist")
    channel = grpc.insecure_channel(f"unix://{kubelet_socket}")
    try:
        try:
            grpc.channel_ready_future(channel).result(timeout=timeout)
        except grpc.FutureTimeoutError as exc:
            raise RegistrationError(f"cannot connect to the kubelet at {kubelet_socket} within {timeout:g} s") from exc
        stub = pb_grpc.RegistrationStub(channel)
        for ep in endpoints:
            request = pb.RegisterRequest(
                version=names.DEVICE_PLUGIN_API_VERSION,
                endpoint=ep.endpoint,
                resource_name=ep.resource,
                options=ep.options,
            )
            try:
                # The kubelet dials us back inside Register (up to 10 s); allow for that.
                stub.Register(request, timeout=timeout + 10.0)
            except grpc.RpcError as exc:
                raise RegistrationError(
                    f"kubelet refused registration of {ep.resource} ({ep.endpoint}): {exc.code().name}: {exc.details()}"
                ) from exc
    finally:
        # Closing a channel can take a few hundred milliseconds; nothing waits for it.
        threading.Thread(target=channel.close, name="close-kubelet-channel", daemon=True).start()
