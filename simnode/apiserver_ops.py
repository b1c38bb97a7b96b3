"""The API operations of the simulator (list, watch, get, create, update, patch, delete, bind).

They take decoded request parts (resource kind, namespace, name, query, body) and answer JSON
objects or raise :class:`~simnode.apiserver_errors.ApiError`; the HTTP layer
(:mod:`simnode.apiserver_http`) does the transport.
"""

from __future__ import annotations

import base64
import binascii
import copy
import json
import logging
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from simnode.apiserver_errors import ApiError, bad_request, conflict, invalid, success_status
from simnode.apiserver_objects import (
    NODES,
    PODS,
    TERMINAL_PHASES,
    ResourceKind,
    check_shape,
    ensure_api_error,
    generated_name,
    meta,
    new_uid,
    now_rfc3339,
    raise_if_name_mismatch,
)
from simnode.apiserver_patch import PatchError, json_patch, merge_patch, strategic_merge_patch
from simnode.apiserver_selectors import (
    FieldSelector,
    LabelSelector,
    parse_field_selector,
    parse_label_selector,
)
from simnode.apiserver_store import Key, Store, Watcher

log = logging.getLogger(__name__)

JSON = dict[str, Any]
Query = Mapping[str, str]

PATCH_STRATEGIC = "application/strategic-merge-patch+json"
PATCH_MERGE = "application/merge-patch+json"
PATCH_JSON = "application/json-patch+json"
PATCH_TYPES = (PATCH_JSON, PATCH_MERGE, PATCH_STRATEGIC)

_TRUE = ("1", "t", "T", "TRUE", "true", "True")
_FALSE = ("0", "f", "F", "FALSE", "false", "False")


def parse_bool(query: Query, name: str) -> bool:
    """A boolean query parameter as Go's ``strconv.ParseBool`` reads it (400 when malformed)."""
    raw = query.get(name)
    if raw is None or raw == "":
        return False
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise bad_request(f'strconv.ParseBool: parsing "{raw}": invalid syntax (query parameter {name})')


def parse_int(query: Query, name: str) -> int | None:
    """An integer query parameter (400 when malformed)."""
    raw = query.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise bad_request(f'strconv.ParseInt: parsing "{raw}": invalid syntax (query parameter {name})') from None


def parse_rv(raw: str, what: str = "resourceVersion") -> int:
    """A resourceVersion string (400 when not a non-negative integer)."""
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise bad_request(f'{what}: Invalid value: "{raw}": must be a non-negative integer')
    return value


def _dry_run(query: Query) -> bool:
    raw = query.get("dryRun")
    if not raw:
        return False
    if raw != "All":
        raise bad_request(f'dryRun: Unsupported value: "{raw}": supported values: "All"')
    return True


def encode_continue(rv: int, key: Key) -> str:
    """A ``continue`` token: the resourceVersion of the first page and the last key returned."""
    start = f"{key[0]}/{key[1]}\x00" if key[0] else f"{key[1]}\x00"
    raw = json.dumps({"v": "meta.k8s.io/v1", "rv": rv, "start": start}, separators=(",", ":"))
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def decode_continue(token: str) -> tuple[int, Key]:
    """Inverse of :func:`encode_continue` (400 when it is not a valid token)."""
    try:
        padded = token + "=" * (-len(token) % 4)
        data = json.loads(base64.urlsafe_b64decode(padded.encode()))
        rv = int(data["rv"])
        start = str(data["start"]).rstrip("\x00")
        if data.get("v") != "meta.k8s.io/v1" or rv <= 0:
            raise ValueError("bad version")
    except (ValueError, KeyError, TypeError, binascii.Error, json.JSONDecodeError) as exc:
        raise bad_request(f"continue key is not valid: {exc}") from None
    ns, _, name = start.rpartition("/")
    return rv, (ns, name)


#: Seconds a watch from a resourceVersion not reached yet waits for it (the real watch cache's blockTimeout).
TOO_LARGE_WAIT = 3.0


def too_large(wanted: int, current: int) -> ApiError:
    """504 "Too large resource version", as the real server answers a read from a resourceVersion it has
    not reached."""
    return ApiError(
        504,
        f"Too large resource version: {wanted}, current: {current}",
        reason="Timeout",
        details={"causes": [{"reason": "ResourceVersionTooLarge", "message": "Too large resource version"}]},
        retry_after=1,
    )


@dataclass(frozen=True)
class WatchPlan:
    """An opened watch and how its stream behaves."""

    watcher: Watcher | None
    error: ApiError | None
    timeout: float | None
    bookmarks: bool


class Operations:
    """The verbs on pods and nodes, over one :class:`Store`."""

    def __init__(
        self,
        store: Store,
        *,
        graceful_delete: bool = True,
        disabled_features: frozenset[str] = frozenset(),
        min_request_timeout: float = 1800.0,
    ) -> None:
        self.store = store
        self.graceful_delete = graceful_delete
        self.disabled_features = disabled_features
        # A watch without timeoutSeconds ends after min_request_timeout * [1, 2) seconds, as the
        # real server's --min-request-timeout (1800 s) ends it; 0: never.
        self.min_request_timeout = min_request_timeout

    def _drop_disabled(self, kind: ResourceKind, old: JSON | None, new: JSON) -> None:
        if kind.drop_disabled is not None and self.disabled_features:
            kind.drop_disabled(old, new, self.disabled_features)

    # ------------------------------------------------------------------ reading

    def _selectors(self, kind: ResourceKind, query: Query) -> tuple[LabelSelector, FieldSelector]:
        return (
            parse_label_selector(query.get("labelSelector")),
            parse_field_selector(query.get("fieldSelector"), kind.fields),
        )

    def list(self, kind: ResourceKind, namespace: str | None, query: Query) -> JSON:
        """``GET`` on a collection: a ``PodList``/``NodeList``."""
        labels, fields = self._selectors(kind, query)
        limit = parse_int(query, "limit")
        rv_param = query.get("resourceVersion") or None
        match = query.get("resourceVersionMatch") or None
        token = query.get("continue") or None
        at: int | None = None
        after: Key | None = None
        if match is not None and rv_param is None:
            raise bad_request("resourceVersionMatch is forbidden unless resourceVersion is provided")
        if match not in (None, "Exact", "NotOlderThan"):
            raise bad_request(f'resourceVersionMatch: Unsupported value: "{match}"')
        if token is not None:
            if rv_param is not None and rv_param != "0":
                raise bad_request("specifying resource version is not allowed when using continue")
            at, after = decode_continue(token)
            if at < self.store.compacted:
                raise ApiError(
                    410,
                    "The provided continue parameter is too old to display a consistent list result. "
                    "You can start a new list without the continue parameter.",
                )
        elif rv_param is not None:
            wanted = parse_rv(rv_param)
            current = self.store.rv
            if match == "Exact" and wanted == 0:
                raise bad_request('resourceVersionMatch "exact" is forbidden for resourceVersion "0"')
            if wanted > current:
                raise too_large(wanted, current)
            if match == "Exact":
                at = wanted
        result = self.store.list(
            kind, namespace=namespace, labels=labels, fields=fields, at=at, after=after, limit=limit
        )
        for item in result.items:
            item.pop("kind", None)
            item.pop("apiVersion", None)
        list_meta: JSON = {"resourceVersion": str(result.rv)}
        if result.next_key is not None:
            list_meta["continue"] = encode_continue(result.rv, result.next_key)
            if labels.empty and fields.empty:
                list_meta["remainingItemCount"] = result.remaining
        return {"kind": kind.list_kind, "apiVersion": kind.group_version, "metadata": list_meta, "items": result.items}

    def open_watch(self, kind: ResourceKind, namespace: str | None, name: str | None, query: Query) -> WatchPlan:
        """``GET ...?watch=true``: a registered watcher, or the 410 to send as an ERROR event."""
        labels, fields = self._selectors(kind, query)
        timeout = parse_int(query, "timeoutSeconds")
        bookmarks = parse_bool(query, "allowWatchBookmarks")
        send_initial = parse_bool(query, "sendInitialEvents")
        rv_param = query.get("resourceVersion") or None
        if send_initial and (query.get("resourceVersionMatch") != "NotOlderThan" or not bookmarks):
            raise invalid(
                "ListOptions",
                "",
                [
                    (
                        "sendInitialEvents",
                        "FieldValueForbidden",
                        "Forbidden: sendInitialEvents is forbidden for watch unless resourceVersionMatch is "
                        "NotOlderThan and allowWatchBookmarks is true",
                    )
                ],
            )
        initial = send_initial or rv_param in (None, "0")
        since = None if initial or rv_param is None else parse_rv(rv_param)
        if since is not None:
            self._wait_fresh(since)
        try:
            watcher = self.store.watch(
                kind,
                namespace=namespace,
                name=name,
                labels=labels,
                fields=fields,
                since=since,
                initial_events=initial,
                initial_bookmark=send_initial,
            )
        except ApiError as err:
            if err.code != 410:
                raise
            return WatchPlan(None, err, None, bookmarks)
        if timeout and timeout > 0:
            return WatchPlan(watcher, None, float(timeout), bookmarks)
        ends = self.min_request_timeout * (1.0 + random.random()) if self.min_request_timeout > 0 else None
        return WatchPlan(watcher, None, ends, bookmarks)

    def _wait_fresh(self, wanted: int) -> None:
        """A watch from a resourceVersion the server has not reached: as the real watch cache, wait up to
        :data:`TOO_LARGE_WAIT` seconds for it, then answer 504 "Too large resource version" (what a client
        resuming after the server's history went back, an etcd restored from a backup, is told)."""
        deadline = time.monotonic() + TOO_LARGE_WAIT
        while self.store.rv < wanted:
            if time.monotonic() >= deadline:
                raise too_large(wanted, self.store.rv)
            time.sleep(0.05)

    def get(self, kind: ResourceKind, key: Key) -> JSON:
        """``GET`` one object."""
        return self.store.get_or_404(kind, key)

    # ------------------------------------------------------------------ writing

    def create(
        self, kind: ResourceKind, namespace: str | None, body: Any, query: Query, *, from_api: bool = True
    ) -> JSON:
        """``POST`` on a collection (``from_api=False``: the direct helpers, which keep a given uid/status)."""
        obj = copy.deepcopy(check_shape(body, kind.kind, kind.group_version))
        md = meta(obj)
        if kind.namespaced:
            body_ns = md.get("namespace")
            if namespace is not None and body_ns and body_ns != namespace:
                raise bad_request(
                    "the namespace of the provided object does not match the namespace sent on the request"
                )
            md["namespace"] = namespace or body_ns or "default"
        else:
            md.pop("namespace", None)
        if not md.get("name") and md.get("generateName"):
            md["name"] = generated_name(str(md["generateName"]))
        if md.get("resourceVersion"):
            if from_api:
                raise ApiError(500, "resourceVersion should not be set on objects to be created")
            md.pop("resourceVersion")
        if from_api or not md.get("uid"):
            md["uid"] = new_uid()
        md["creationTimestamp"] = now_rfc3339()
        for system in ("deletionTimestamp", "deletionGracePeriodSeconds", "managedFields"):
            md.pop(system, None)
        kind.prepare_create(obj, from_api=from_api)
        self._drop_disabled(kind, None, obj)
        kind.validate(obj)
        return self.store.create(kind, obj, dry_run=_dry_run(query))

    def replace(self, kind: ResourceKind, key: Key, body: Any, query: Query, *, status: bool = False) -> JSON:
        """``PUT`` on an object or its ``/status``."""
        new = copy.deepcopy(check_shape(body, kind.kind, kind.group_version))
        raise_if_name_mismatch(new, key[1], key[0] if kind.namespaced else None)
        if not kind.namespaced:
            meta(new).pop("namespace", None)
        prepare = kind.prepare_status_update if status else kind.prepare_update

        def mutate(current: JSON) -> JSON:
            prepare(current, new)
            self._drop_disabled(kind, current, new)
            return new

        return self.store.update(kind, key, mutate, dry_run=_dry_run(query))

    def patch(
        self,
        kind: ResourceKind,
        key: Key,
        raw: bytes,
        content_type: str,
        query: Query,
        *,
        status: bool = False,
    ) -> JSON:
        """``PATCH`` on an object or its ``/status`` with one of :data:`PATCH_TYPES`."""
        ctype = content_type.split(";", 1)[0].strip().lower()
        if ctype not in PATCH_TYPES:
            raise ApiError(
                415,
                f"the body of the request was in an unknown format - accepted media types include: "
                f"{', '.join(PATCH_TYPES)}",
            )
        try:
            patch = json.loads(raw or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise bad_request(f"error decoding patch: {exc}") from None
        prepare = kind.prepare_status_update if status else kind.prepare_update

        def mutate(current: JSON) -> JSON:
            try:
                if ctype == PATCH_JSON:
                    patched = json_patch(current, patch)
                elif ctype == PATCH_MERGE:
                    if not isinstance(patch, dict):
                        raise PatchError("merge patch must be a JSON object", decode=True)
                    patched = merge_patch(current, patch)
                else:
                    patched = strategic_merge_patch(current, patch, kind.merge_keys)
            except PatchError as exc:
                raise ApiError(400 if exc.decode else 422, str(exc)) from None
            patched = check_shape(patched, kind.kind, kind.group_version)
            raise_if_name_mismatch(patched, key[1], key[0] if kind.namespaced else None)
            if not kind.namespaced:
                meta(patched).pop("namespace", None)
            prepare(current, patched)
            self._drop_disabled(kind, current, patched)
            return patched

        return self.store.update(kind, key, mutate, dry_run=_dry_run(query))

    def _grace(self, kind: ResourceKind, key: Key, options: JSON, query: Query) -> int:
        explicit = parse_int(query, "gracePeriodSeconds")
        if explicit is None and isinstance(options.get("gracePeriodSeconds"), int):
            explicit = int(options["gracePeriodSeconds"])
        if kind is not PODS or not self.graceful_delete:
            return 0
        pod = self.store.get_or_404(kind, key)
        spec = pod.get("spec") or {}
        if not spec.get("nodeName") or (pod.get("status") or {}).get("phase") in TERMINAL_PHASES:
            return 0
        grace = explicit if explicit is not None else spec.get("terminationGracePeriodSeconds", 30)
        return max(int(grace), 0)

    def delete(self, kind: ResourceKind, key: Key, body: Any, query: Query) -> JSON:
        """``DELETE`` one object: pods answer the object, nodes a ``Status``."""
        options = body if isinstance(body, dict) else {}
        preconditions = options.get("preconditions")
        grace = self._grace(kind, key, options, query)
        obj, _deleted = self.store.delete(
            kind,
            key,
            grace_seconds=grace,
            preconditions=preconditions if isinstance(preconditions, dict) else None,
            dry_run=_dry_run(query) or options.get("dryRun") == ["All"],
        )
        if kind is not NODES:
            return obj  # pods and resource.k8s.io objects answer the object; nodes a Status
        return success_status({"name": key[1], "kind": kind.resource, "uid": meta(obj).get("uid")})

    def delete_collection(self, kind: ResourceKind, namespace: str | None, body: Any, query: Query) -> JSON:
        """``DELETE`` on a collection: deletes what the selectors match, answers the deleted list."""
        listed = self.list(kind, namespace, {k: v for k, v in query.items() if k in ("labelSelector", "fieldSelector")})
        deleted: list[JSON] = []
        for item in listed["items"]:
            key = (str(meta(item).get("namespace") or ""), str(meta(item).get("name")))
            try:
                obj = self.delete(kind, key, body, query)
            except ApiError as err:
                if err.code == 404:
                    continue
                raise
            if obj.get("kind") == kind.kind:
                obj.pop("kind", None)
                obj.pop("apiVersion", None)
                deleted.append(obj)
        return {
            "kind": kind.list_kind,
            "apiVersion": kind.group_version,
            "metadata": {"resourceVersion": str(self.store.rv)},
            "items": deleted,
        }

    def bind(self, key: Key, body: Any, query: Query) -> JSON:
        """``POST pods/{name}/binding``: sets ``spec.nodeName`` once (409 when already bound)."""
        if not isinstance(body, dict) or not isinstance(body.get("target"), dict) or not body["target"].get("name"):
            raise invalid("Binding", key[1], [("target.name", "FieldValueRequired", "Required value")])
        node = str(body["target"]["name"])

        def mutate(pod: JSON) -> JSON:
            spec = pod.setdefault("spec", {})
            if spec.get("nodeName"):
                raise conflict("pods/binding", key[1], f'pod {key[1]} is already assigned to node "{spec["nodeName"]}"')
            spec["nodeName"] = node
            status = pod.setdefault("status", {})
            conditions = [c for c in status.get("conditions") or [] if c.get("type") != "PodScheduled"]
            conditions.append(
                {"type": "PodScheduled", "status": "True", "lastProbeTime": None, "lastTransitionTime": now_rfc3339()}
            )
            status["conditions"] = conditions
            return pod

        self.store.update(PODS, key, mutate, dry_run=_dry_run(query))
        return success_status(code=201)


def wrap_error(exc: Exception) -> ApiError:
    """Any exception as the ``ApiError`` to answer with."""
    return ensure_api_error(exc)


__all__ = [
    "NODES",
    "PATCH_JSON",
    "PATCH_MERGE",
    "PATCH_STRATEGIC",
    "PATCH_TYPES",
    "PODS",
    "Operations",
    "WatchPlan",
    "decode_continue",
    "encode_continue",
    "parse_bool",
    "parse_int",
    "wrap_error",
]
