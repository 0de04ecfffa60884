"""Byte sizes as operators write them: ``3.8GiB``, ``512MB``, ``4096``.

IEC (KiB, MiB, GiB, TiB: powers of 1024) and SI (kB/KB, MB, GB, TB: powers of
1000) are both accepted *explicitly*, because the seed's figures are in GiB
while hardware datasheets are in GB, and confusing the two costs 7% of a pool.
Anything else is refused with a message naming the input.
"""

from __future__ import annotations

import re
from decimal import Decimal

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
}

_SIZE = re.compile(r"^\s*(?P<num>\d+(?:\.\d+)?|\.\d+)\s*(?P<unit>[A-Za-z]*)\s*$")


class SizeError(ValueError):
    """A size string could not be parsed, or is not positive."""


def parse_size(text: str | int) -> int:
    """Parse a byte size; return whole bytes (fractions of a byte round down).

    Raises SizeError for negative, zero, unparsable or unit-less-but-fractional
    values and for unknown units.
    """
    if isinstance(text, bool):
        raise SizeError(f"not a size: {text!r}")
    if isinstance(text, int):
        if text <= 0:
            raise SizeError(f"size must be positive, got {text}")
        return text
    match = _SIZE.match(text)
    if match is None:
        raise SizeError(
            f"not a size: {text!r} (expected a number with an optional unit such as "
            "4096, 512MiB, 3.8GiB or 4GB)"
        )
    spelled = match["unit"]
    if spelled.endswith("b") and spelled.lower() != "b":
        raise SizeError(f"{text!r}: a lowercase 'b' means bits; write bytes as {spelled[:-1]}B")
    unit = spelled.lower()
    if unit not in _UNITS:
        raise SizeError(
            f"unknown unit {match['unit']!r} in {text!r} "
            "(use B, KiB, MiB, GiB, TiB for powers of 1024 or kB, MB, GB, TB for powers of 1000)"
        )
    value = Decimal(match["num"]) * _UNITS[unit]  # exact: no float rounding or overflow
    if unit in ("", "b") and not match["num"].isdigit():
        raise SizeError(f"a size in bytes must be a whole number, got {text!r}")
    if value < 1:
        raise SizeError(f"size must be at least one byte, got {text!r}")
    return int(value)


def format_iec(num_bytes: float) -> str:
    """Render bytes with the largest IEC unit that keeps the number >= 1."""
    for unit, factor in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(num_bytes) >= factor:
            return f"{num_bytes / factor:,.2f} {unit}".replace(".00 ", " ")
    return f"{int(num_bytes)} B"


def format_si(num_bytes: float) -> str:
    """Render bytes with the largest SI unit that keeps the number >= 1."""
    for unit, factor in (("TB", 1000**4), ("GB", 1000**3), ("MB", 1000**2), ("kB", 1000)):
        if abs(num_bytes) >= factor:
            return f"{num_bytes / factor:,.1f} {unit}"
    return f"{int(num_bytes)} B"
