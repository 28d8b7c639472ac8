"""Reading and writing sizes, bandwidths and counts as people type them.

Sizes: ``80GB`` (GB = 1e9 bytes), ``80GiB`` (GiB = 2**30), also B, KB/KiB, MB/MiB, TB/TiB, and
plain byte counts (``8e10``). Bandwidths: the same units per second (``300GB/s``). Counts:
plain numbers (``7.5e9``) or with a K/M/B/T suffix (``7.5B``). Bad input raises
:class:`~trainmesh.core.errors.ConfigError` naming the flag and what would be valid.
"""
from __future__ import annotations

import math
import re

from trainmesh.core.errors import ConfigError

SIZE_UNITS: dict[str, int] = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}
"""Size suffix (upper-cased) -> bytes. Decimal units are powers of 1000, binary of 1024."""

COUNT_UNITS: dict[str, float] = {"": 1, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}
"""Count suffix -> multiplier (``B`` = billion, as in "7B parameters")."""

_NUMBER = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")
_VALID_SIZES = "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB or plain bytes"


def _split(field: str, text: str, what: str) -> tuple[float, str]:
    match = _NUMBER.match(str(text))
    if not match:
        raise ConfigError(field, f"cannot read {text!r} as {what}")
    value = float(match.group(1))
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(field, f"must be > 0; got {text!r}")
    return value, match.group(2)


def parse_size(field: str, text: str) -> int:
    """Bytes from ``80GB``, ``80GiB``, ``512MiB`` or ``8e10``; > 0, else ConfigError(field)."""
    value, unit = _split(field, text, f"a size ({_VALID_SIZES})")
    if unit.upper() not in SIZE_UNITS:
        raise ConfigError(field, f"unknown unit {unit!r} in {text!r}; use {_VALID_SIZES}")
    nbytes = int(round(value * SIZE_UNITS[unit.upper()]))
    if nbytes < 1:
        raise ConfigError(field, f"must be at least 1 byte; got {text!r}")
    return nbytes


def parse_bandwidth(field: str, text: str) -> float:
    """Bytes per second from ``300GB/s`` (also ``GiB/s``, ``MB/s``, ...); > 0."""
    raw = str(text).strip()
    if not raw.lower().endswith("/s"):
        raise ConfigError(field, f"a bandwidth needs a per-second unit such as 25GB/s; got {text!r}")
    return float(parse_size(field, raw[:-2]))


def parse_count(field: str, text: str) -> int:
    """A positive count from ``7.5e9``, ``7.5B``, ``175B``, ``350M``, ``1.2T``."""
    value, unit = _split(field, text, "a count such as 7.5e9 or 7.5B")
    if unit.upper() not in COUNT_UNITS:
        raise ConfigError(field, f"unknown suffix {unit!r} in {text!r}; use K, M, B or T")
    count = int(round(value * COUNT_UNITS[unit.upper()]))
    if count < 1:
        raise ConfigError(field, f"must be at least 1; got {text!r}")
    return count


def fmt_bytes(n: float) -> str:
    """``1.88 GB``-style decimal rendering (GB = 1e9), three significant digits."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def fmt_seconds(s: float) -> str:
    """Seconds with a sensible unit: ``12.3 s``, ``45.6 ms``."""
    if s >= 1:
        return f"{s:.3g} s"
    return f"{s * 1e3:.3g} ms"
