"""GPU health: XID critical-error events and lost GPUs take a GPU out; a quiet period brings it back.

One thread waits on an NVML event set for XID critical errors and, between
waits, probes every GPU with a cheap NVML query. A GPU becomes unhealthy on a
critical XID (one not in the ignored list) or when NVML says it is lost; it
becomes healthy again once it answers NVML normally and has had no critical
XID and no failed probe for the quiet period.
"""

from __future__ import annotations

import ctypes
import functools
import json
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pynvml

from gpumanager.device import nvml
from gpumanager.device.types import GPUInfo
from gpumanager.fileio import atomic_write, read_regular

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HealthState:
    """The health of one GPU and why."""

    healthy: bool
    reason: str = ""
    since: float = 0.0  # time.monotonic() of the last change


HealthListener = Callable[[int, HealthState], None]

#: A component's problem ("" cleared by None), as the agent reports them on /healthz and /readyz.
ProblemReport = Callable[[str, str | None], None]

#: The name the XID watch's problems are reported under.
XID_EVENTS = "xid-events"
#: Consecutive failed event waits (not timeouts) after which the event set is freed and made again.
EVENT_WAIT_FAILURES_BEFORE_RESET = 10
#: Seconds before the first attempt to make the event set again; doubled at each failure, up to the last.
EVENT_SET_RETRY_FIRST = 1.0
EVENT_SET_RETRY_MAX = 60.0
#: The reason of a GPU in MIG mode (its shares would land on a GPU that runs CUDA only in MIG instances).
MIG_ENABLED = "MIG mode"
#: Compute modes in which a GPU's shares cannot be used (nvmlComputeMode_t), and why: the reason is
#: 'compute mode <name>' (the DRA taint value ``compute-mode-<name>``). Where no shares are given
#: (whole GPUs only) only PROHIBITED takes a GPU out: an exclusive mode is the operator's choice there.
UNSHAREABLE_COMPUTE_MODES = {
    1: ("EXCLUSIVE_THREAD", "only one thread at a time may have a CUDA context on it"),
    2: ("PROHIBITED", "no CUDA context may be made on it"),
    3: ("EXCLUSIVE_PROCESS", "only one process at a time may have a CUDA context on it"),
}
#: Causes of one unhealthy GPU that are logged (a first, then each other one once, up to this many).
CAUSES_LOGGED = 8
#: Seconds between two log lines of one repeated condition (an ignored XID of one GPU, failing waits).
LOG_PERIOD = 60.0
#: Seconds an NVML call on one GPU may take before the GPU is out of service as not answering (a GPU stuck
#: in reset blocks every call on it). The call is left to finish in that GPU's own thread; the GPU is not
#: asked again until it has, so the other GPUs' probes and the XID events go on meanwhile.
NVML_CALL_TIMEOUT = 5.0
#: The file (in --checkpoint-path) that keeps, across a restart, each GPU's last critical XID within its
#: quiet period: NVML sends an XID once, so a restarted agent would otherwise offer the GPU at once.
SAVED_FILE = "gpumanager_gpu_health"
#: Seconds between two writes of that file while critical XIDs keep coming (a GPU going out or coming back
#: is written at once).
SAVE_PERIOD = 5.0
_SAVED_LIMIT = 1 << 20
#: The reason of a GPU whose NVML calls do not return (the DRA taint value ``nvml-does-not-answer``).
NOT_ANSWERING = "NVML does not answer"


class _Hung(Exception):
    """An NVML call on a GPU did not return within NVML_CALL_TIMEOUT, or one before it still has not."""


class _GpuCaller:
    """One daemon thread that makes one GPU's NVML calls for the monitor, so a call that hangs holds only
    that thread (a daemon: the agent's exit does not wait for it)."""

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = queue.SimpleQueue()
        threading.Thread(target=self._serve, name=name, daemon=True).start()

    def submit(self, call: Callable[[], Any]) -> Future[Any]:
        """Run ``call`` in this GPU's thread; its answer (or error) comes in the future."""
        future: Future[Any] = Future()
        self._calls.put((future, call))
        return future

    def submit_all(self, calls: list[tuple[Future[Any], Callable[[], Any]]]) -> None:
        """Run each call in this thread, one after the other, in one hand-over; each answer (or error)
        comes in its future, and a future cancelled before its turn is skipped."""
        self._calls.put((Future(), functools.partial(_run_each, calls)))

    def close(self) -> None:
        """End the thread once the calls given to it have returned."""
        self._calls.put(None)

    def _serve(self) -> None:
        while (item := self._calls.get()) is not None:
            _run_each([item])


def _run_each(calls: list[tuple[Future[Any], Callable[[], Any]]]) -> None:
    for future, call in calls:
        if not future.set_running_or_notify_cancel():
            continue
        try:
            future.set_result(call())
        except BaseException as exc:  # handed to the monitor's thread with the future
            future.set_exception(exc)


def _outcome(call: Callable[..., Any], handle: object) -> Any:
    """``call(handle)``'s answer, or the NVMLError it raised (kept to be raised in the monitor's thread)."""
    try:
        return call(handle)
    except pynvml.NVMLError as exc:
        return exc


def _probe_calls(handle: object, ask_mig: bool, ask_mode: bool) -> dict[str, Any]:
    """One probe's NVML calls on one GPU, made in that GPU's thread in one hand-over: its memory (raises
    for a lost GPU), then its MIG and compute modes where NVML has them (answers or NVMLErrors)."""
    pynvml.nvmlDeviceGetMemoryInfo(handle)
    answers: dict[str, Any] = {}
    if ask_mig:
        answers["mig"] = _outcome(pynvml.nvmlDeviceGetMigMode, handle)
    if ask_mode:
        answers["mode"] = _outcome(pynvml.nvmlDeviceGetComputeMode, handle)
    return answers


def _saved_time(value: object) -> float:
    """A saved XID's unix time; ValueError when it is no time (NaN, infinite, a string, a bool)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"last_xid_unix {value!r:.80} is not a number")
    at = float(value)  # OverflowError past a float's range
    if not math.isfinite(at):
        raise ValueError(f"last_xid_unix {value!r} is not a finite number")
    return at


def _saved_bytes(entries: dict[str, tuple[str, float]]) -> bytes:
    """The saved file's content: each GPU's (by UUID) last critical XID and its time (Unix seconds)."""
    gpus = {uuid: {"reason": reason, "last_xid_unix": round(at, 3)} for uuid, (reason, at) in entries.items()}
    return json.dumps({"gpus": gpus}, sort_keys=True).encode()


def _handle_key(handle: Any) -> int | None:
    """The address behind an NVML device handle, to recognise the device of an event."""
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return None


class HealthMonitor:
    """Watches XID events and NVML reachability of every GPU; tells listeners of changes."""

    def __init__(
        self,
        gpus: Sequence[GPUInfo],
        *,
        ignored_xids: Iterable[int],
        quiet_period: float,
        probe_period: float = 1.0,
        lost: Iterable[int] = (),
        clock: Callable[[], float] = time.monotonic,
        report: ProblemReport | None = None,
        saved: Path | None = None,
        wall: Callable[[], float] = time.time,
        shares: bool = True,
    ) -> None:
        self._gpus = list(gpus)
        self._uuids = {g.index: g.uuid for g in self._gpus}
        self._ignored = frozenset(ignored_xids)
        self._quiet = quiet_period
        self._probe_period = probe_period
        self._clock = clock
        self._lock = threading.Lock()
        now = clock()
        gone = set(lost)
        self._state = {
            g.index: HealthState(g.index not in gone, "lost at start" if g.index in gone else "", now)
            for g in self._gpus
        }
        self._last_bad: dict[int, float] = {i: now for i in gone}
        # Of each unhealthy GPU, the causes logged (a GPU lost at start is found lost again: nothing new).
        self._causes: dict[int, set[str]] = {i: {"lost at start", "lost"} for i in gone}
        self._unnamed = set(gone)  # lost at start: described from the saved inventory or a guess until it answers
        self._last_answer = now
        self._listeners: list[HealthListener] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._handles: dict[int, object] = {}
        self._missing: set[int] = set()  # GPUs NVML gave no handle for (lost at start)
        self._event_set: Any = None  # made once some GPU has a handle, again after it failed
        self._event_retry_at = 0.0
        self._event_backoff = 0.0
        self._event_attempts = 0
        self._wait_failures = 0
        self._wait_logged_at = -1e18
        self._registered: set[int] = set()  # GPUs whose XIDs the current event set watches
        self._unsupported: set[int] = set()  # GPUs whose NVML has no XID events (only probed)
        self._no_mig: set[int] = set()  # GPUs whose NVML has no MIG mode (not asked again)
        self._no_compute_mode: set[int] = set()  # GPUs whose NVML has no compute mode (not asked again)
        # The probe's answers of each GPU (``_probe_calls``), read by the checks that follow it.
        self._probed: dict[int, dict[str, Any]] = {}
        self._register_logged_at = -1e18
        self._wait_problem = ""  # the event waits keep failing
        self._register_problem = ""  # some GPUs could not be registered in the event set
        self._create_problem = ""  # the event set cannot be made
        self._event_problem = ""
        self._report = report
        self._ignored_seen: dict[tuple[int | None, int], tuple[float, int]] = {}  # last line, count since
        self._by_handle: dict[int, int] = {}
        self._wait_said_lost = False  # the event wait answered GPU_IS_LOST and no timeout came since
        self._unknown_logged_at = -1e18
        self._saved = saved
        self._shares = shares  # containers may share a GPU (share mode, DRA): exclusive modes cannot serve them
        self._wall = wall
        self._xid_out: dict[int, tuple[str, float]] = {}  # GPU -> its last critical XID and when (wall clock)
        self._save_due = False  # a GPU went out or came back: written at the next pass
        self._saved_at = -1e18
        self._saved_content = _saved_bytes({})  # nothing is written before some GPU had a critical XID
        self._save_logged_at = -1e18
        self._callers: dict[int, _GpuCaller] = {}
        # The thread that makes a probe's calls on every GPU in one hand-over (16 threads woken every
        # second cost more CPU than the calls); replaced when a call in it hangs.
        self._round: _GpuCaller | None = None
        self._hung: dict[int, Future[Any]] = {}  # of each GPU whose call did not return in time: that call
        # Of each GPU whose registration in an event set hung: that call and the set it registers the GPU in
        # once it returns (such a set is not freed before: the call would write to freed memory).
        self._late_registrations: dict[int, tuple[Future[Any], Any]] = {}
        self.xid_events = 0
        self.ignored_xid_events = 0
        #: XID events not ignored: counted on its own, so a reader never sees it drop (the difference of
        #: the two counts above, read one after the other, can while events arrive).
        self.critical_xid_events = 0
        if saved is not None:
            self._restore(saved)

    def add_listener(self, listener: HealthListener) -> None:
        """Call ``listener(gpu_index, state)`` on every health change (from the monitor's thread)."""
        self._listeners.append(listener)

    def state(self, index: int) -> HealthState:
        """Current health of GPU ``index``."""
        with self._lock:
            return self._state[index]

    def snapshot(self) -> dict[int, HealthState]:
        """Health of every GPU."""
        with self._lock:
            return dict(self._state)

    def gpu_name(self, index: int | None) -> str:
        """'GPU <index> (<UUID>)' for log lines; 'a GPU NVML cannot name' for an event of no known GPU."""
        if index is None:
            return "a GPU NVML cannot name"
        return f"GPU {index} ({self._uuids.get(index, 'UUID unknown')})"

    def alive(self) -> bool:
        """Whether the monitoring thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def nvml_problem(self, stale_after: float = 10.0) -> str:
        """'' while NVML answers (some GPU answered a probe lately, 'GPU is lost' included, or the node has
        none), else why not."""
        if not self._gpus:
            return ""
        silent = self._clock() - self._last_answer
        if silent > max(stale_after, 3 * self._probe_period):
            return f"NVML has not answered a probe of any GPU for {silent:.0f} s"
        return ""

    def start(self) -> None:
        """Probe every GPU once and register those answering for XID events, then start the monitoring
        thread. A GPU NVML gives no handle for (lost) is marked bad, and its handle is asked for again at
        each probe. A GPU lost at start (NVML failed or did not answer for it in discovery) is asked for by
        the thread only, so the start does not wait for it."""
        for g in self._gpus:
            if g.index in self._unnamed:
                self._missing.add(g.index)
            else:
                self._take_handle(g.index)
        # One probe before the kubelet's lists are made, so a GPU that cannot be used (failing queries, MIG
        # mode) is not offered for the moment before the thread's first probe.
        try:
            self._probe(take_missing=False)
        except Exception:
            log.exception("the first GPU health probe failed; the health thread probes again")
        # The event set too, before the GPUs are offered: NVML shows a set only the XIDs raised after its
        # GPUs were registered, and the thread may run late on a loaded node.
        try:
            self._ensure_events()
        except Exception:
            log.exception("registering the GPUs for XID events failed; the health thread tries again")
        self._thread = threading.Thread(target=self._run, name="gpu-health", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 1.0) -> None:
        """Stop the thread and wait for it (an event wait returns within half a second)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout)
        for caller in list(self._callers.values()):  # the thread may still add one if it did not stop in time
            caller.close()
        if self._round is not None:
            self._round.close()

    # -- state changes -------------------------------------------------------------------------

    def _mark_bad(self, index: int, reason: str) -> None:
        now = self._clock()
        with self._lock:
            self._last_bad[index] = now
            old = self._state[index]
            if not old.healthy:
                causes = self._causes.setdefault(index, {old.reason})
                if reason in causes or len(causes) >= CAUSES_LOGGED:
                    return
                causes.add(reason)
            else:
                new = HealthState(False, reason, now)
                self._state[index] = new
                self._causes[index] = {reason}
        if not old.healthy:
            log.warning("%s: %s as well (out of service since: %s)", self.gpu_name(index), reason, old.reason)
            return
        self._notify(index, new)  # the kubelet first: the log line can wait
        log.warning("%s is unhealthy: %s", self.gpu_name(index), reason)

    def _mark_ok(self, index: int) -> None:
        now = self._clock()
        with self._lock:
            old = self._state[index]
            if old.healthy or now - self._last_bad.get(index, -1e18) < self._quiet:
                return
            new = HealthState(True, "", now)
            self._state[index] = new
            quiet_for = now - self._last_bad.get(index, old.since)
            if self._xid_out.pop(index, None) is not None:
                self._save_due = True
        self._notify(index, new)  # the kubelet first: the log line can wait
        log.info(
            "%s is healthy again after %.0f s without errors (was: %s)", self.gpu_name(index), quiet_for, old.reason
        )

    def _notify(self, index: int, state: HealthState) -> None:
        for listener in self._listeners:
            try:
                listener(index, state)
            except Exception:
                log.exception("health listener failed for GPU %d", index)

    # -- the loop --------------------------------------------------------------------------------

    def _register_events(self) -> Any:
        """A new event set with every GPU that has a handle registered, or None (logged, at the first
        attempt only: later ones are retries). GPUs that could not be registered are reported and
        registered again at each probe."""
        level = logging.WARNING if self._event_attempts == 0 else logging.DEBUG
        self._event_attempts += 1
        try:
            event_set = pynvml.nvmlEventSetCreate()
        except pynvml.NVMLError as exc:
            log.log(level, "XID events unavailable (nvmlEventSetCreate: %s); only probing GPUs", exc)
            if exc.value not in (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND):
                self._create_problem = (
                    f"XID events are not watched: nvmlEventSetCreate failed ({exc}); GPUs are only probed"
                )
                self._publish_event_problem()
            return None
        if self._create_problem:
            self._create_problem = ""
            self._publish_event_problem()
        self._registered = set()
        failed = self._register_unregistered(event_set)
        registered = len(self._registered)
        log.log(
            logging.INFO if level == logging.WARNING or registered else logging.DEBUG,
            "watching XID events on %d of %d GPUs (ignored XIDs: %s)",
            registered,
            len(self._handles),
            ",".join(map(str, sorted(self._ignored))) or "none",
        )
        if registered == 0:
            self._free(event_set)
            if failed:  # errors, not GPUs without XID events: reported as when some GPUs fail
                self._set_register_problem(failed, retry="making the event set again with backoff")
            return None
        self._set_register_problem(failed)
        return event_set

    def _register_unregistered(self, event_set: Any) -> dict[int, str]:
        """Register in ``event_set`` every GPU with a handle not yet in it; why each failure failed (a
        GPU whose NVML does not support XID events is logged once and left out)."""
        failed: dict[int, str] = {}
        for index, handle in sorted(self._handles.items()):
            if index in self._registered or index in self._unsupported or index in self._hung:
                continue  # a GPU whose NVML call hangs is registered once it answers again
            late = self._late_registrations.get(index)
            if late is not None:
                if not late[0].done():
                    continue
                del self._late_registrations[index]
                if late[1] is event_set and late[0].exception() is None:
                    self._registered.add(index)  # by the call that hung, once it returned
                    continue
            # Through the GPU's own thread, given NVML_CALL_TIMEOUT: a GPU that hangs after the probe that
            # found it answering must not stop the watch of the others' XIDs and their probes.
            register = functools.partial(
                pynvml.nvmlDeviceRegisterEvents, handle, pynvml.nvmlEventTypeXidCriticalError, event_set
            )
            try:
                self._call(index, register)
            except _Hung:
                self._late_registrations[index] = (self._hung[index], event_set)
                self._not_answering(index)
                continue
            except pynvml.NVMLError as exc:
                if exc.value == pynvml.NVML_ERROR_NOT_SUPPORTED:
                    self._unsupported.add(index)
                    log.warning("%s: XID events not available (%s); only probing it", self.gpu_name(index), exc)
                else:
                    failed[index] = str(exc)
                continue
            self._registered.add(index)
        return failed

    def _set_register_problem(self, failed: dict[int, str], retry: str = "registering again at each probe") -> None:
        """GPUs left out of the event set (logged at most once a minute, reported until all are in)."""
        if failed:
            gpus = ", ".join(f"{self.gpu_name(index)}: {why}" for index, why in sorted(failed.items()))
            problem = f"XID events are not watched on {gpus} (nvmlDeviceRegisterEvents failed); only probing"
            now = self._clock()
            if now - self._register_logged_at >= LOG_PERIOD:
                self._register_logged_at = now
                log.warning("%s; %s", problem, retry)
        else:
            problem = ""
            if self._register_problem:
                self._register_logged_at = -1e18
                log.info("XID events are watched on every GPU again")
        self._register_problem = problem
        self._publish_event_problem()

    def _publish_event_problem(self) -> None:
        problem = "; ".join(p for p in (self._create_problem, self._wait_problem, self._register_problem) if p)
        if problem != self._event_problem:
            self._event_problem = problem
            if self._report is not None:
                self._report(XID_EVENTS, problem or None)

    def _free(self, event_set: Any) -> None:
        if any(s is event_set and not f.done() for f, s in self._late_registrations.values()):
            # A registration in it that hung may still write to it: left allocated (a few bytes) instead.
            log.debug("an event set a hung GPU's registration may still use is not freed")
            return
        try:
            pynvml.nvmlEventSetFree(event_set)
        except pynvml.NVMLError as exc:
            log.debug("nvmlEventSetFree: %s", exc)

    def _ensure_events(self) -> None:
        """Make the event set when there is none and some GPU has a handle: at the start, when the first
        GPU answers on a node whose GPUs were all lost at start, and again (with backoff) after the
        set failed or could not be made."""
        if self._event_set is not None or not self._handles or self._clock() < self._event_retry_at:
            return
        self._event_set = self._register_events()
        if self._event_set is None:
            self._retry_events_later()

    def _retry_events_later(self) -> float:
        self._event_backoff = min(EVENT_SET_RETRY_MAX, max(EVENT_SET_RETRY_FIRST, self._event_backoff * 2))
        self._event_retry_at = self._clock() + self._event_backoff
        return self._event_backoff

    def _wait_failed(self, exc: pynvml.NVMLError) -> None:
        """An event wait failed (not a timeout, not a lost GPU): after a few in a row the set is freed and
        made again with backoff; the problem is logged at most once a minute and reported."""
        self._wait_failures += 1
        if self._wait_failures < EVENT_WAIT_FAILURES_BEFORE_RESET:
            return
        self._wait_failures = 0
        event_set, self._event_set = self._event_set, None
        if event_set is not None:
            self._free(event_set)
        self._registered = set()
        self._register_problem = ""  # the set is gone: the GPUs left out of it are made up again with it
        delay = self._retry_events_later()
        problem = f"XID events are not watched: nvmlEventSetWait keeps failing ({exc}); GPUs are only probed"
        now = self._clock()
        if now - self._wait_logged_at >= LOG_PERIOD:
            self._wait_logged_at = now
            log.warning("%s; making the event set again in %.0f s", problem, delay)
        self._wait_problem = problem
        self._publish_event_problem()

    def _wait_ok(self) -> None:
        """An event wait answered (an event or a timeout): the event set works."""
        self._wait_failures = 0
        if self._wait_problem:
            self._wait_problem = ""
            self._event_backoff = 0.0
            self._wait_logged_at = -1e18
            log.info("XID events are watched again")
            self._publish_event_problem()

    def event_problem(self) -> str:
        """Why XID events are not watched on some or all GPUs: the event set cannot be made, its waits keep
        failing, or GPUs could not be registered in it ('' while they are watched, and where NVML has no
        XID events)."""
        return self._event_problem

    def _handle_event(self, data: pynvml.c_nvmlEventData_t) -> None:
        xid = int(data.eventData)
        index = self._event_gpu(data.device)
        self.xid_events += 1
        if xid in self._ignored:
            self.ignored_xid_events += 1
            self._log_ignored(index, xid)
            return
        self.critical_xid_events += 1
        if index is not None:
            self._xid_seen(index, f"XID {xid}")
            self._mark_bad(index, f"XID {xid}")
            return
        # A critical error of a GPU that cannot be named is not dropped: every GPU is suspect.
        now = self._clock()
        if now - self._unknown_logged_at >= LOG_PERIOD:
            self._unknown_logged_at = now
            log.error(
                "XID %d from an unknown GPU (NVML names no GPU of this node for the event's device); "
                "taking every GPU out of service",
                xid,
            )
        for i in list(self._handles):
            self._xid_seen(i, f"XID {xid}")
            self._mark_bad(i, f"XID {xid}")  # the same cause (and DRA taint value) as a named GPU's

    def _event_gpu(self, device: Any) -> int | None:
        """The index of the GPU an event's device handle is: the handle as looked up, else the GPU NVML
        names for it (by UUID, then by NVML's index of the agent's GPUs); None when NVML names none of
        this node's GPUs."""
        key = _handle_key(device)
        if key is not None and key in self._by_handle:
            return self._by_handle[key]
        index: int | None = None
        try:
            uuid = pynvml.nvmlDeviceGetUUID(device)
            uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
            index = next((i for i, u in self._uuids.items() if u == uuid), None)
        except pynvml.NVMLError as exc:
            log.debug("nvmlDeviceGetUUID of an event's device: %s", exc)
        if index is None:
            try:
                found = int(pynvml.nvmlDeviceGetIndex(device))
                # NVML's index now; the agent's GPU (its place) differs once NVML numbers the GPUs otherwise.
                index = next((i for i in sorted(self._uuids) if nvml.nvml_index(i) == found), None)
            except pynvml.NVMLError as exc:
                log.debug("nvmlDeviceGetIndex of an event's device: %s", exc)
        if index is not None and key is not None:
            self._by_handle[key] = index
        return index

    def _log_ignored(self, index: int | None, xid: int) -> None:
        """One line for the first ignored XID of a GPU and kind, then at most one a minute with a count."""
        now = self._clock()
        last, count = self._ignored_seen.get((index, xid), (-1e18, 0))
        if now - last < LOG_PERIOD:
            self._ignored_seen[(index, xid)] = (last, count + 1)
            return
        self._ignored_seen[(index, xid)] = (now, 0)
        name = self.gpu_name(index)
        if count:
            log.info("%s: XID %d ignored %d more times in the last %.0f s", name, xid, count + 1, now - last)
        else:
            log.info("%s: XID %d ignored (application error, not a GPU fault)", name, xid)

    def _flush_ignored(self) -> None:
        """The counts of ignored XIDs whose minute has passed, one line each."""
        now = self._clock()
        for key, (last, count) in list(self._ignored_seen.items()):
            if count and now - last >= LOG_PERIOD:
                self._ignored_seen[key] = (now, 0)
                log.info(
                    "%s: XID %d ignored %d more times in the last %.0f s",
                    self.gpu_name(key[0]),
                    key[1],
                    count,
                    now - last,
                )
            elif not count and now - last >= LOG_PERIOD:
                del self._ignored_seen[key]

    def _submit(self, index: int, call: Callable[[], Any]) -> Future[Any]:
        """Start ``call`` in GPU ``index``'s thread; raises _Hung while an earlier call on it has not
        returned (the GPU is not asked again before)."""
        self._check_answering(index)
        caller = self._callers.get(index)
        if caller is None:
            caller = self._callers[index] = _GpuCaller(f"gpu-health-{index}")
        return caller.submit(call)

    def _check_answering(self, index: int) -> None:
        """Raises _Hung while a call on GPU ``index`` that did not return in time still has not."""
        hung = self._hung.get(index)
        if hung is not None:
            if not hung.done():
                raise _Hung
            del self._hung[index]
            log.info("%s: NVML answers again (the call that hung returned)", self.gpu_name(index))

    def _answer(self, index: int, future: Future[Any], deadline: float) -> Any:
        """The answer of a call started by _submit, waited for until ``deadline`` (time.monotonic());
        raises its NVMLError, or _Hung when it has not returned by then."""
        try:
            return future.result(timeout=max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            self._hung[index] = future
            raise _Hung from None

    def _call(self, index: int, call: Callable[[], Any]) -> Any:
        """``call()`` on GPU ``index``, given NVML_CALL_TIMEOUT to answer (raises _Hung otherwise)."""
        return self._answer(index, self._submit(index, call), time.monotonic() + NVML_CALL_TIMEOUT)

    def _probed_or_call(self, index: int, key: str, call: Callable[[], Any]) -> Any:
        """The answer this probe already has for ``key`` on GPU ``index`` (taken once: raised when it was an
        NVMLError), else ``call()`` made now as :meth:`_call` makes it."""
        answers = self._probed.get(index)
        if answers is not None and key in answers:
            answer = answers.pop(key)
            if isinstance(answer, pynvml.NVMLError):
                raise answer
            return answer
        return self._call(index, call)

    def _not_answering(self, index: int) -> None:
        self._mark_bad(index, NOT_ANSWERING)

    def _take_handle(self, index: int) -> bool:
        """Look up GPU ``index``'s handle (False, and the GPU marked bad, when NVML gives none)."""
        try:
            handle = self._call(index, lambda: nvml.handle(index))
        except _Hung:
            self._missing.add(index)
            self._not_answering(index)
            return False
        except pynvml.NVMLError as exc:
            if index not in self._missing:
                log.error("%s: NVML gives no handle (%s); Unhealthy until it does", self.gpu_name(index), exc)
            self._missing.add(index)
            if exc.value == pynvml.NVML_ERROR_GPU_IS_LOST:
                self._last_answer = self._clock()
            self._mark_bad(index, "lost" if exc.value == pynvml.NVML_ERROR_GPU_IS_LOST else str(exc))
            return False
        self._missing.discard(index)
        self._handles[index] = handle
        key = _handle_key(handle)
        if key is not None:
            self._by_handle[key] = index
        return True

    def _probe(self, take_missing: bool = True) -> None:
        for index in sorted(self._missing) if take_missing else ():
            self._take_handle(index)
        if self._event_set is not None and self._registered | self._unsupported != set(self._handles):
            # GPUs back from lost, and those whose registration failed when the set was made
            self._set_register_problem(self._register_unregistered(self._event_set))
        # One thread asks every GPU in turn (one hand-over a probe). When a GPU's call hangs there, the
        # GPUs after it are asked at once each in its own thread, so GPUs that hang together cost two
        # timeouts at most, and the round's thread, stuck, is replaced.
        asked: dict[int, Future[Any] | None] = {}
        calls: dict[int, Callable[[], Any]] = {}
        for index, handle in list(self._handles.items()):
            try:
                self._check_answering(index)
            except _Hung:
                asked[index] = None
                continue
            calls[index] = functools.partial(
                _probe_calls, handle, index not in self._no_mig, index not in self._no_compute_mode
            )
            asked[index] = Future()
        batch = [(future, calls[index]) for index, future in asked.items() if future is not None]
        if batch:
            if self._round is None:
                self._round = _GpuCaller("gpu-health-probe")
            self._round.submit_all(batch)
        deadline = time.monotonic() + NVML_CALL_TIMEOUT
        in_round = True  # the futures still waited for are the round thread's
        for index in list(asked):
            handle = self._handles[index]
            future = asked[index]
            try:
                if future is None:
                    raise _Hung
                try:
                    answers = self._answer(index, future, deadline)
                except _Hung:
                    if in_round:
                        in_round = False
                        deadline = self._after_round_hung(asked, calls)
                    raise
                self._probed[index] = answers
                self._probe_answered(index, handle)
            except _Hung:
                self._not_answering(index)
            except pynvml.NVMLError as exc:
                if exc.value == pynvml.NVML_ERROR_GPU_IS_LOST:
                    self._last_answer = self._clock()  # NVML answers: the GPU is gone, not the driver
                self._mark_bad(index, "lost" if exc.value == pynvml.NVML_ERROR_GPU_IS_LOST else str(exc))
        self._probed.clear()

    def _after_round_hung(self, asked: dict[int, Future[Any] | None], calls: dict[int, Callable[[], Any]]) -> float:
        """A call in the probe's round thread hung: the GPUs it had not come to are asked each in its own
        thread instead (``asked`` updated), the stuck thread is let go, and the new deadline returned."""
        if self._round is not None:
            self._round.close()  # ends once the hung call returns; the calls cancelled here are skipped
            self._round = None
        for index, future in asked.items():
            if future is not None and future.cancel():
                try:
                    asked[index] = self._submit(index, calls[index])
                except _Hung:
                    asked[index] = None
        return time.monotonic() + NVML_CALL_TIMEOUT

    def _probe_answered(self, index: int, handle: object) -> None:
        """GPU ``index`` answered the probe: its UUID (lost at start), MIG mode and pending reset are
        checked, and it is back once its quiet period has passed (raises _Hung when one of these hangs)."""
        self._last_answer = self._clock()
        if index in self._unnamed:
            self._learn_uuid(index, handle)
            if index in self._unnamed:
                return  # not offered while it is known only by a guess (its UUID goes to containers)
        if self._mig_enabled(index, handle):
            # CUDA runs only in the MIG instances of such a GPU: a share of the whole GPU cannot be used.
            if self.state(index).healthy:
                log.warning(
                    "%s is in MIG mode: CUDA runs only in its MIG instances, so its shares cannot be used; "
                    "Unhealthy until MIG is disabled (nvidia-smi -i %s -mig 0)",
                    self.gpu_name(index),
                    self._uuids.get(index, index),
                )
            self._mark_bad(index, MIG_ENABLED)
            return
        mode = self._unshareable_mode(index, handle)
        if mode is not None:
            name, why = mode
            if self.state(index).healthy:
                log.warning(
                    "%s is in compute mode %s: %s, so containers given it would be refused theirs; "
                    "Unhealthy until it is DEFAULT again (nvidia-smi -i %s -c DEFAULT)",
                    self.gpu_name(index),
                    name,
                    why,
                    self._uuids.get(index, index),
                )
            self._mark_bad(index, f"compute mode {name}")
            return
        if self._due_back(index):
            waiting = self._reset_pending(index, handle)
            if waiting:
                self._keep_out(index, waiting)
                return
        self._mark_ok(index)

    def _due_back(self, index: int) -> bool:
        """Whether GPU ``index`` is out of service and its quiet period has passed."""
        with self._lock:
            out = not self._state[index].healthy
            return out and self._clock() - self._last_bad.get(index, -1e18) >= self._quiet

    def _reset_pending(self, index: int, handle: object) -> str:
        """Why the GPU's memory is not to be used before a GPU reset ('' when NVML shows nothing pending, or
        cannot tell): rows to remap or pages to retire after an uncorrectable ECC error, a failed remapping."""
        try:
            _corrected, _uncorrected, pending, failed = self._call(
                index, lambda: pynvml.nvmlDeviceGetRemappedRows(handle)
            )
        except pynvml.NVMLError:
            pass  # GPUs before Ampere have no row remapping
        else:
            if failed:
                return "row remapping failed: the GPU needs service"
            if pending:
                return "memory rows wait to be remapped at the next GPU reset"
        try:
            pending_pages = self._call(index, lambda: pynvml.nvmlDeviceGetRetiredPagesPendingStatus(handle))
            if pending_pages == pynvml.NVML_FEATURE_ENABLED:
                return "retired memory pages wait for the next GPU reset"
        except pynvml.NVMLError:
            pass  # not supported (Ampere and later remap rows instead)
        return ""

    def _keep_out(self, index: int, why: str) -> None:
        """A GPU whose quiet period passed stays out of service (said once per cause); the quiet period is
        not restarted, so it is back at the first probe after the reset."""
        with self._lock:
            causes = self._causes.setdefault(index, {self._state[index].reason})
            if why in causes or len(causes) >= CAUSES_LOGGED:
                return
            causes.add(why)
        log.warning("%s stays out of service: %s", self.gpu_name(index), why)

    def _learn_uuid(self, index: int, handle: object) -> None:
        """A GPU lost at start answers: from now on its log lines name the UUID NVML gives (until NVML gives
        one it stays out of service, said once)."""
        try:
            uuid = self._call(index, lambda: pynvml.nvmlDeviceGetUUID(handle))
        except pynvml.NVMLError as exc:
            self._keep_out(index, f"NVML gives no UUID for it ({exc})")
            return
        self._unnamed.discard(index)
        self._uuids[index] = uuid.decode() if isinstance(uuid, bytes) else str(uuid)

    def _mig_enabled(self, index: int, handle: object) -> bool:
        """Whether GPU ``index`` is in MIG mode now (a GPU without MIG is not asked again)."""
        if index in self._no_mig:
            return False
        try:
            current = self._probed_or_call(index, "mig", lambda: pynvml.nvmlDeviceGetMigMode(handle))[0]
        except pynvml.NVMLError as exc:
            if exc.value in (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND):
                self._no_mig.add(index)
            else:
                log.debug("%s: nvmlDeviceGetMigMode: %s", self.gpu_name(index), exc)
            return False
        return bool(int(current) == pynvml.NVML_DEVICE_MIG_ENABLE)

    # -- across a restart --------------------------------------------------------------------------

    def _xid_seen(self, index: int, reason: str) -> None:
        """A critical XID on GPU ``index``: kept for the saved file (written at once when it takes the GPU
        out, else within SAVE_PERIOD)."""
        if self._saved is None:
            return
        if index not in self._xid_out:
            self._save_due = True
        self._xid_out[index] = (self._xid_out.get(index, (reason, 0.0))[0], self._wall())

    def _save_if_due(self) -> None:
        """Write the saved file when a GPU went out or came back, or SAVE_PERIOD after later XIDs."""
        if self._saved is None:
            return
        now = self._clock()
        if not self._save_due and now - self._saved_at < SAVE_PERIOD:
            return
        content = _saved_bytes({self._uuids.get(i, str(i)): entry for i, entry in self._xid_out.items()})
        self._save_due = False
        self._saved_at = now
        if content == self._saved_content:
            return
        try:
            atomic_write(self._saved, content)
        except OSError as exc:
            if now - self._save_logged_at >= LOG_PERIOD:
                self._save_logged_at = now
                log.warning(
                    "cannot write %s (%s): a restart would offer GPUs out of service for an XID at once",
                    self._saved,
                    exc,
                )
            return
        self._saved_content = content

    def _restore(self, path: Path) -> None:
        """GPUs whose last critical XID (saved by the agent before this one) is within the quiet period start
        out of service with that XID's reason, and come back when the quiet period ends."""
        try:
            data = json.loads(read_regular(path, _SAVED_LIMIT))
            entries = {
                str(uuid): (str(e["reason"]), _saved_time(e["last_xid_unix"])) for uuid, e in dict(data["gpus"]).items()
            }
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError, AttributeError, OverflowError) as exc:
            log.warning("ignoring %s: %s", path, str(exc)[:200])
            return
        except RecursionError:
            log.warning("ignoring %s: its JSON is nested too deeply to read", path)
            return
        now, wall = self._clock(), self._wall()
        for g in self._gpus:
            entry = entries.get(g.uuid)
            if entry is None:
                continue
            reason, at = entry
            age = max(0.0, wall - at)
            if age >= self._quiet:
                continue
            self._xid_out[g.index] = (reason, at)
            self._last_bad[g.index] = max(self._last_bad.get(g.index, -1e18), now - age)
            old = self._state[g.index]
            if old.healthy:
                self._state[g.index] = HealthState(False, reason, now)
                self._causes[g.index] = {reason}
            else:
                self._causes.setdefault(g.index, {old.reason}).add(reason)
            log.warning(
                "%s stays out of service after the restart: %s %.0f s ago (back after %.0f s without errors)",
                self.gpu_name(g.index),
                reason,
                age,
                self._quiet,
            )
        if entries:  # written again at the first pass: without the entries that expired
            self._saved_content = b""
            self._save_due = True

    def _unshareable_mode(self, index: int, handle: object) -> tuple[str, str] | None:
        """The name of GPU ``index``'s compute mode and why it cannot be shared, None in DEFAULT mode (or
        when NVML does not tell: a GPU whose NVML has no compute mode is not asked again)."""
        if index in self._no_compute_mode:
            return None
        try:
            mode = int(self._probed_or_call(index, "mode", lambda: pynvml.nvmlDeviceGetComputeMode(handle)))
        except pynvml.NVMLError as exc:
            if exc.value in (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND):
                self._no_compute_mode.add(index)
            else:
                log.debug("%s: nvmlDeviceGetComputeMode: %s", self.gpu_name(index), exc)
            return None
        if mode != pynvml.NVML_COMPUTEMODE_PROHIBITED and not self._shares:
            return None
        return UNSHAREABLE_COMPUTE_MODES.get(mode)

    def _run(self) -> None:
        next_probe = 0.0
        try:
            while not self._stop.is_set():
                try:
                    self._ensure_events()
                    next_probe = self._step(next_probe)
                except Exception:
                    # Keep watching: one bad NVML answer must not end health checking.
                    log.exception("GPU health check failed; retrying in 1 s")
                    self._stop.wait(1.0)
        finally:
            event_set, self._event_set = self._event_set, None
            if event_set is not None:
                self._free(event_set)

    def _step(self, next_probe: float) -> float:
        now = self._clock()
        if now >= next_probe:
            self._probe()
            self._flush_ignored()
            next_probe = now + self._probe_period
        self._save_if_due()
        wait_ms = max(1, int(min(self._probe_period, 0.5) * 1000))
        event_set = self._event_set
        if event_set is None:
            self._stop.wait(wait_ms / 1000)
            return next_probe
        asked_at = time.monotonic()
        try:
            data = pynvml.nvmlEventSetWait_v2(event_set, wait_ms)
        except pynvml.NVMLError as exc:
            if exc.value == pynvml.NVML_ERROR_TIMEOUT:
                self._wait_said_lost = False
                self._wait_ok()
                # A driver whose wait answers TIMEOUT before the time asked would have this loop spin a core.
                early = wait_ms / 1000 - (time.monotonic() - asked_at)
                if early > 0.01:
                    self._stop.wait(early)
                return next_probe
            if exc.value == pynvml.NVML_ERROR_GPU_IS_LOST:
                # Some registered GPU is lost, and the wait says so at once for as long as it stays lost:
                # one probe now finds it; later losses are found by the periodic probe.
                if not self._wait_said_lost:
                    self._wait_said_lost = True
                    next_probe = 0.0
                self._stop.wait(wait_ms / 1000)
                return next_probe
            self._wait_failed(exc)
            self._stop.wait(0.05)
            return next_probe
        self._wait_ok()
        self._handle_event(data)
        return next_probe
