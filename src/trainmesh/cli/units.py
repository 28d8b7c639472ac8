"""Sizes and bandwidths with units: GB = 1e9 bytes, GiB = 2^30 (CONTRACT.md)."""
from __future__ import annotations

import re

from ..errors import ConfigError

UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str, field: str) -> int:
    """'16MB' -> 16_000_000; '1GiB' -> 2**30; a bare number is bytes. Must be > 0."""
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in UNITS:
        raise ConfigError(field, f"{text!r} is not a size; use e.g. 4KB, 16MB, 1GiB or bytes")
    value = float(m.group(1)) * UNITS[m.group(2).lower()]
    if value <= 0:
        raise ConfigError(field, f"must be > 0; got {text!r}")
    return int(value)
