"""Exceptions with a field name, so the CLI can report one clear line and exit 2."""
from __future__ import annotations


class ConfigError(ValueError):
    """An invalid setting: names the field (flag or config key) and what would be valid."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class CommTimeout(RuntimeError):
    """A collective or point-to-point op did not finish within the mesh's timeout."""


class DataError(RuntimeError):
    """The --data file changed, shrank or went away while the run read it: the run stops (exit 1)."""
