"""Device IDs in messages: every refusal names the IDs it is about, briefly."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

#: How many IDs a message lists one by one before it summarises the rest.
SHOWN = 6


#: More digits than any device ID's number has (int() refuses more than 4300).
_MAX_DIGITS = 18


def tail_number(tail: str) -> int | None:
    """``tail`` as a device ID's number: ASCII digits (``isdigit()`` also takes ``²``, int() other scripts'
    digits), at most 18 of them; None otherwise."""
    return int(tail) if tail.isascii() and tail.isdigit() and len(tail) <= _MAX_DIGITS else None


def brief(device_id: str) -> str:
    """``repr(device_id)`` for a message, cut short (with its length) past 80 characters."""
    text = repr(device_id)
    return text if len(text) <= 80 else f"{text[:80]}... ({len(device_id)} characters)"


def number(device_id: str) -> int:
    """The trailing number of a fake device ID (-1 when there is none)."""
    found = tail_number(device_id[device_id.rfind("-") + 1 :])
    return -1 if found is None else found


def in_order(device_ids: Iterable[str]) -> tuple[str, ...]:
    """Device IDs of one resource in the order of their numbers.

    They share one prefix, so a shorter ID has the smaller number and IDs of one length order as
    their numbers do: two sorts done in C, where a key of :func:`number` costs a call per ID (a whole
    GPU is 100 of them on every Allocate). IDs of mixed prefixes come out by length, then as text.
    """
    ordered = sorted(device_ids)
    ordered.sort(key=len)
    return tuple(ordered)


def duplicates(device_ids: Iterable[str]) -> list[str]:
    """IDs that appear more than once, in first-seen order."""
    counts = Counter(device_ids)
    return [i for i, n in counts.items() if n > 1]


def shown(device_id: str) -> str:
    """An ID as a message lists it: as it is, or :func:`brief` when it is long or holds a character that is not
    printable (a line break would split the log line; a long one, the kubelet's limit on a status message)."""
    return device_id if len(device_id) <= 80 and device_id.isprintable() else brief(device_id)


def describe(device_ids: Sequence[str]) -> str:
    """``devices a, b, c`` for a few IDs; the first ones and a count for many."""
    ordered = sorted(device_ids, key=lambda i: (i.rsplit("-", 1)[0], number(i), i))
    if not ordered:
        return "no devices"
    if len(ordered) <= SHOWN:
        return "devices " + ", ".join(map(shown, ordered))
    head = ", ".join(map(shown, ordered[:SHOWN]))
    return f"{len(ordered)} devices {head}, ... {shown(ordered[-1])}"
