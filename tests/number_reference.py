"""Number canonicalisation, written from the protocol's rules alone.

Tests compare Octo's codec against these functions; they use only Python's
``int``, ``float`` (correctly rounded decimal conversion) and ``repr``
(shortest round-trip digits), never Octo code.
"""

from __future__ import annotations

import math
import re

MIN_EXACT = -(2**63)
MAX_EXACT = 2**64 - 1
_INTEGER = re.compile(r"-?(?:0|[1-9][0-9]*)")


def reference_double(x: float) -> str:
    """Shortest digits d, exponent kk with |x| = 0.d × 10^kk, then the five cases."""
    if x == 0.0:
        return "-0.0" if math.copysign(1.0, x) < 0 else "0.0"
    sign = "-" if x < 0 else ""
    mantissa, _, exponent = repr(abs(x)).partition("e")
    whole, _, fraction = mantissa.partition(".")
    digits = str(int(whole + fraction))
    scale = (int(exponent) if exponent else 0) - len(fraction)
    stripped = digits.rstrip("0")
    scale += len(digits) - len(stripped)
    d, n = stripped, len(stripped)
    kk = n + scale
    if n <= kk <= 16:
        body = d + "0" * (kk - n) + ".0"
    elif 0 < kk <= 16:
        body = d[:kk] + "." + d[kk:]
    elif -5 < kk <= 0:
        body = "0." + "0" * (-kk) + d
    elif n == 1:
        body = d + "e" + str(kk - 1)
    else:
        body = d[0] + "." + d[1:] + "e" + str(kk - 1)
    return sign + body


def reference_number(lexeme: str) -> str | None:
    """The canonical spelling of one JSON number lexeme, or None when it is rejected.

    An integer lexeme (no fraction, no exponent) in [-2^63, 2^64-1] stays exact,
    except ``-0``; every other number is the nearest double, and a double that
    overflows to infinity is rejected.
    """
    # 21 characters hold every integer of the exact range (and int() stays cheap).
    if _INTEGER.fullmatch(lexeme) and lexeme != "-0" and len(lexeme) <= 21:
        value = int(lexeme)
        if MIN_EXACT <= value <= MAX_EXACT:
            return str(value)
    number = float(lexeme)
    if math.isinf(number):
        return None
    return reference_double(number)


def reference_python_int(value: int) -> str | None:
    """How a Python ``int`` inside a payload value is written, or None if rejected."""
    if MIN_EXACT <= value <= MAX_EXACT:
        return str(value)
    try:
        return reference_double(float(value))
    except OverflowError:
        return None
