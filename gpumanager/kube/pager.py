"""Lists asked for in pages (``limit`` and ``continue``), as client-go's pager asks for them.

One unpaginated list of a large cluster (100,000 pods) is one answer of hundreds of megabytes that
may take longer than any request timeout, so it never completes and the lister never becomes
ready. Here each page of :data:`LIST_PAGE_SIZE` objects is one request with its own timeout, and the
pages are joined into one list: a caller replaces its state only once every page is in. The pages
of one list are one snapshot; the server keeps it only until it compacts its history, after which
the next page is answered 410 Gone (its continue token expired), and the list starts again from its
first page. After :data:`EXPIRED_RESTARTS` such restarts in a row one list without a limit is asked
for, as client-go falls back to a full list.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from gpumanager.kube import shape

log = logging.getLogger(__name__)

Obj = dict[str, Any]
#: ``fetch(limit, continue_token)``: one page, the decoded list; ``limit`` None asks for every object.
PageCall = Callable[[int | None, str], Mapping[str, Any] | None]

#: Objects asked for per page (client-go's reflector asks for 500).
LIST_PAGE_SIZE = 500
#: Lists started again from their first page after a continue token expired, before one list without a limit.
EXPIRED_RESTARTS = 3


def list_pages(
    fetch: PageCall,
    *,
    what: str,
    page_size: int = LIST_PAGE_SIZE,
    keep: Callable[[Obj], bool] | None = None,
) -> tuple[list[Obj], dict[str, Any]]:
    """Every object of a list asked for in pages: (the objects ``keep`` keeps, the last page's metadata).

    The metadata's ``resourceVersion`` is the one to watch from; its ``continue`` is dropped. A 410
    answered to a page with a continue token starts the list again; other errors (and a 410 to a
    first page, which is no expired token) are raised, and the objects of earlier pages dropped.
    """
    expired = 0
    while True:
        limit: int | None = page_size if expired <= EXPIRED_RESTARTS else None
        items: list[Obj] = []
        token = ""
        try:
            while True:
                page = fetch(limit, token) or {}
                for item in page.get("items") or []:
                    if not isinstance(item, dict):  # no real server sends one; it failed the whole list
                        log.warning("%s: an item that is not an object (%s); skipped", what, shape.shown(item))
                        continue
                    obj = dict(item)
                    if keep is None or keep(obj):
                        items.append(obj)
                meta = dict(page.get("metadata") or {})
                token = str(meta.pop("continue", "") or "") if limit is not None else ""
                if not token:
                    return items, meta
        except Exception as exc:  # the client's ApiException, whose module need not be loaded here
            if getattr(exc, "status", None) != 410 or not token:
                raise
            expired += 1
            again = "listing again" if expired <= EXPIRED_RESTARTS else "listing everything at once"
            log.info(
                "%s: a page's continue token expired (%s, %d in a row); %s",
                what,
                getattr(exc, "reason", exc),
                expired,
                again,
            )
