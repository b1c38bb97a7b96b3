"""Registration of a device-plugin endpoint with the kubelet."""

from __future__ import annotations

import os
import stat
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from gpumanager import names
from gpumanager.api import deviceplugin_v1beta1_pb2 as pb
from gpumanager.api import deviceplugin_v1beta1_pb2_grpc as pb_grpc


class RegistrationError(RuntimeError):
    """The kubelet could not be reached or refused the registration.

    ``unreachable``: no kubelet answered at an existing ``kubelet.sock`` (the connection was refused or
    dropped: a dead kubelet's socket, or a new kubelet's between its bind and its listen; or the call went
    unanswered while the socket dialled was replaced or removed: a kubelet restart), as opposed to a
    kubelet's own refusal or a socket missing before the dial."""

    def __init__(self, message: str, *, unreachable: bool = False) -> None:
        super().__init__(message)
        self.unreachable = unreachable


@dataclass(frozen=True)
class Endpoint:
    """One resource to register: its socket file name (relative to the directory) and options."""

    endpoint: str
    resource: str
    options: pb.DevicePluginOptions


#: How long a Register may take. The kubelet sets no deadline of its own and dials the plugin back
#: inside the call (up to 10 s each), so a busy kubelet answers late; a call cancelled early is a
#: registration that the kubelet may have made and we count as failed.
REGISTER_DEADLINE = 60.0

#: How often a Register not yet answered looks whether ``kubelet.sock`` still names the socket dialled.
#: A kubelet.sock made again (or removed) is mostly a new kubelet, the old one gone or going: the call to
#: the old one is ended then, not left to its deadline while the new kubelet waits for us.
REPLACED_CHECK_SECONDS = 0.02

#: How long a call still has once the socket dialled was replaced. A kubelet whose own gRPC server failed
#: listens on a new socket and still serves the connections it had: a Register it answers within this is
#: kept, rather than sent again to overlap with the one it is handling (a normal one takes milliseconds).
REPLACED_GRACE_SECONDS = 0.5


def register(
    kubelet_socket: Path,
    endpoints: Sequence[Endpoint],
    *,
    timeout: float = REGISTER_DEADLINE,
    before_dial: Callable[[], None] | None = None,
) -> tuple[int, int]:
    """Send one RegisterRequest per endpoint to the kubelet, all at once over one connection.

    The kubelet handles each Register on its own (it dials the endpoint back and opens
    ListAndWatch inside the call), so sending them together makes both resources ready in the
    time of one. Returns the (device, inode) of the ``kubelet.sock`` registered with: the socket
    file is held open and dialled through that handle (``/proc/self/fd/<n>``, on a connection of
    this call's own), so a kubelet that re-creates it meanwhile is told apart from the one that
    answered. Without procfs the path itself is dialled. ``timeout`` is each call's deadline.
    ``before_dial`` runs once the socket is held, just before the dial: the kubelet that made that
    socket has wiped the directory already (it does so before it listens), so endpoint sockets found
    intact there are the ones it will dial back. A call still unanswered :data:`REPLACED_GRACE_SECONDS`
    after ``kubelet_socket`` came to name another file, or none (a new kubelet, or one starting: the one
    dialled is gone), ends then as unreachable, rather than at its deadline (dialled through procfs only).
    Raises RegistrationError with the reason of the first failure, in endpoint order.
    """
    try:
        handle = os.open(kubelet_socket, os.O_PATH | os.O_CLOEXEC)
    except FileNotFoundError:
        raise RegistrationError(f"kubelet socket {kubelet_socket} does not exist") from None
    except OSError as exc:
        raise RegistrationError(f"cannot open kubelet socket {kubelet_socket}: {exc.strerror}") from None
    except ValueError as exc:  # a NUL byte in the path
        raise RegistrationError(f"kubelet socket {kubelet_socket!r}: {exc}") from None
    try:
        st = os.fstat(handle)
        if not stat.S_ISSOCK(st.st_mode):
            raise RegistrationError(f"kubelet socket {kubelet_socket} is not a socket")
        through = f"/proc/self/fd/{handle}"
        held = os.path.exists(through)
        dial = through if held else str(kubelet_socket)
        if before_dial is not None:
            before_dial()
        # Without procfs the path is dialled: the file reached may be a newer one than the handle holds,
        # so a replaced path tells nothing then, and an unanswered call waits for its deadline.
        _register_through(dial, kubelet_socket, endpoints, timeout, (st.st_dev, st.st_ino) if held else None)
    finally:
        os.close(handle)
    return (st.st_dev, st.st_ino)


def _still_there(kubelet_socket: Path, dialled: tuple[int, int]) -> bool:
    """Whether ``kubelet_socket`` still names the file dialled (through the handle held on it, which keeps
    its inode number from being reused: another number, or no file, is another kubelet.sock). A look
    that fails otherwise (EIO, ESTALE...) tells nothing: taken as still there."""
    try:
        st = os.stat(kubelet_socket)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError:
        return True
    return (st.st_dev, st.st_ino) == dialled


def _answer(call: grpc.Future[pb.Empty], kubelet_socket: Path, dialled: tuple[int, int] | None, ep: Endpoint) -> None:
    """Wait for a Register's answer (its own deadline bounds the wait); raise RegistrationError
    (unreachable) when it is still unanswered :data:`REPLACED_GRACE_SECONDS` after ``kubelet_socket``
    stopped naming the socket it was sent to (``dialled``; None: not known, never looked at)."""
    if dialled is None:
        call.result()
        return
    replaced_at: float | None = None
    while True:
        try:
            call.result(timeout=REPLACED_CHECK_SECONDS)
            return
        except grpc.FutureTimeoutError:
            if _still_there(kubelet_socket, dialled):
                replaced_at = None
                continue
            now = time.monotonic()
            if replaced_at is None:
                replaced_at = now
            elif now - replaced_at >= REPLACED_GRACE_SECONDS:
                raise RegistrationError(
                    f"cannot reach the kubelet at {kubelet_socket} to register {ep.resource} ({ep.endpoint}): "
                    "the kubelet dialled did not answer before its socket was made again or removed (a "
                    "kubelet restart)",
                    unreachable=True,
                ) from None


def _register_through(
    path: str, kubelet_socket: Path, endpoints: Sequence[Endpoint], timeout: float, dialled: tuple[int, int] | None
) -> None:
    # A connection of this call's own: with grpc's shared pool, a channel to the same target (the same
    # fd number, as a registration before this one used) may still be connected to the kubelet.sock
    # that was there then.
    channel = grpc.insecure_channel(
        f"unix://{path}", options=[("grpc.default_authority", "localhost"), ("grpc.use_local_subchannel_pool", 1)]
    )
    try:
        stub = pb_grpc.RegistrationStub(channel)
        calls = [
            (
                ep,
                stub.Register.future(
                    pb.RegisterRequest(
                        version=names.DEVICE_PLUGIN_API_VERSION,
                        endpoint=ep.endpoint,
                        resource_name=ep.resource,
                        options=ep.options,
                    ),
                    timeout=timeout,
                ),
            )
            for ep in endpoints
        ]
        for ep, call in calls:
            try:
                _answer(call, kubelet_socket, dialled, ep)
            except RegistrationError:
                for _ep, other in calls:
                    other.cancel()
                raise
            except grpc.RpcError as exc:
                for _ep, other in calls:
                    other.cancel()
                # Spelt with the socket's own path: the handle's number changes from one try to the next.
                details = str(exc.details() or "").replace(path, str(kubelet_socket))
                if exc.code() == grpc.StatusCode.UNAVAILABLE:
                    raise RegistrationError(
                        f"cannot reach the kubelet at {kubelet_socket} to register {ep.resource}: {details}",
                        unreachable=True,
                    ) from exc
                raise RegistrationError(
                    f"kubelet at {kubelet_socket} refused registration of {ep.resource} ({ep.endpoint}): "
                    f"{exc.code().name}: {details}"
                ) from exc
    finally:
        # Closing a channel can take a few hundred milliseconds; nothing waits for it.
        threading.Thread(target=channel.close, name="close-kubelet-channel", daemon=True).start()
