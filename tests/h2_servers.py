"""Scripted HTTP/2 servers on a unix socket, to test gpu-client against what grpcio never sends.

``serve_h2`` reads the client's request with the ``h2`` library (an independent HTTP/2
implementation that checks the client's framing and headers), then lets a scenario answer
through ``h2`` or with raw frames. ``serve_raw`` answers with arbitrary bytes (garbage,
truncated or mutated transcripts, a server that never answers).
"""

from __future__ import annotations

import contextlib
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import h2.config
import h2.connection
import h2.events
import h2.exceptions

DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, CONTINUATION = 0x0, 0x1, 0x3, 0x4, 0x6, 0x7, 0x9
END_STREAM, END_HEADERS, PADDED = 0x1, 0x4, 0x8


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    """One HTTP/2 frame."""
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def grpc_message(payload: bytes = b"") -> bytes:
    """A length-prefixed, uncompressed gRPC message."""
    return b"\0" + struct.pack(">I", len(payload)) + payload


@dataclass
class Request:
    """What the server saw of one connection."""

    headers: dict[str, str] = field(default_factory=dict)
    header_order: list[str] = field(default_factory=list)
    body: bytes = b""
    events: list[str] = field(default_factory=list)  # h2 event class names after the request


@dataclass
class Exchange:
    """A connection being answered: the socket, the h2 state, the request."""

    sock: socket.socket
    conn: h2.connection.H2Connection
    request: Request

    def flush(self) -> None:
        """Send what h2 has queued."""
        data = self.conn.data_to_send()
        if data:
            self.sock.sendall(data)

    def raw(self, data: bytes) -> None:
        """Send bytes h2 does not know about."""
        self.sock.sendall(data)


Scenario = Callable[[Exchange], None]


class UnixServer:
    """Accepts connections on a fresh unix socket and runs ``handle`` on each, one at a time."""

    def __init__(self, handle: Callable[[socket.socket], None]) -> None:
        self._dir = tempfile.mkdtemp(prefix="gm-h2-")
        self.path = Path(self._dir) / "vcuda.sock"
        self._handle = handle
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(str(self.path))
        self._sock.listen(8)
        self._sock.settimeout(0.2)
        self._stop = threading.Event()
        self.errors: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                conn.settimeout(10)
                try:
                    self._handle(conn)
                except (OSError, h2.exceptions.H2Error):
                    pass
                except BaseException as exc:  # a broken scenario must fail the test, not vanish
                    self.errors.append(exc)

    def close(self) -> None:
        """Stop accepting and remove the socket."""
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close()
        with contextlib.suppress(OSError):
            self.path.unlink()
            Path(self._dir).rmdir()


def _drain(sock: socket.socket, conn: h2.connection.H2Connection | None, req: Request, limit: float = 5.0) -> None:
    """Read until the client closes, recording (and answering, via h2) what it sends."""
    deadline = time.monotonic() + limit
    sock.settimeout(0.2)
    while time.monotonic() < deadline:
        try:
            data = sock.recv(65536)
        except TimeoutError:
            continue
        except OSError:
            return
        if not data:
            return
        if conn is None:
            continue
        try:
            for event in conn.receive_data(data):
                req.events.append(type(event).__name__)
            out = conn.data_to_send()
            if out:
                sock.sendall(out)
        except h2.exceptions.H2Error as exc:
            req.events.append(f"h2 error: {exc}")
            conn = None


def h2_handler(scenario: Scenario, seen: list[Request]) -> Callable[[socket.socket], None]:
    """A connection handler: read the request with h2, run the scenario, then drain."""

    def handle(sock: socket.socket) -> None:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding="utf-8"))
        conn.initiate_connection()
        sock.sendall(conn.data_to_send())
        req = Request()
        seen.append(req)
        ended = False
        while not ended:
            data = sock.recv(65536)
            if not data:
                return
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.RequestReceived):
                    for name, value in event.headers:
                        req.headers[str(name)] = str(value)
                        req.header_order.append(str(name))
                elif isinstance(event, h2.events.DataReceived):
                    req.body += event.data
                    conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                elif isinstance(event, h2.events.StreamEnded):
                    ended = True
            out = conn.data_to_send()
            if out:
                sock.sendall(out)
        scenario(Exchange(sock, conn, req))
        _drain(sock, conn, req)

    return handle


def raw_handler(
    answer: bytes | Callable[[socket.socket], None], read_first: bool = True
) -> Callable[[socket.socket], None]:
    """A connection handler that sends ``answer`` (bytes, or a function of the socket) and drains."""

    def handle(sock: socket.socket) -> None:
        if read_first:
            sock.settimeout(2)
            with contextlib.suppress(TimeoutError):
                sock.recv(65536)
        if callable(answer):
            answer(sock)
        else:
            sock.sendall(answer)
        _drain(sock, None, Request(), limit=3.0)

    return handle


@contextlib.contextmanager
def scenario_server(scenario: Scenario) -> Iterator[tuple[UnixServer, list[Request]]]:
    """An h2 server running ``scenario`` on each connection; yields it and the requests seen."""
    seen: list[Request] = []
    server = UnixServer(h2_handler(scenario, seen))
    try:
        yield server, seen
    finally:
        server.close()
    if server.errors:
        raise server.errors[0]


@contextlib.contextmanager
def raw_server(answer: bytes | Callable[[socket.socket], None], read_first: bool = True) -> Iterator[UnixServer]:
    """A server answering every connection with ``answer``."""
    server = UnixServer(raw_handler(answer, read_first))
    try:
        yield server
    finally:
        server.close()
    if server.errors:
        raise server.errors[0]
