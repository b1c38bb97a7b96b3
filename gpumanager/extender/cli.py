"""``gpu-manager-extender``: the kube-scheduler extender for tencent.com/vcuda-core and vcuda-memory.

Exit codes: 0 after a clean stop (SIGTERM/SIGINT), 2 for an invalid flag (the flag and the
value are named), 1 when it cannot start (the port is taken, the certificate cannot be read).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import ssl
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn, cast

from gpumanager import __version__
from gpumanager.extender.placement import POLICIES, Policy
from gpumanager.extender.server import parse_listen

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_START = 1
EXIT_CONFIG = 2


class _Parser(argparse.ArgumentParser):
    """Reports a bad flag in one line (exit 2), as :func:`_fail` does, not after a usage summary."""

    def error(self, message: str) -> NoReturn:
        one_line = " ".join(message.split("\n"))
        self.exit(EXIT_CONFIG, f"{self.prog}: invalid flag: {one_line} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser."""
    p = _Parser(
        prog="gpu-manager-extender",
        allow_abbrev=False,  # a prefix (--assume=30) is refused as given, as Go's flag package does
        description="kube-scheduler extender placing tencent.com/vcuda-* requests on GPUs that can hold them.",
    )
    p.add_argument("--listen", default=":3456", help="address to serve on, host:port or :port (default %(default)s)")
    p.add_argument("--kubeconfig", default="", help="kubeconfig file; empty means in-cluster (the default)")
    p.add_argument(
        "--policy",
        default="binpack",
        choices=POLICIES,
        help="binpack: fill used GPUs first, keeping whole GPUs free; spread: emptiest GPU first (default %(default)s)",
    )
    p.add_argument("--url-prefix", default="/scheduler", help="path prefix of the verbs (default %(default)s)")
    p.add_argument("--tls-cert-file", default="", help="serve HTTPS with this certificate (PEM)")
    p.add_argument("--tls-private-key-file", default="", help="the certificate's private key (PEM)")
    p.add_argument(
        "--assume-ttl",
        type=float,
        default=300.0,
        help=(
            "safety net: seconds a Binding that got no answer keeps its GPUs held (one the API server "
            "answered keeps them until the pod watch shows the pod bound, ended or gone), and a pod "
            "chosen for a node but not bound, with no bind of this extender behind it, holds them there "
            "(default %(default)s)"
        ),
    )
    p.add_argument(
        "--bind-timeout",
        type=float,
        default=4.0,
        help="seconds a bind may take in all, API calls included; keep it below the scheduler's httpTimeout "
        "(default %(default)s)",
    )
    p.add_argument("--v", type=int, default=0, help="log verbosity (>= 4 logs debug messages) (default %(default)s)")
    p.add_argument("--version", action="store_true", help="print the version and exit")
    return p


#: The longest --assume-ttl: Go's longest duration, in seconds (what the scheduler's own TTLs allow).
MAX_ASSUME_TTL = 9223372036


def _fail(flag: str, value: str, problem: str) -> NoReturn:
    print(f"gpu-manager-extender: invalid flag: {flag}={value}: {problem}", file=sys.stderr)
    raise SystemExit(EXIT_CONFIG)


def _validate(args: argparse.Namespace) -> tuple[str, int, tuple[str, str] | None]:
    try:
        host, port = parse_listen(args.listen)
    except ValueError as exc:
        _fail("--listen", args.listen, str(exc))
    if args.url_prefix and not args.url_prefix.startswith("/"):
        _fail("--url-prefix", args.url_prefix, "must start with /")
    if not 0 < args.assume_ttl <= MAX_ASSUME_TTL:  # NaN and infinity too: an assumption would never end
        _fail("--assume-ttl", str(args.assume_ttl), f"must be positive and at most {MAX_ASSUME_TTL} seconds")
    if not 0 < args.bind_timeout <= 600:
        _fail("--bind-timeout", str(args.bind_timeout), "must be more than 0 and at most 600 seconds")
    if args.assume_ttl < args.bind_timeout:
        # A replica that sees a pod chosen for a node (not bound) holds its GPUs there for --assume-ttl
        # only: shorter than a bind may take, they would be let go while another replica's bind still runs.
        _fail(
            "--assume-ttl",
            f"{args.assume_ttl:g}",
            f"must be at least --bind-timeout={args.bind_timeout:g}: a pod chosen for a node would stop "
            "holding its GPUs there while its bind still runs",
        )
    if args.kubeconfig and not Path(args.kubeconfig).is_file():
        _fail("--kubeconfig", args.kubeconfig, "no such file")
    cert, key = args.tls_cert_file, args.tls_private_key_file
    if bool(cert) != bool(key):
        missing = "--tls-private-key-file" if cert else "--tls-cert-file"
        flag, value = ("--tls-cert-file", cert) if cert else ("--tls-private-key-file", key)
        _fail(flag, value, f"needs {missing} too")
    tls = None
    if cert:
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key)
        except ssl.SSLError as exc:  # its text is OpenSSL's: "[SSL] PEM lib (_ssl.c:3874)"
            problem = "not a PEM certificate (chain) and the PEM private key that belongs to it"
            _fail("--tls-cert-file", f"{cert} (key {key})", f"cannot be loaded: {problem} ({exc})")
        except OSError as exc:
            _fail("--tls-cert-file", f"{cert} (key {key})", f"cannot be loaded: {exc}")
        tls = (cert, key)
    return host, port, tls


def _stop_while_starting(signum: int, _frame: object) -> None:
    os.write(2, f"gpu-manager-extender: received {signal.Signals(signum).name} while starting; exiting\n".encode())
    os._exit(EXIT_OK)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``gpu-manager-extender``."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.version:
        print(f"gpu-manager-extender {__version__}")
        return EXIT_OK
    host, port, tls = _validate(args)
    # Until it serves (its service and the API client load for hundreds of ms), a stop ends it at once.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _stop_while_starting)
    logging.basicConfig(
        level=logging.DEBUG if args.v >= 4 else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        force=True,
    )
    for noisy in ("urllib3", "kubernetes"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

    from gpumanager.extender.service import Extender, ExtenderSettings  # late: keeps --help fast
    from gpumanager.kube.client import KubeUnavailableError, api_client

    try:
        # A bind answers the scheduler within --bind-timeout: a throttled request fails and bind's own
        # retries, bounded by that deadline, take over (three Retry-After waits took 18 s of a 4 s bind).
        api = api_client(args.kubeconfig, wait_as_told=False)
    except KubeUnavailableError as exc:
        log.error("cannot start: %s", exc)
        return EXIT_START
    settings = ExtenderSettings(
        host=host,
        port=port,
        policy=cast(Policy, args.policy),
        url_prefix=args.url_prefix,
        tls=tls,
        assume_ttl=args.assume_ttl,
        bind_timeout=args.bind_timeout,
    )
    try:
        extender = Extender(api, settings)
    except OSError as exc:
        log.error("cannot listen on %s: %s", args.listen, exc)
        return EXIT_START
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("received %s; stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    log.info("gpu-manager-extender %s starting", __version__)
    extender.start()
    try:
        while not stop.wait(1.0):
            pass
    finally:
        extender.stop()
    log.info("stopped")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
