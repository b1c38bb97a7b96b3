"""Registration of a device-plugin endpoint with the kubelet."""

from __future__ import annotations

import os
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


def register(kubelet_socket: Path, endpoints: Sequence[Endpoint], *, timeout: float = 5.0) -> tuple[int, int]:
    """Send one RegisterRequest per endpoint to the kubelet, all at once over one connection.

    The kubelet handles each Register on its own (it dials the endpoint back and opens
    ListAndWatch inside the call), so sending them together makes both resources ready in the
    time of one. Returns the (device, inode) of the ``kubelet.sock`` registered with: the socket
    file is held open and dialled through that handle, so a kubelet that re-creates it meanwhile
    is told apart from the one that answered. Raises RegistrationError with the reason of the
    first failure, in endpoint order.
    """
    try:
        handle = os.open(kubelet_socket, os.O_PATH | os.O_CLOEXEC)
    except FileNotFoundError:
        raise RegistrationError(f"kubelet socket {kubelet_socket} does not exist") from None
    except OSError as exc:
        raise RegistrationError(f"cannot open kubelet socket {kubelet_socket}: {exc.strerror}") from None
    try:
        st = os.fstat(handle)
        _register_through(f"/proc/self/fd/{handle}", kubelet_socket, endpoints, timeout)
    finally:
        os.close(handle)
    return (st.st_dev, st.st_ino)


def _register_through(path: str, kubelet_socket: Path, endpoints: Sequence[Endpoint], timeout: float) -> None:
    channel = grpc.insecure_channel(f"unix://{path}", options=[("grpc.default_authority", "localhost")])
    try:
        stub = pb_grpc.RegistrationStub(channel)
        calls = [
            (
                ep,
                # The kubelet dials us back inside Register (up to 10 s); allow for that.
                stub.Register.future(
                    pb.RegisterRequest(
                        version=names.DEVICE_PLUGIN_API_VERSION,
                        endpoint=ep.endpoint,
                        resource_name=ep.resource,
                        options=ep.options,
                    ),
                    timeout=timeout + 10.0,
                ),
            )
            for ep in endpoints
        ]
        for ep, call in calls:
            try:
                call.result()
            except grpc.RpcError as exc:
                for _ep, other in calls:
                    other.cancel()
                if exc.code() == grpc.StatusCode.UNAVAILABLE:
                    raise RegistrationError(
                        f"cannot reach the kubelet at {kubelet_socket} to register {ep.resource}: {exc.details()}"
                    ) from exc
                raise RegistrationError(
                    f"kubelet refused registration of {ep.resource} ({ep.endpoint}): {exc.code().name}: {exc.details()}"
                ) from exc
    finally:
        # Closing a channel can take a few hundred milliseconds; nothing waits for it.
        threading.Thread(target=channel.close, name="close-kubelet-channel", daemon=True).start()
