"""The agent's calls to the API server, made through the Kubernetes client's HTTP layer.

The client's typed API classes (``CoreV1Api`` and the like) are not used: since kubernetes 37
each of their methods is wrapped in a pydantic validator and their modules import every model
they name, so loading ``CoreV1Api`` alone takes about 0.8 s of CPU and 21 MiB, more than the
rest of the agent. Nor is ``ApiClient``: its module loads pydantic for a response model the agent
never builds (about 9 MiB). The agent makes a handful of calls with plain JSON in and out; they go
through the client's ``Configuration`` (host, bearer token and its refresh) and its
``RESTClientObject`` (TLS, proxy, the connection pool, retries) and fail with the client's own
``ApiException`` as the typed methods do.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlencode

from gpumanager import __version__, lazy_package
from gpumanager.kube.pager import LIST_PAGE_SIZE, list_pages

if TYPE_CHECKING:
    from kubernetes.client.exceptions import ApiException as ApiException
else:
    ApiException = lazy_package.import_module("kubernetes.client.exceptions").ApiException

#: The Kubernetes client's ``ApiClient``, or anything with its ``configuration`` and ``rest_client``
#: (:class:`gpumanager.kube.client.KubeClient`); the package is untyped.
ApiClient = Any

MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
USER_AGENT = f"gpu-manager/{__version__}"

Timeout = float | tuple[float, float] | None

#: The longest answer read into memory. A page is at most LIST_PAGE_SIZE objects; pods carrying the largest
#: annotations seen (a ``last-applied-configuration`` of a big spec) are tens of KiB each, so a page stays far
#: under it. An answer without end (a broken proxy, a server gone wrong) was read to the agent's memory limit.
MAX_BODY_BYTES = 128 << 20
#: The part of an error answer kept for its message.
MAX_ERROR_BODY_BYTES = 64 << 10
_READ_BYTES = 1 << 20


class AnswerTooLargeError(ValueError):
    """An API server's answer longer than :data:`MAX_BODY_BYTES`."""


def read_body(response: Any, what: str, limit: int | None = None, *, cut: bool = False) -> bytes:
    """The body of a response not read yet, at most ``limit`` bytes (default :data:`MAX_BODY_BYTES`).
    Past it: the first ``limit`` bytes where ``cut``, else :class:`AnswerTooLargeError` naming ``what``.
    Either way the rest is not read and the connection is closed rather than reused."""
    limit = MAX_BODY_BYTES if limit is None else limit
    if not hasattr(response, "stream"):
        inner = getattr(response, "response", None)  # the client's RESTResponse: the urllib3 response it wraps
        if not hasattr(inner, "stream"):  # a body read already (nothing to bound any more)
            data: bytes = response.data
            if len(data) > limit and not cut:
                raise AnswerTooLargeError(f"{what}: the API server's answer is longer than {limit >> 20} MiB")
            return data[:limit]
        response = inner
    parts: list[bytes] = []
    total = 0
    for chunk in response.stream(_READ_BYTES, decode_content=True):
        parts.append(chunk)
        total += len(chunk)
        if total > limit:
            response.close()
            if cut:
                return b"".join(parts)[:limit]
            raise AnswerTooLargeError(
                f"{what}: the API server's answer is longer than {limit >> 20} MiB; not read further"
            )
    response.release_conn()
    return b"".join(parts)


def _query_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


class KubeRest:
    """The few API-server requests the agent makes, on one ``ApiClient``. Thread-safe as the client is."""

    def __init__(self, api: ApiClient) -> None:
        self._config: Any = api.configuration
        self._rest: Any = api.rest_client
        # kubernetes < 37 streams a response only when asked and raises ApiException on an error
        # status itself; 37 always streams and leaves the status to its caller.
        self._legacy = "_preload_content" in inspect.signature(self._rest.request).parameters

    def request(
        self,
        method: str,
        path: str,
        *,
        query: Sequence[tuple[str, object]] = (),
        body: object = None,
        content_type: str | None = None,
        timeout: Timeout = None,
    ) -> Any:
        """Send one request; the ``urllib3`` response, its body not read yet.

        A status outside 2xx raises the client's ``ApiException`` (its subclass for the status),
        with the response body.
        """
        headers = {"Accept": "application/json", "User-Agent": USER_AGENT}
        if content_type is not None:
            headers["Content-Type"] = content_type
        # The bearer token, as ApiClient sends it (the loader's hook refreshes it when asked here).
        for auth in self._config.auth_settings().values():
            if auth["in"] == "header" and auth["value"]:
                headers[auth["key"]] = auth["value"]
        if "authorization" not in headers and "authorization" in self._config.api_key:
            # kubernetes 36's in-cluster loader files the token under a name its own auth_settings()
            # does not read (37 reads both): without this its requests would go out anonymous.
            headers["authorization"] = self._config.get_api_key_with_prefix("authorization")
        url = self._config.host + path
        if query:
            url += "?" + urlencode([(key, _query_value(value)) for key, value in query], quote_via=quote)
        if self._legacy:
            return self._rest.request(
                method, url, headers=headers, body=body, _preload_content=False, _request_timeout=timeout
            )
        response = self._rest.request(method, url, headers=headers, body=body, _request_timeout=timeout)
        if not 200 <= response.status <= 299:
            data = read_body(response, f"{method} {path}", MAX_ERROR_BODY_BYTES, cut=True)
            response.data = data  # what the exception reads
            text = data.decode("utf-8", "replace") if data else None
            raise ApiException.from_response(http_resp=response, body=text, data=None)
        return response.response

    def json(self, method: str, path: str, **kwargs: Any) -> Any:
        """``request`` and the body decoded as JSON (None when empty); ``ValueError`` naming the
        request and the start of the body when it is not JSON."""
        response = self.request(method, path, **kwargs)
        data = read_body(response, f"{method} {path}")
        try:
            return json.loads(data) if data else None
        except ValueError as exc:  # a proxy's HTML page, a truncated answer
            text = data[:200].decode("utf-8", "replace")
            raise ValueError(f"{method} {path}: the answer is not JSON ({exc}): {text!r}") from None

    # -- any resource --------------------------------------------------------------------------------

    def get_object(self, path: str, *, timeout: Timeout) -> Any:
        """``GET`` one object: its JSON."""
        return self.json("GET", path, timeout=timeout)

    def list_objects(self, path: str, *, field_selector: str, timeout: Timeout, page_size: int | None = None) -> Any:
        """``GET`` a collection in pages of ``page_size`` objects (default
        LIST_PAGE_SIZE), each with ``timeout``: the list as JSON, the
        items of every page and the metadata (``resourceVersion``) of the last one. A continue token
        that expired starts the list again (:func:`~gpumanager.kube.pager.list_pages`)."""

        def fetch(limit: int | None, token: str) -> Any:
            query: list[tuple[str, object]] = [("fieldSelector", field_selector)]
            if limit is not None:
                query.append(("limit", limit))
            if token:
                query.append(("continue", token))
            return self.json("GET", path, query=query, timeout=timeout)

        items, meta = list_pages(fetch, what=f"list of {path}", page_size=page_size or LIST_PAGE_SIZE)
        return {"metadata": meta, "items": items}

    def watch_objects(
        self, path: str, *, field_selector: str, resource_version: str, timeout_seconds: int, timeout: Timeout
    ) -> Any:
        """``GET`` a collection with ``watch=true``: the streaming response (one JSON event per line)."""
        query: list[tuple[str, object]] = [
            ("fieldSelector", field_selector),
            ("watch", True),
            ("allowWatchBookmarks", True),
            ("timeoutSeconds", timeout_seconds),
        ]
        if resource_version:
            query.append(("resourceVersion", resource_version))
        return self.request("GET", path, query=query, timeout=timeout)

    def create_object(self, path: str, body: Mapping[str, Any], *, timeout: Timeout) -> Any:
        """``POST`` an object to its collection: the stored object as JSON."""
        return self.json("POST", path, body=body, content_type="application/json", timeout=timeout)

    def replace_object(self, path: str, body: Mapping[str, Any], *, timeout: Timeout) -> Any:
        """``PUT`` an object (its ``resourceVersion`` guards the write): the stored object as JSON."""
        return self.json("PUT", path, body=body, content_type="application/json", timeout=timeout)

    def delete_object(self, path: str, *, timeout: Timeout) -> None:
        """``DELETE`` an object."""
        _finish(self.request("DELETE", path, timeout=timeout))

    # -- pods and nodes ------------------------------------------------------------------------------

    def list_pods(self, *, field_selector: str, timeout: Timeout, page_size: int | None = None) -> Any:
        """``GET /api/v1/pods`` in pages (:meth:`list_objects`): the PodList as JSON."""
        return self.list_objects("/api/v1/pods", field_selector=field_selector, timeout=timeout, page_size=page_size)

    def watch_pods(self, *, field_selector: str, resource_version: str, timeout_seconds: int, timeout: Timeout) -> Any:
        """``GET /api/v1/pods?watch=true``: the streaming response (one JSON event per line)."""
        return self.watch_objects(
            "/api/v1/pods",
            field_selector=field_selector,
            resource_version=resource_version,
            timeout_seconds=timeout_seconds,
            timeout=timeout,
        )

    def read_pod(self, namespace: str, name: str, *, timeout: Timeout) -> Any:
        """``GET`` one pod: its JSON."""
        return self.get_object(pod_path(namespace, name), timeout=timeout)

    def patch_pod(
        self, namespace: str, name: str, body: Mapping[str, Any], *, content_type: str, timeout: Timeout
    ) -> None:
        """``PATCH`` one pod."""
        response = self.request(
            "PATCH",
            pod_path(namespace, name),
            body=body,
            content_type=content_type,
            timeout=timeout,
        )
        _finish(response)

    def delete_pod(self, namespace: str, name: str, body: Mapping[str, Any], *, timeout: Timeout) -> None:
        """``DELETE`` one pod (``body`` is the DeleteOptions)."""
        response = self.request(
            "DELETE",
            pod_path(namespace, name),
            body=body,
            content_type="application/json",
            timeout=timeout,
        )
        _finish(response)

    def patch_node(self, name: str, body: Mapping[str, Any], *, content_type: str, timeout: Timeout) -> None:
        """``PATCH`` one node."""
        response = self.request(
            "PATCH", f"/api/v1/nodes/{segment(name)}", body=body, content_type=content_type, timeout=timeout
        )
        _finish(response)


def _finish(response: Any) -> None:
    """Read the rest of a response whose body is not needed, so that its connection can serve again."""
    response.read()
    response.release_conn()


def pod_path(namespace: str, name: str) -> str:
    """The path of one pod."""
    return f"/api/v1/namespaces/{segment(namespace)}/pods/{segment(name)}"


def segment(value: str) -> str:
    """A name as one URL path segment, quoted as the typed API classes quote it."""
    return quote(value, safe="")
