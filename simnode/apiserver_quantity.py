"""Kubernetes quantities as the API server stores them: parsed exactly, answered in canonical form.

The real server canonicalises every ``resource.Quantity`` it stores: ``81920Mi`` comes back as
``80Gi``, ``1000`` as ``1k``, ``0.5`` as ``500m``. A client that compares the strings it sent with
the strings it reads back sees a difference where there is none; the simulator does the same
so such clients are caught.
"""

from __future__ import annotations

from decimal import Decimal, InvalidOperation

_BINARY = (("Ei", 60), ("Pi", 50), ("Ti", 40), ("Gi", 30), ("Mi", 20), ("Ki", 10))
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}


class QuantityError(ValueError):
    """Text that is not a Kubernetes quantity."""


def parse(text: object) -> tuple[Decimal, bool]:
    """``(value, binary)``: the exact value and whether the text used a binary (``Ki``...) suffix."""
    if isinstance(text, bool) or not isinstance(text, str | int | float):
        raise QuantityError(f"quantities must match the regular expression, got {text!r}")
    raw = str(text).strip()
    for suffix, power in _BINARY:
        if raw.endswith(suffix):
            return _number(raw[: -len(suffix)], raw) * (Decimal(2) ** power), True
    for suffix in ("n", "u", "m", "k", "M", "G", "T", "P", "E"):
        if raw.endswith(suffix) and not raw.endswith("e" + suffix):
            return _number(raw[: -len(suffix)], raw) * (Decimal(10) ** _DECIMAL[suffix]), False
    return _number(raw, raw), False


def _number(digits: str, raw: str) -> Decimal:
    if not digits or digits.strip() != digits or digits.lower().startswith(("nan", "inf", "+inf", "-inf")):
        raise QuantityError(
            f"quantities must match the regular expression '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$': {raw!r}"
        )
    try:
        return Decimal(digits)
    except InvalidOperation:
        raise QuantityError(f"quantities must match the regular expression: {raw!r}") from None


def canonical(text: object) -> str:
    """The canonical form the real server answers with."""
    value, binary = parse(text)
    if binary and value == value.to_integral_value():
        whole = int(value)
        for suffix, power in _BINARY:
            if whole and whole % (1 << power) == 0:
                return f"{whole >> power}{suffix}"
        return str(whole)
    # Decimal SI: the largest exponent (multiple of 3) that keeps an integer mantissa.
    if value == 0:
        return "0"
    for suffix, exp in sorted(_DECIMAL.items(), key=lambda kv: -kv[1]):
        if exp < -9:
            continue
        mantissa = value / (Decimal(10) ** exp)
        if mantissa == mantissa.to_integral_value():
            return f"{int(mantissa)}{suffix}"
    # Finer than nano: rounded up to nano, as the real server does.
    nanos = (value * Decimal(10) ** 9).to_integral_value(rounding="ROUND_CEILING")
    return f"{int(nanos)}n"


def value(text: object) -> Decimal:
    """The exact value of a quantity."""
    return parse(text)[0]
