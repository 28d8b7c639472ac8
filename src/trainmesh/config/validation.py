"""Typed, ranged configuration fields: one check of type and range for flags and TOML alike.

A config dataclass declares each user-settable field with :func:`setting` (default, help text,
range); its ``__post_init__`` calls :func:`check_fields`, which checks every field against its
annotation and range and raises :class:`~trainmesh.core.errors.ConfigError` naming the field as its
flag (``--seq-len``) and what would be valid. The same metadata generates the command-line
flags and the TOML keys (:func:`flag_of`), so there is one list of settings and one validation.

Rules: integers are Python ints that fit in int64 (a bool is not an integer); floats accept ints
and must be finite; bools must be bools; strings must be strings (paths non-empty).
"""
from __future__ import annotations

import math
import typing
from dataclasses import MISSING, Field, dataclass, field, fields
from functools import cache
from typing import Any

from trainmesh.core.errors import ConfigError

INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)


def setting(default: Any = MISSING, help: str = "", *, flag: str | None = None,  # noqa: A002
            ge: float | None = None, gt: float | None = None, le: float | None = None,
            choices: tuple | None = None, path: bool = False, group: str | None = None) -> Any:
    """A dataclass field with its flag, help text and valid range.

    ``ge``/``gt``/``le`` bound numbers; ``choices`` lists the valid values; ``path`` marks a
    string that names a file or directory (must be non-empty). ``flag`` overrides the flag
    derived from the field name (``timeout_s`` -> ``--timeout``). An empty ``help`` keeps the
    field off the command line (Python API only). ``group`` is the ``--help`` section of the
    flag (one of :data:`GROUPS`); a field without one gets :func:`default_group`.
    """
    meta = dict(help=help, flag=flag, ge=ge, gt=gt, le=le, choices=choices, path=path, group=group)
    return field(default=default, metadata=meta)


GROUPS = ("layout", "model", "data", "optimisation", "precision & memory", "checkpoints",
          "observability", "launch")
"""The sections of ``trainmesh train --help``, in order."""

_GROUP_HINTS = (("checkpoints", ("save", "resume", "keep", "checkpoint", "init_from")),
                ("observability", ("_out", "metrics", "trace", "eval", "tensorboard", "log")),
                ("data", ("data", "token")),
                ("launch", ("restart", "timeout", "device", "node", "nproc", "master", "rdzv")))


def default_group(f: Field, fallback: str) -> str:
    """The ``--help`` section of a field: its ``group=``, else one its name suggests
    (``keep_last`` -> checkpoints, ``foo_out`` -> observability), else ``fallback`` (the
    section of the config class that declares it)."""
    if f.metadata.get("group"):
        return f.metadata["group"]
    for group, words in _GROUP_HINTS:
        if any(w in f.name for w in words):
            return group
    return fallback


def flag_of(f: Field) -> str:
    """The flag of a field: ``global_batch`` -> ``--global-batch`` unless ``flag=`` says else."""
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def is_flag(f: Field) -> bool:
    """Whether a field is a command-line flag (and a TOML key)."""
    return bool(f.metadata.get("help"))


@dataclass(frozen=True)
class Flag:
    """One command-line flag (and TOML key) generated from a config field."""

    field: str
    """The dataclass field it sets."""
    kind: type
    """bool (a switch), int, float or str."""
    help: str
    group: str = "launch"
    """The ``--help`` section (:data:`GROUPS`)."""
    default: Any = None
    """The field's default (shown in ``--help``)."""
    choices: tuple | None = None


def flags_of(cls: type, *, group: str = "launch") -> dict[str, Flag]:
    """The flags of a config dataclass: flag -> :class:`Flag`, in field order; ``group`` is the
    section of fields that name none and suggest none (:func:`default_group`)."""
    hints = _hints(cls)
    return {flag_of(f): Flag(f.name, _base(hints[f.name])[0] or str, f.metadata["help"],
                             default_group(f, group),
                             None if f.default is MISSING else f.default, f.metadata.get("choices"))
            for f in fields(cls) if is_flag(f)}


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _base(annotation: Any) -> tuple[type | None, bool]:
    """(the scalar type, whether None is allowed) of ``int``, ``float | None``, ...; (None, _) for
    anything else (nested configs)."""
    args = typing.get_args(annotation) or (annotation,)
    optional = type(None) in args
    scalars = [a for a in args if a in (bool, int, float, str)]
    return (scalars[0] if len(scalars) == 1 else None), optional


def describe(f: Field, base: type) -> str:
    """What is valid for a field, in words: 'an integer >= 1', 'one of adamw, sgd', ..."""
    m = f.metadata
    if m.get("choices") is not None:
        return "one of " + ", ".join(map(str, m["choices"]))
    if base is bool:
        return "true or false"
    if base is str:
        return "a non-empty path" if m.get("path") else "a string"
    words = "an integer" if base is int else "a finite number"
    bounds = [f"{op} {_num(m[k])}" for k, op in (("ge", ">="), ("gt", ">"), ("le", "<="))
              if m.get(k) is not None]
    return " ".join([words, " and ".join(bounds)]).strip()


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def check_value(f: Field, annotation: Any, value: Any) -> Any:
    """``value`` checked against field ``f`` (annotation and range); the value to store (ints
    given for a float become floats). Raises ConfigError naming the flag."""
    base, optional = _base(annotation)
    if base is None or (value is None and optional):
        return value
    flag, valid = flag_of(f), describe(f, base)
    if not _of_type(value, base):
        raise ConfigError(flag, f"must be {valid}; got {value!r}")
    if base is float:
        value = float(value)
        if not math.isfinite(value):
            raise ConfigError(flag, f"must be {valid}; got {value!r}")
    if base is int and not INT64_MIN <= value <= INT64_MAX:
        raise ConfigError(flag, f"must be {valid} that fits in int64 (at most {INT64_MAX}); got {value}")
    if base is str and f.metadata.get("path") and not value:
        raise ConfigError(flag, f"must be {valid}; got {value!r}")
    if not _in_range(f.metadata, value):
        raise ConfigError(flag, f"must be {valid}; got {value!r}")
    return value


def _of_type(value: Any, base: type) -> bool:
    if base is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if base is float:
        if isinstance(value, int):
            return abs(value) < 2**1023  # float(value) would overflow
        return isinstance(value, float)
    return isinstance(value, base)


def _in_range(m: typing.Mapping[str, Any], value: Any) -> bool:
    if m.get("choices") is not None and value not in m["choices"]:
        return False
    return ((m.get("ge") is None or value >= m["ge"]) and (m.get("gt") is None or value > m["gt"])
            and (m.get("le") is None or value <= m["le"]))


def check_fields(obj: Any) -> None:
    """Check every field of dataclass ``obj`` against its annotation and range, in order."""
    hints = _hints(type(obj))
    for f in fields(obj):
        value = getattr(obj, f.name)
        checked = check_value(f, hints[f.name], value)
        if checked is not value:
            setattr(obj, f.name, checked)
