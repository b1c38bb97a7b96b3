"""Command line: gpu-manager v1.1 flags (same names and meaning) plus our own, logging, signals, exit codes.

Exit codes: 0 after a clean stop (SIGTERM/SIGINT), 2 for invalid flags or
configuration or a node lock that cannot be taken at all, 3 when NVML cannot be used (no driver, or a broken node spec
on the simulated node).

Signals: SIGTERM and SIGINT stop the agent within two seconds whatever it is
doing (its sockets are removed first). SIGHUP does not stop it: it re-checks
allocations and the driver mirror at once.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import faulthandler
import fcntl
import fnmatch
import json
import logging
import os
import re
import shutil
import signal
import stat
import sys
import textwrap
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from gpumanager import __version__, buildinfo, flagspec, names
from gpumanager.config import Config, ConfigError
from gpumanager.flagspec import FlagField

if TYPE_CHECKING:
    from gpumanager.app import Agent, StartupError
    from gpumanager.signals import SignalPipe

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_CONFIG = 2
EXIT_NVML = 3


def _argparse_type(field: FlagField) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return field.spec.parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = field.flag  # argparse names the type in some errors
    return convert


def _version_value(text: str) -> bool | str:
    """--version's value as Kubernetes' version flag reads it: ``raw``, or a Go boolean."""
    if text == "raw":
        return text
    try:
        return flagspec.parse_bool(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc} (true, false or raw)") from None


def flag_help(field: FlagField) -> str:
    """The help line of one flag: meaning, default and environment variable."""
    return f"{field.spec.help} (default: {field.default_text()}; env {field.env})"


def env_defaults(environ: Mapping[str, str]) -> dict[str, Any]:
    """Values of the ``GPU_MANAGER_<FLAG>`` variables that are set; ValueError names the variable and value."""
    values: dict[str, Any] = {}
    for field in flagspec.flag_fields(Config):
        if field.env in environ:
            raw = environ[field.env]
            try:
                values[field.name] = field.spec.parse(raw)
            except ValueError as exc:
                raise ValueError(f"{field.env}={raw!r} ({field.flag}): {exc}") from None
    return values


#: ``GPU_MANAGER_*`` variables that are no flag's: the build's commit and the crash and stall points
#: of the fault tests (gpumanager.buildinfo, gpumanager.faults).
OWN_VARIABLES = frozenset({"GPU_MANAGER_COMMIT", "GPU_MANAGER_CRASH_AT", "GPU_MANAGER_STALL_AT"})


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """A warning for each ``GPU_MANAGER_*`` variable set in ``environ`` that names no flag: a misspelled
    one (``GPU_MANAGER_SHARE_MOD``) would otherwise change nothing, unseen."""
    known = {field.env for field in flagspec.flag_fields(Config)}
    unknown = sorted(n for n in environ if n.startswith("GPU_MANAGER_") and n not in known | OWN_VARIABLES)
    if not unknown:
        return []
    import difflib  # only for a variable to warn about: not loaded at every start

    warnings = []
    for name in unknown:
        close = difflib.get_close_matches(name, known, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        warnings.append(f"the environment variable {name} names no flag{hint}; it is ignored")
    return warnings


_FLAG_IN_TEXT = re.compile(r"--([a-z][a-z0-9-]*)")


def name_variables(message: str, argv: Sequence[str], environ: Mapping[str, str]) -> str:
    """``message`` (which names flags, ``--query-port=70000: ...``) with the ``GPU_MANAGER_*`` variable and
    its value added for each flag it names whose value came from that variable: one not on the command
    line. A manifest that sets ``GPU_MANAGER_CDI_ROOT`` holds no ``--cdi-root`` to look for."""
    given = set()
    for arg in normalize_argv(argv):
        if arg == "--":
            break
        if arg.startswith("--"):
            given.add(arg.partition("=")[0])
    by_flag = {field.flag: field for field in flagspec.flag_fields(Config)}
    named = []
    for flag in dict.fromkeys("--" + m for m in _FLAG_IN_TEXT.findall(message)):
        field = by_flag.get(flag)
        if field is not None and flag not in given and field.env in environ:
            named.append(f"{flag} is {field.env}={environ[field.env]!r} from the environment")
    return f"{message} ({'; '.join(named)})" if named else message


class _HelpFormatter(argparse.HelpFormatter):
    """Wraps help text at spaces only, so paths and flag names stay whole."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=32, width=min(110, shutil.get_terminal_size().columns))

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(text, width, break_on_hyphens=False, break_long_words=False)


class _Parser(argparse.ArgumentParser):
    """Reports a bad flag or variable in one line (exit 2), as Go's flag package does, not after a
    usage summary of every flag that buries it in the log."""

    def error(self, message: str) -> NoReturn:
        one_line = " ".join(message.split("\n"))
        self.exit(EXIT_CONFIG, f"{self.prog}: error: {one_line} (see {self.prog} --help)\n")


def build_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The argument parser (flag names as gpu-manager's; ``_`` and ``-`` are interchangeable).

    Every flag also reads ``GPU_MANAGER_<FLAG>`` from ``environ`` (default: none);
    a flag on the command line wins over the variable.
    """
    p = _Parser(
        prog="gpu-manager",
        formatter_class=_HelpFormatter,
        # Go's flag package takes whole names only: a prefix (--share=true) or klog's --log_file must
        # be refused as given, not read as --share-mode or --log-file-max-size.
        allow_abbrev=False,
        description="Share NVIDIA GPUs between Kubernetes containers (tencent.com/vcuda-core, vcuda-memory).",
        epilog="Every flag can also be set with the environment variable shown; the flag wins. "
        "Durations: as Go writes them (500ms, 30s, 1m0s, 1h30m) or seconds. "
        "`gpu-manager selftest` (its own --help) proves memory and SM isolation on this node's GPU "
        "with the installed interceptor.",
    )
    for field in flagspec.flag_fields(Config):
        extra: dict[str, Any] = {"nargs": "?", "const": True} if field.spec.bare_means_true else {}
        p.add_argument(
            field.flag,
            dest=field.name,
            type=_argparse_type(field),
            default=field.default,
            metavar=field.spec.metavar or field.name.upper(),
            help=flag_help(field).replace("%", "%%"),
            **extra,
        )
    p.add_argument(
        "--version",
        nargs="?",
        const=True,
        default=False,
        type=_version_value,
        metavar="BOOL",
        help="print the version and the git commit it was built from, and exit (true, false or raw)",
    )
    if environ:
        try:
            p.set_defaults(**env_defaults(environ))
        except ValueError as exc:
            p.error(str(exc))
    return p


def normalize_argv(argv: Sequence[str]) -> list[str]:
    """Make ``--share_mode=true`` mean ``--share-mode=true``, as gpu-manager's flag library does, and
    ``-v=4``, ``-v 4``, ``-log_dir=DIR`` mean ``--v=4``, ``--v 4``, ``--log-dir=DIR``: klog's flags are
    documented (and Go's flag package takes every flag) with one dash, and ``-v4`` means ``--v=4`` (pflag's
    shorthand for klog's -v). A single-dash word that names no flag is left to be refused; nothing after
    ``--`` is touched."""
    known = {f.flag[2:] for f in flagspec.flag_fields(Config)} | {"version", "help"}
    out = []
    rest = iter(argv)
    for arg in rest:
        if arg == "--":
            out.append(arg)
            out.extend(rest)
            break
        if arg.startswith("--"):
            name, sep, value = arg[2:].partition("=")
            arg = "--" + name.replace("_", "-") + sep + value
        elif arg.startswith("-") and len(arg) > 1:
            name, sep, value = arg[1:].partition("=")
            if name.replace("_", "-") in known:
                arg = "--" + name.replace("_", "-") + sep + value
            elif name[:1] == "v" and name[1:].isascii() and name[1:].isdigit() and not sep:
                arg = "--v=" + name[1:]  # pflag's shorthand with its value attached: -v4
        out.append(arg)
    return out


def config_from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> Config:
    """Build and validate the Config; raise ConfigError on a bad value."""
    env = os.environ if environ is None else environ
    fields = {f: getattr(args, f) for f in Config.__dataclass_fields__ if hasattr(args, f)}
    fields["node_name"] = env.get("NODE_NAME", "")
    return Config(**fields).validate()


class JSONFormatter(logging.Formatter):
    """One JSON object per line: ``ts`` (RFC 3339, UTC), ``level``, ``logger``, ``msg``, and ``exc`` on errors."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, ensure_ascii=False)


#: klog's severities as logging levels (--stderrthreshold).
SEVERITY_LEVELS = {"INFO": logging.INFO, "WARNING": logging.WARNING, "ERROR": logging.ERROR, "FATAL": logging.CRITICAL}
#: The --v (or --vmodule level) from which debug messages are written.
DEBUG_VERBOSITY = 4


class KlogFilter(logging.Filter):
    """klog's --vmodule (a module's own verbosity, by a glob on its file name) and --log-backtrace-at (a
    message logged from that file and line carries the stack), applied on every handler."""

    def __init__(self, v: int, vmodule: str, backtrace_at: str) -> None:
        super().__init__()
        self._v = v
        self._vmodule = flagspec.vmodule_settings(vmodule)
        file, _, line = backtrace_at.rpartition(":")
        self._trace = (file, int(line)) if backtrace_at else None

    def verbosity(self, record: logging.LogRecord) -> int:
        """The --v that applies to the module that logged ``record``."""
        for pattern, level in self._vmodule:
            target = os.path.splitext(record.pathname)[0] if "/" in pattern else record.module
            if fnmatch.fnmatchcase(target, pattern):
                return level
        return self._v

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.INFO and self._vmodule and self.verbosity(record) < DEBUG_VERBOSITY:
            return False
        if (
            self._trace is not None
            and record.stack_info is None
            and record.lineno == self._trace[1]
            and os.path.basename(record.pathname) == self._trace[0]
        ):
            record.stack_info = "Stack (most recent call last):\n" + "".join(_stack_of(record)).rstrip("\n")
        return True


def _stack_of(record: logging.LogRecord) -> list[str]:
    """The stack of the call that logged ``record`` (without logging's own frames)."""
    frame = sys._getframe()
    while frame is not None and not (frame.f_code.co_filename == record.pathname and frame.f_lineno == record.lineno):
        frame = frame.f_back  # type: ignore[assignment]
    return traceback.format_stack(frame)


LOG_BACKUPS = 3


def setup_logging(args: argparse.Namespace) -> None:
    """One format for every module (--log-format); --v >= 4 enables debug messages.

    As klog: stderr by default; ``--log-dir`` adds ``gpu-manager.log`` there (rotated at
    ``--log-file-max-size`` MiB, 3 older files kept); ``--logtostderr=false`` with a
    log directory writes the file, and to stderr only what is at or above
    ``--stderrthreshold`` (ERROR), unless ``--alsologtostderr``. ``--vmodule`` and
    ``--log-backtrace-at`` as klog's (:class:`KlogFilter`).
    """
    handlers: list[logging.Handler] = []
    if args.log_dir:
        from logging.handlers import RotatingFileHandler  # only here: its imports slow every start

        Path(args.log_dir).mkdir(parents=True, exist_ok=True)
        handlers.append(
            RotatingFileHandler(
                Path(args.log_dir) / "gpu-manager.log",
                maxBytes=max(1, args.log_file_max_size) << 20,
                backupCount=LOG_BACKUPS,
                # UTF-8 whatever the locale; a host path that is not UTF-8 (its bytes kept as
                # surrogate escapes) is written escaped, not lost with a "Logging error" on stderr
                encoding="utf-8",
                errors="backslashreplace",
            )
        )
    if args.logtostderr or args.alsologtostderr or not handlers:
        handlers.append(logging.StreamHandler(sys.stderr))
    else:  # klog: the file has everything, stderr what is at or above --stderrthreshold
        to_stderr = logging.StreamHandler(sys.stderr)
        to_stderr.setLevel(SEVERITY_LEVELS[args.stderrthreshold])
        handlers.append(to_stderr)
    klog = KlogFilter(args.v, args.vmodule, args.log_backtrace_at)
    formatter = (
        JSONFormatter()
        if args.log_format == "json"
        else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    for handler in handlers:
        handler.setFormatter(formatter)
        handler.addFilter(klog)
    # Neither format names the thread or process of a record: not looked up for each (the logging
    # HOWTO's "Optimization"). A fatal signal (a crash in a native library such as NVML) writes
    # every thread's Python stack to stderr.
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    debug = args.v >= DEBUG_VERBOSITY or any(
        level >= DEBUG_VERBOSITY for _, level in flagspec.vmodule_settings(args.vmodule)
    )
    logging.basicConfig(level=logging.DEBUG if debug else logging.INFO, handlers=handlers, force=True)
    faulthandler.enable()
    # grpc and the kubernetes client are noisy at debug level.
    for noisy in ("urllib3", "kubernetes"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def one_line(text: str) -> str:
    """``text`` with line breaks and other control characters escaped (``\\n``): a flag's value that
    holds one must not split the one line that refuses it, nor forge a log line of its own."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``gpu-manager`` command (``gpu-manager selftest ...``: gpumanager/selftest)."""
    args = list(sys.argv[1:] if argv is None else argv)
    previous = _exit_on_early_stop() if args[:1] != ["selftest"] else {}  # selftest handles its own
    try:
        return _main(args)
    finally:  # a caller in this process (a test) gets its own handlers back
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _main(argv: list[str]) -> int:
    from gpumanager.rlimits import raise_open_files_limit

    raise_open_files_limit()  # the pods' vcuda.sock connections must not take the agent's last descriptor
    if argv[:1] == ["selftest"]:
        from gpumanager.selftest import main as selftest

        return selftest(argv[1:])
    args = build_parser(os.environ).parse_args(normalize_argv(argv))
    if args.version:
        print(
            f"gpu-manager {__version__} (commit {buildinfo.commit()}, "
            f"device plugin API {names.DEVICE_PLUGIN_API_VERSION})"
        )
        return EXIT_OK
    try:
        setup_logging(args)
    except OSError as exc:
        print(f"gpu-manager: {name_variables(f'--log-dir={args.log_dir}: {exc}', argv, os.environ)}", file=sys.stderr)
        return EXIT_CONFIG
    for warning in unknown_variables(os.environ):
        log.warning("%s", warning)
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        log.error("invalid configuration: %s", one_line(name_variables(str(exc), argv, os.environ)))
        return EXIT_CONFIG

    from gpumanager import lazy_package
    from gpumanager.memory import limit_malloc_arenas

    limit_malloc_arenas()  # before the gRPC and API threads start
    lazy_package.defer(*DEFERRED_AT_START)
    from gpumanager.app import Agent, StartupError  # imported late: keeps --help and --version fast
    from gpumanager.signals import SignalPipe

    signals = SignalPipe().install()  # from here on a stop signal is acted on at once, during the start too
    try:
        _lock_fd, stopped = hold_node_lock(Path(config.checkpoint_path), signals)
    except NodeLockError as exc:
        log.error("%s", name_variables(str(exc), argv, os.environ))
        return EXIT_CONFIG
    if stopped is None:
        _dir_locks, stopped = hold_socket_dir_locks(config, signals)
    if stopped is not None:
        log.info("received %s while waiting for the node's lock; exiting", stopped.name)
        return EXIT_OK
    agent = Agent(config, held_locks=_dir_locks)
    received = _start_unless_stopped(agent, signals)
    if isinstance(received, StartupError):
        log.error("cannot start: %s", one_line(name_variables(str(received), argv, os.environ)))
        _stop_within(agent, STOP_DEADLINE)
        return received.exit_code
    if received is None:  # started (else a stop signal came during the start)
        while (received := signals.next()) == signal.SIGHUP:  # the main thread sleeps until a signal comes
            log.info("received SIGHUP")
            agent.recheck()
    log.info("received %s; stopping", received.name)
    _stop_within(agent, STOP_DEADLINE)
    log.info("stopped")
    exit_watchdog(EXIT_DEADLINE)
    return EXIT_OK


def _exit_on_early_stop() -> dict[signal.Signals, Any]:
    """Until the agent takes the signals (:class:`~gpumanager.signals.SignalPipe`, before it locks the node
    or opens anything), SIGTERM and SIGINT end the process at once with status 0 and one line on stderr:
    not 143 unannounced, nor a KeyboardInterrupt traceback from whatever module was being imported.
    Returns the handlers it replaced."""

    def stop(signum: int, _frame: object) -> None:
        os.write(2, f"gpu-manager: received {signal.Signals(signum).name} while starting; exiting\n".encode())
        os._exit(EXIT_OK)

    previous: dict[signal.Signals, Any] = {}
    if threading.current_thread() is threading.main_thread():  # signal.signal works there only
        for signum in (signal.SIGTERM, signal.SIGINT):
            previous[signum] = signal.signal(signum, stop)
    return previous


#: Modules whose code runs only when first used (gpumanager.lazy_package): ``import grpc`` ends with
#: ``grpc.aio``, which loads asyncio and ssl, about 50 ms of every start; registration with the
#: kubelet needs neither, the per-pod vcuda.sock servers (started later) load them. protobuf's
#: pure-Python messages (17 ms) are not used at all where its upb backend is. ``subprocess`` and
#: ``tempfile`` (ctypes.util, through pynvml) and ``calendar`` (protobuf's well-known types) are
#: first used after registration: 3-5 ms.
DEFERRED_AT_START = (
    "asyncio",
    "grpc.aio",
    "google.protobuf.internal.python_message",
    "subprocess",
    "tempfile",
    "calendar",
)


def _start_unless_stopped(agent: Agent, signals: SignalPipe) -> StartupError | signal.Signals | None:
    """Start the agent in a thread while the main thread listens for signals: a stop signal during the
    start (NVML hanging on a GPU that fell off the bus, say) is acted on at once, and the agent's start
    serves nothing once it is stopping. Returns the StartupError that ended the start, the stop signal
    that came first, or None when the agent started (a SIGHUP meanwhile is acted on then)."""
    from gpumanager.app import StartupError
    from gpumanager.signals import STOP

    failure: list[BaseException] = []
    done = threading.Event()

    def run() -> None:
        try:
            agent.start()
        except BaseException as exc:  # handed to the main thread
            failure.append(exc)
        finally:
            done.set()
            signals.wake()

    threading.Thread(target=run, name="start", daemon=True).start()
    recheck = False
    while not done.is_set():
        received = signals.wait()
        if received is None:
            continue
        if received in STOP:
            return received
        recheck = True
    if failure:
        if isinstance(failure[0], StartupError):
            return failure[0]
        raise failure[0]
    if recheck:
        log.info("received SIGHUP while starting")
        agent.recheck()
    return None


#: The file in --checkpoint-path whose lock (flock) one agent per node holds for its whole life.
LOCK_FILE = "gpu-manager.lock"
#: How often an agent waiting for that lock tries again.
LOCK_RETRY_SECONDS = 0.5


class NodeLockError(RuntimeError):
    """The node's single-instance lock cannot be taken at all; the message names the path and the reason."""


def hold_node_lock(directory: Path, signals: SignalPipe) -> tuple[int | None, signal.Signals | None]:
    """Take the node's single-instance lock, waiting while another agent holds it.

    Two agents on one node (a rolling update with surge) would each remove the other's sockets
    and register over them, and both write the checkpoint. The second one waits here, before it
    loads anything or serves. The lock is the checkpoint directory itself (``--checkpoint-path``,
    or that entry when it is no directory) and, when it can be used, :data:`LOCK_FILE` in it, which
    names the holder and is what earlier versions lock. Returns the descriptor of the first (kept
    open for the process's life; the second stays open too) and the stop signal that ended the
    wait ((None, signal) then, nothing held). Raises NodeLockError when neither can be locked.
    """
    from gpumanager.signals import STOP

    fds: list[int] = []
    try:
        base, why = _open_lock_base(directory)
        if base is not None:
            fds.append(base)
        lock_file = _open_lock_file(directory)
        if lock_file is not None:
            fds.append(lock_file)
        taken: list[int] = []
        problems: list[str] = [why] if why else []
        for fd in fds:
            what = str(directory) if fd == base else str(directory / LOCK_FILE)
            try:
                received = _flock_waiting(fd, what, lock_file, signals)
            except OSError as exc:  # a file system without locks
                problems.append(f"cannot lock {what}: {exc.strerror or exc}")
                continue
            if received is not None and received in STOP:
                for other in fds:
                    os.close(other)
                return None, received
            taken.append(fd)
        if not taken:
            raise NodeLockError(
                f"cannot take the node's single-instance lock in --checkpoint-path={directory}: "
                + "; ".join(problems or ["no lock can be opened"])
            )
        for fd in fds:
            if fd not in taken:
                os.close(fd)
        fds = []
        if lock_file in taken:
            assert lock_file is not None
            try:
                os.ftruncate(lock_file, 0)
                os.pwrite(lock_file, f"{os.getpid()}\n".encode(), 0)
            except OSError:
                pass  # read-only, or a directory at that path: the holder is just not named
        return taken[0], None
    finally:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)


#: Opened without following a symbolic link (the PID written would truncate its target), without
#: blocking on a FIFO or becoming a terminal's owner.
_LOCK_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


def _open_lock_base(directory: Path) -> tuple[int | None, str]:
    """The checkpoint directory, opened to be locked (created if missing); or, when it is no directory,
    that entry when it is a regular file. (None, why) when neither can be opened."""
    not_created: OSError | None = None
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        not_created = exc
    try:
        return os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC), ""
    except OSError as exc:
        why = f"cannot open {directory}: {exc.strerror or exc}"
        if exc.errno == errno.ENOENT and not_created is not None:  # why it is missing: mkdir's own error
            uid = os.geteuid()
            who = f" (the agent runs as uid {uid})" if uid != 0 else ""
            why = f"cannot create {directory}: {not_created.strerror or not_created}{who}"
        if exc.errno != errno.ENOTDIR:
            return None, why
    try:
        fd = os.open(directory, os.O_RDONLY | _LOCK_FLAGS)
    except OSError:
        return None, why
    if _mode(fd, stat.S_ISREG):
        return fd, ""
    os.close(fd)
    return None, f"{directory} is neither a directory nor a regular file"


def _open_lock_file(directory: Path) -> int | None:
    """:data:`LOCK_FILE` in ``directory``, created if missing, when it is a regular file or a directory;
    None (logged when something unusable is there) otherwise."""
    path = directory / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | _LOCK_FLAGS, 0o644)
    except OSError:
        try:
            fd = os.open(path, os.O_RDONLY | _LOCK_FLAGS)  # a read-only disk, or a directory: flock works on it too
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                log.error("%s is a symbolic link, which is not followed; remove it. Locking %s only", path, directory)
            elif exc.errno != errno.ENOENT:
                log.warning("cannot open %s (%s); locking %s only", path, exc.strerror, directory)
            return None
    if _mode(fd, stat.S_ISREG) or _mode(fd, stat.S_ISDIR):
        return fd
    log.warning("%s is not a regular file; locking %s only", path, directory)
    os.close(fd)
    return None


def _mode(fd: int, test: Callable[[int], bool]) -> bool:
    try:
        return test(os.fstat(fd).st_mode)
    except OSError:
        return False


def _socket_dirs(config: Config) -> list[tuple[str, Path]]:
    """The directories whose sockets and files one agent alone may serve, with their flags."""
    if config.mode == "dra":
        return [("--dra-plugin-path", config.dra_socket_dir)]
    return [
        ("--device-plugin-path", Path(config.device_plugin_path)),
        ("--virtual-manager-path", Path(config.virtual_manager_path)),
    ]


def hold_socket_dir_locks(config: Config, signals: SignalPipe) -> tuple[list[int], signal.Signals | None]:
    """Lock the directories the agent serves its sockets in (:func:`_socket_dirs`), waiting while another
    agent holds one: a second agent given another --checkpoint-path (whose lock it therefore took) must not
    remove the first one's sockets and serve over them, nor delete its pods' directories. A directory that
    is --checkpoint-path itself, or another one's, is locked once (a second lock on it would wait on the
    agent's own); one that cannot be opened is left to the start, which names the problem. Returns the
    descriptors held (kept open for the process's life) and the stop signal that ended a wait ([] then)."""
    from gpumanager.signals import STOP

    seen: set[tuple[int, int]] = set()
    with contextlib.suppress(OSError):
        st = os.stat(config.checkpoint_path)
        seen.add((st.st_dev, st.st_ino))
    held: list[int] = []
    for flag, directory in _socket_dirs(config):
        with contextlib.suppress(OSError):
            directory.mkdir(mode=0o755, parents=True, exist_ok=True)  # as the start makes it
        try:
            fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            continue
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) in seen:
            os.close(fd)
            continue
        seen.add((st.st_dev, st.st_ino))
        what = f"{flag}={directory}, served there with another --checkpoint-path than {config.checkpoint_path}"
        try:
            received = _flock_waiting(fd, what, None, signals)
        except OSError:  # a file system without locks: the checkpoint's lock is all there is
            os.close(fd)
            continue
        if received is not None and received in STOP:
            os.close(fd)
            for other in held:
                os.close(other)
            return [], received
        held.append(fd)
    return held, None


def _flock_waiting(fd: int, what: str, holder: int | None, signals: SignalPipe) -> signal.Signals | None:
    """Lock ``fd``, waiting while another agent holds it; the stop signal that ended the wait, else None.
    OSError when the file system cannot lock it."""
    from gpumanager.signals import STOP

    waiting = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            pass
        if not waiting:
            waiting = True
            log.warning(
                "another gpu-manager (%s) holds the node (lock %s); waiting for it to exit before loading the "
                "checkpoint or serving the device plugin",
                _lock_holder(holder),
                what,
            )
        received = signals.poll(LOCK_RETRY_SECONDS)
        if received is not None and received in STOP:
            return received
    if waiting:
        log.info("the other gpu-manager has gone; took the node's lock %s", what)
    return None


def _lock_holder(fd: int | None) -> str:
    """Who holds the lock, as its file says."""
    try:
        pid = os.pread(fd, 32, 0).decode(errors="replace").strip() if fd is not None else ""
    except OSError:
        pid = ""
    return f"pid {pid} in its PID namespace" if pid.isdigit() else "pid unknown"


#: Seconds a stop may take; the kubelet waits 30 s but a rolling update should not.
STOP_DEADLINE = 1.5


#: Seconds the interpreter may take to exit after a stop (it joins the threads that are not daemons).
EXIT_DEADLINE = 2.0


def exit_watchdog(deadline: float) -> None:
    """Leave the process ``deadline`` seconds from now if the interpreter's own exit has not ended it:
    a thread that is not a daemon (a gRPC handler still inside a stream, say) would otherwise keep a
    stopped agent alive until the kubelet kills it. The threads that held it are logged."""

    def run() -> None:
        time.sleep(deadline)
        held = sorted(t.name for t in threading.enumerate() if not t.daemon and t is not threading.main_thread())
        log.warning("threads still running %.1f s after the stop: %s; exiting now", deadline, ", ".join(held))
        logging.shutdown()
        os._exit(EXIT_OK)

    threading.Thread(target=run, name="exit-watchdog", daemon=True).start()


def _stop_within(agent: Agent, deadline: float) -> None:
    """Stop the agent; if some component does not let go in time, leave anyway (sockets are gone first)."""
    done = threading.Event()

    def run() -> None:
        try:
            agent.stop()
        finally:
            done.set()

    threading.Thread(target=run, name="stop", daemon=True).start()
    if not done.wait(deadline):
        log.warning("stopping took longer than %.1f s; exiting now", deadline)
        logging.shutdown()
        os._exit(EXIT_OK)


if __name__ == "__main__":
    sys.exit(main())
