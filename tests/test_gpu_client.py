"""gpu-client (vcuda/client/): RegisterVDevice over HTTP/2 against the agent's grpcio server,
against scripted HTTP/2 servers (h2), and against broken ones (garbage, silence, mutations)."""

from __future__ import annotations

import random
import re
import shutil
import socket
import struct
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import hpack
import pytest
from elftools.elf.elffile import ELFFile
from hpack import huffman_constants
from hpack.table import HeaderTable

from gpumanager import names
from gpumanager.allocation.records import ContainerAllocation
from gpumanager.api import vcuda_pb2, vcuda_pb2_grpc
from gpumanager.vmanager import files
from gpumanager.vmanager.manager import VirtualManager
from tests import h2_servers as hs
from tests.gpu_client_fixtures import ASAN_CLIENT, VCUDA, client_built

__all__ = ["client_built"]

POD = "3f0c6a8e-51b2-4d7a-9b0e-7c1d2e3f4a5b"
OTHER_POD = "9a8b7c6d-0000-4111-8222-933344445555"
CID = "4be2c6f1e0d94d3b8c8f0e5a6b7c8d9e0f1a2b3c4d5e6f708192a3b4c5d6e7f8"
SANITIZER = re.compile(r"AddressSanitizer|UndefinedBehaviorSanitizer|runtime error:|LeakSanitizer")


@dataclass
class Result:
    rc: int
    stderr: str
    seconds: float


def run_client(binary: Path, *args: str, timeout: float = 20.0) -> Result:
    started = time.monotonic()
    done = subprocess.run(
        [str(binary), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={"ASAN_OPTIONS": "detect_leaks=1", "UBSAN_OPTIONS": "print_stacktrace=1"},
    )
    return Result(done.returncode, done.stderr, time.monotonic() - started)


def upstream_args(sock: Path, pod: str = POD, cid: str = CID, *extra: str) -> list[str]:
    """The arguments upstream's library passes (new style: container ID, empty bus ID)."""
    return ["--addr", str(sock), "--bus-id", "", "--pod-uid", pod, "--cont-id", cid, *extra]


# -- the build ----------------------------------------------------------------------------------


def test_static_elf_with_no_interpreter(client_built: Path) -> None:
    with client_built.open("rb") as f:
        elf = ELFFile(f)
        assert elf.header.e_type == "ET_EXEC"
        assert not [s for s in elf.iter_segments() if s.header.p_type == "PT_INTERP"]
        assert elf.get_section_by_name(".dynamic") is None


def test_huffman_table_is_rfc_7541() -> None:
    text = (VCUDA / "client" / "gc_huffman.c").read_text()
    table = [(int(c, 16), int(n)) for c, n in re.findall(r"\{0x([0-9a-f]+)u,\s*(\d+)\}", text)]
    assert table == list(zip(huffman_constants.REQUEST_CODES, huffman_constants.REQUEST_CODES_LENGTH, strict=True))


def test_static_table_is_rfc_7541() -> None:
    text = (VCUDA / "client" / "gc_hpack.c").read_text()
    body = text[text.index("static_table[GC_HPACK_STATIC_ENTRIES]") :]
    entries = re.findall(r'\{"([^"]*)", "([^"]*)"\}', body[: body.index("};")])
    assert [(n.encode(), v.encode()) for n, v in entries] == list(HeaderTable.STATIC_TABLE)


# -- against the agent's server -----------------------------------------------------------------


@dataclass
class Node:
    vm: VirtualManager
    vm_path: Path
    cgroup: Path
    pods: dict[str, dict[str, object]]

    def sock(self, pod: str = POD) -> Path:
        return self.vm_path / pod / names.VCUDA_SOCKET


def pod_object(uid: str, containers: dict[str, str]) -> dict[str, object]:
    return {
        "metadata": {"uid": uid, "name": f"p-{uid[:4]}", "namespace": "default"},
        "spec": {"containers": [{"name": n} for n in containers]},
        "status": {
            "qosClass": "Guaranteed",
            "containerStatuses": [{"name": n, "containerID": f"containerd://{c}"} for n, c in containers.items() if c],
        },
    }


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    vm_path = Path(tempfile.mkdtemp(prefix="gm-vm-"))  # short: <vm>/<uid>/vcuda.sock < 108 bytes
    cgroup = tmp_path / "cgroup"
    pods: dict[str, dict[str, object]] = {POD: pod_object(POD, {"main": CID}), OTHER_POD: pod_object(OTHER_POD, {})}
    allocs = {
        (POD, "main"): ContainerAllocation(POD, "main", (0,), 30, 4 << 28),
        (OTHER_POD, "main"): ContainerAllocation(OTHER_POD, "main", (1,), 30, 4 << 28),
    }
    vm = VirtualManager(
        vm_path=vm_path,
        cgroup_root=cgroup,
        allocation=lambda uid, name: allocs.get((uid, name)),
        pod=pods.get,  # type: ignore[arg-type]
        driver_version="550.54.15",
    )
    procs = cgroup / "kubepods" / f"pod{POD}" / CID
    procs.mkdir(parents=True)
    (procs / "cgroup.procs").write_text("4242\n17\n")
    for uid in (POD, OTHER_POD):
        vm.prepare(allocs[(uid, "main")])
    try:
        yield Node(vm, vm_path, cgroup, pods)
    finally:
        vm.stop()
        shutil.rmtree(vm_path, ignore_errors=True)


def test_registers_with_the_agent(client_built: Path, node: Node) -> None:
    result = run_client(client_built, *upstream_args(node.sock()))
    assert (result.rc, result.stderr) == (0, "")
    assert files.read_pids(node.vm_path / POD / CID / names.PIDS_CONFIG_FILE) == [17, 4242]
    config = files.unpack((node.vm_path / POD / CID / names.VCUDA_CONFIG_FILE).read_bytes())
    assert (config.pod_uid, config.container_name, config.utilization) == (POD, "main", 30)


def test_legacy_container_name_and_go_flag_spellings(client_built: Path, node: Node) -> None:
    args = [f"-addr={node.sock()}", "-bus-id", "0000:3b:00.0", f"--pod-uid={POD}", "-cont-name", "main"]
    assert run_client(client_built, *args).rc == 0
    assert files.read_pids(node.vm_path / "configs" / POD / "main" / names.PIDS_CONFIG_FILE) == [17, 4242]


def test_refusal_exits_non_zero_with_the_agents_reason(client_built: Path, node: Node) -> None:
    result = run_client(client_built, *upstream_args(node.sock(), pod=OTHER_POD))
    assert result.rc == 1
    assert "PERMISSION_DENIED (7)" in result.stderr and f"pod UID '{OTHER_POD}' is not the pod" in result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("gpu-client: RegisterVDevice(pod ")
    assert not (node.vm_path / POD / CID).exists()


def test_a_call_from_outside_the_pod_sockets_is_refused(node: Node) -> None:
    """The one gRPC server behind the pod sockets refuses a connection that did not come through one."""
    sockets = node.vm._sockets
    assert sockets is not None
    with grpc.insecure_channel(f"unix:{sockets._address}") as channel:
        stub = vcuda_pb2_grpc.VCUDAServiceStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.RegisterVDevice(vcuda_pb2.VDeviceRequest(pod_uid=POD, container_id=CID), timeout=5)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "did not come in on a pod's vcuda.sock" in str(err.value.details())
    assert not (node.vm_path / POD / CID).exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "--addr is required"),
        (["--addr", "/x"], "--pod-uid is required"),
        (["--addr", "/x", "--pod-uid", POD], "one of --cont-id and --cont-name is required"),
        (["--addr", "/x", "--pod-uid", POD, "--cont-id", CID, "--bogus", "1"], "unknown flag --bogus"),
        (["--addr", "/x", "--pod-uid", POD, "--cont-id"], "flag --cont-id needs a value"),
        (["--addr", "/x", "--pod-uid", POD, "--cont-id", CID, "--timeout", "soon"], "--timeout=soon is not"),
        (["--addr", "/x", "--pod-uid", POD, "--cont-id", "x" * 5000], "--cont-id is longer than 4096 bytes"),
        (["stray"], "unexpected argument stray"),
    ],
)
def test_command_line_errors_exit_2(client_built: Path, args: list[str], message: str) -> None:
    result = run_client(client_built, *args)
    assert result.rc == 2 and message in result.stderr and "usage: gpu-client" in result.stderr


def test_a_missing_socket_is_retried_until_the_deadline(client_built: Path, tmp_path: Path) -> None:
    result = run_client(client_built, *upstream_args(tmp_path / "vcuda.sock", POD, CID, "--timeout", "0.6"))
    assert result.rc == 1 and "cannot connect: No such file or directory" in result.stderr
    assert 0.5 < result.seconds < 5


def test_a_socket_that_appears_while_retrying_is_used(client_built: Path, node: Node) -> None:
    """An agent restarting: the socket is gone for a moment, the client waits for it."""
    node.vm.stop()
    assert not node.sock().exists()
    proc = subprocess.Popen([str(client_built), *upstream_args(node.sock())], stderr=subprocess.PIPE, text=True)
    time.sleep(0.5)
    node.vm.resume([POD])
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err


# -- scripted HTTP/2 servers ------------------------------------------------------------------


def grpc_headers(status: str = "200", content_type: str = "application/grpc") -> list[tuple[str, str]]:
    return [(":status", status), ("content-type", content_type)]


def test_the_request_is_valid_http2_and_grpc(client_built: Path) -> None:
    def answer(ex: hs.Exchange) -> None:
        ex.conn.send_headers(1, grpc_headers())
        ex.conn.send_data(1, hs.grpc_message())
        ex.conn.send_headers(1, [("grpc-status", "0")], end_stream=True)
        ex.flush()

    with hs.scenario_server(answer) as (server, seen):
        result = run_client(ASAN_CLIENT, *upstream_args(server.path))
    assert (result.rc, result.stderr) == (0, "")
    req = seen[0]
    assert req.header_order[:4] == [":method", ":scheme", ":path", ":authority"]
    assert req.headers[":path"] == "/vcuda.VCUDAService/RegisterVDevice"
    assert req.headers["content-type"] == "application/grpc" and req.headers["te"] == "trailers"
    assert re.fullmatch(r"\d+m", req.headers["grpc-timeout"])
    length = struct.unpack(">I", req.body[1:5])[0]
    assert req.body[0] == 0 and length == len(req.body) - 5
    msg = vcuda_pb2.VDeviceRequest.FromString(req.body[5:])
    assert (msg.bus_id, msg.pod_uid, msg.container_name, msg.container_id) == ("", POD, "", CID)
    assert "ConnectionTerminated" in req.events  # the client says goodbye with GOAWAY


def test_huffman_dynamic_table_continuation_padding_and_ping(client_built: Path) -> None:
    """Headers spread over CONTINUATION frames, Huffman strings, dynamic-table references, a
    table size update, padded DATA, a PING to answer and a GOAWAY that spares the call."""
    enc = hpack.Encoder()

    def answer(ex: hs.Exchange) -> None:
        ex.raw(hs.frame(hs.PING, 0, 0, b"pingpong"))
        big = [(f"x-filler-{i}", "v" * 7000) for i in range(3)]  # 21 kB: one HEADERS + CONTINUATIONs
        block = enc.encode([*grpc_headers(), ("x-repeat", "same value"), *big], huffman=True)
        chunks = [block[i : i + 16384] for i in range(0, len(block), 16384)]
        assert len(chunks) > 1
        ex.raw(hs.frame(hs.HEADERS, 0, 1, chunks[0]))
        for i, chunk in enumerate(chunks[1:], 1):
            ex.raw(hs.frame(hs.CONTINUATION, hs.END_HEADERS if i == len(chunks) - 1 else 0, 1, chunk))
        ex.raw(hs.frame(hs.GOAWAY, 0, 0, struct.pack(">II", 1, 0)))
        message = hs.grpc_message()
        ex.raw(hs.frame(hs.DATA, hs.PADDED, 1, bytes([7]) + message + b"\0" * 7))
        enc.header_table_size = 256  # a size update starts the next block
        trailers = enc.encode([("x-repeat", "same value"), ("grpc-status", "0"), ("grpc-message", "")], huffman=True)
        ex.raw(hs.frame(hs.HEADERS, hs.END_HEADERS | hs.END_STREAM, 1, trailers))

    with hs.scenario_server(answer) as (server, seen):
        result = run_client(ASAN_CLIENT, *upstream_args(server.path))
    assert (result.rc, result.stderr) == (0, "")
    assert "PingAckReceived" in seen[0].events


def test_trailers_only_refusal_with_a_percent_encoded_message(client_built: Path) -> None:
    def answer(ex: hs.Exchange) -> None:
        headers = [*grpc_headers(), ("grpc-status", "9"), ("grpc-message", "no%20cgroup%0Afor %E2%9C%93 100%")]
        ex.conn.send_headers(1, headers, end_stream=True)
        ex.flush()

    with hs.scenario_server(answer) as (server, _):
        result = run_client(ASAN_CLIENT, *upstream_args(server.path))
    assert result.rc == 1
    assert "refused: FAILED_PRECONDITION (9): no cgroup for \u2713 100%\n" in result.stderr


@pytest.mark.parametrize(
    ("name", "answer", "message"),
    [
        (
            "not grpc",
            lambda ex: (ex.conn.send_headers(1, grpc_headers("404", "text/html"), end_stream=True), ex.flush()),
            "HTTP status 404 instead of 200",
        ),
        (
            "wrong content type",
            lambda ex: (ex.conn.send_headers(1, grpc_headers("200", "text/plain"), end_stream=True), ex.flush()),
            "content-type is not application/grpc",
        ),
        (
            "OK without a message",
            lambda ex: (
                ex.conn.send_headers(1, grpc_headers()),
                ex.conn.send_headers(1, [("grpc-status", "0")], end_stream=True),
                ex.flush(),
            ),
            "status OK but no response message",
        ),
        (
            "no grpc-status",
            lambda ex: (
                ex.conn.send_headers(1, grpc_headers()),
                ex.conn.send_data(1, hs.grpc_message()),
                ex.conn.send_headers(1, [("x-other", "1")], end_stream=True),
                ex.flush(),
            ),
            "carries no grpc-status",
        ),
        (
            "compressed",
            lambda ex: (
                ex.conn.send_headers(1, grpc_headers()),
                ex.conn.send_data(1, b"\1" + struct.pack(">I", 3) + b"abc"),
                ex.conn.send_headers(1, [("grpc-status", "0")], end_stream=True),
                ex.flush(),
            ),
            "compressed response",
        ),
        (
            "reset",
            lambda ex: (ex.conn.reset_stream(1, error_code=8), ex.flush()),
            "reset the call (RST_STREAM CANCEL)",
        ),
        (
            "goaway before the call",
            lambda ex: ex.raw(hs.frame(hs.GOAWAY, 0, 0, struct.pack(">II", 0, 11) + b"too many pings")),
            "refused the call (GOAWAY ENHANCE_YOUR_CALM: too many pings)",
        ),
        (
            "push",
            lambda ex: ex.raw(hs.frame(0x5, hs.END_HEADERS, 1, struct.pack(">I", 2) + b"\x82")),
            "PUSH_PROMISE although push is disabled",
        ),
    ],
)
def test_protocol_failures_are_named(client_built: Path, name: str, answer: hs.Scenario, message: str) -> None:
    with hs.scenario_server(answer) as (server, _):
        result = run_client(ASAN_CLIENT, *upstream_args(server.path, POD, CID, "--timeout", "5"))
    assert result.rc == 1, name
    assert message in result.stderr and not SANITIZER.search(result.stderr), result.stderr


# -- broken servers: never a hang, never a crash ----------------------------------------------


def _silent(sock: socket.socket) -> None:
    time.sleep(3)


def _close_at_once(sock: socket.socket) -> None:
    sock.shutdown(socket.SHUT_RDWR)


def _drip(sock: socket.socket) -> None:
    server_settings = hs.frame(hs.SETTINGS, 0, 0)
    for byte in server_settings + hs.frame(hs.HEADERS, hs.END_HEADERS, 1, b"\x88"):
        sock.sendall(bytes([byte]))
        time.sleep(0.3)


def _endless_continuation(sock: socket.socket) -> None:
    sock.sendall(hs.frame(hs.HEADERS, 0, 1, b"\x88"))
    for _ in range(64):
        sock.sendall(hs.frame(hs.CONTINUATION, 0, 1, b"\x40\x01a\x01b" * 3000))


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (_silent, "no complete answer before the deadline"),
        (_close_at_once, "closed the connection before the call finished"),
        (_drip, "no complete answer before the deadline"),
        (b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n", "larger than the 16384 announced"),
        (b"\xff\xff\xff\x00\x00\x00\x00\x00\x01", "larger than the 16384 announced"),
        (_endless_continuation, "longer than 65536 bytes"),
        (hs.frame(hs.HEADERS, hs.END_HEADERS, 1, b"\xff\xff\xff\xff\x7f"), "undecodable response headers"),
        (hs.frame(hs.HEADERS, hs.END_HEADERS, 1, b"\x88\x82"), "unexpected pseudo-header :method"),
        (
            hs.frame(hs.HEADERS, hs.END_HEADERS, 1, b"\x88\x5f\x10application/grpc")
            + hs.frame(hs.DATA, 0, 1, b"\0\0\1\0\0" + b"x" * 16000)
            + hs.frame(hs.DATA, 0, 1, b"y" * 16000),
            "response message longer than 16384 bytes",
        ),
        (hs.frame(hs.SETTINGS, 0, 0, b"\0\5\0\0\0\1"), "invalid SETTINGS value 1 for setting 5"),
    ],
)
def test_broken_servers_fail_fast_and_cleanly(client_built: Path, answer: object, message: str) -> None:
    with hs.raw_server(answer) as server:  # type: ignore[arg-type]
        result = run_client(ASAN_CLIENT, *upstream_args(server.path, POD, CID, "--timeout", "2"))
    assert result.rc == 1, result.stderr
    assert message in result.stderr, result.stderr
    assert not SANITIZER.search(result.stderr), result.stderr
    assert result.seconds < 8


def _valid_transcript() -> bytes:
    enc = hpack.Encoder()
    out = hs.frame(hs.SETTINGS, 0, 0, b"\0\4\0\1\0\0") + hs.frame(hs.PING, 0, 0, b"12345678")
    out += hs.frame(hs.HEADERS, hs.END_HEADERS, 1, enc.encode([*grpc_headers(), ("x-a", "b" * 40)], huffman=True))
    out += hs.frame(hs.DATA, hs.PADDED, 1, b"\3" + hs.grpc_message() + b"\0\0\0")
    out += hs.frame(
        hs.HEADERS, hs.END_HEADERS | hs.END_STREAM, 1, enc.encode([("grpc-status", "0"), ("x-a", "b" * 40)])
    )
    return out


def test_mutated_answers_never_crash_or_hang(client_built: Path) -> None:
    """A deterministic fuzz: the client under ASan/UBSan against 120 mutations of a valid answer."""
    transcript = _valid_transcript()
    with hs.raw_server(transcript) as server:
        assert run_client(ASAN_CLIENT, *upstream_args(server.path, POD, CID, "--timeout", "2")).rc == 0
    rng = random.Random(20261121)
    outcomes = {0: 0, 1: 0}
    for _ in range(120):
        data = bytearray(transcript)
        for _ in range(rng.randint(1, 6)):
            action = rng.random()
            pos = rng.randrange(len(data))
            if action < 0.5:
                data[pos] ^= 1 << rng.randrange(8)
            elif action < 0.7:
                data[pos] = rng.choice([0x00, 0xFF, 0x7F, 0x80, 0x3F])
            elif action < 0.85:
                del data[pos : pos + rng.randint(1, 16)]
            else:
                data[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
        with hs.raw_server(bytes(data)) as server:
            result = run_client(ASAN_CLIENT, *upstream_args(server.path, POD, CID, "--timeout", "1"), timeout=15)
        assert result.rc in outcomes, result.stderr
        assert not SANITIZER.search(result.stderr), result.stderr
        assert result.rc == 0 or result.stderr.startswith("gpu-client: ")
        outcomes[result.rc] += 1
    assert outcomes[1] > 60  # most mutations break the answer, and each is reported
