"""The versions of torch and transformers trainmesh supports, and the check of what is installed.

The floors are those ``pyproject.toml`` declares and ``benchmarks/version_matrix.sh`` tests
(docs/COMPATIBILITY.md); a version below one is refused with one line naming the installed
and the required version (the command line: exit 2). A transformers newer than the newest one
tested gets one warning: its model plans may have changed in ways trainmesh does not know yet.
"""
from __future__ import annotations

import logging
import re

from trainmesh.core.errors import ConfigError

TORCH_MIN = "2.6"
"""The oldest torch whose fast test tier and layouts pass (docs/COMPATIBILITY.md)."""
TRANSFORMERS_MIN = "5.0"
"""transformers 5's weight conversions and model plans are what trainmesh reads; it needs torch
>= 2.6 itself (below it, it disables its PyTorch models)."""
TRANSFORMERS_TESTED = "5.25.0"
"""The newest transformers the suite passed with: the extras' upper bound in ``pyproject.toml``
and the pin of ``constraints.txt`` (a test keeps the three equal)."""


def parse(version: str) -> tuple[int, ...]:
    """``2.13.0+cpu`` -> (2, 13, 0); ``5.0.0rc1`` -> (5, 0, 0)."""
    m = re.match(r"(\d+(?:\.\d+)*)", version)
    return tuple(int(p) for p in m.group(1).split(".")) if m else ()


def require(package: str, installed: str, minimum: str) -> None:
    """ConfigError naming ``package`` unless ``installed`` >= ``minimum``."""
    have, need = parse(installed), parse(minimum)
    width = max(len(have), len(need))
    if have + (0,) * (width - len(have)) < need + (0,) * (width - len(need)):
        raise ConfigError(package, f"{installed} is installed; trainmesh needs {package} >= {minimum} "
                          f"(pip install '{package}>={minimum}')")


def check_torch() -> None:
    import torch
    require("torch", torch.__version__, TORCH_MIN)


def newer_than_tested(installed: str, tested: str) -> bool:
    """True when ``installed`` is a later release than ``tested`` (local labels ignored)."""
    have, ref = parse(installed), parse(tested)
    width = max(len(have), len(ref))
    return have + (0,) * (width - len(have)) > ref + (0,) * (width - len(ref))


def check_transformers(transformers) -> None:
    require("transformers", transformers.__version__, TRANSFORMERS_MIN)
    if newer_than_tested(transformers.__version__, TRANSFORMERS_TESTED):
        logging.getLogger("trainmesh").warning(
            "transformers %s is newer than the newest release trainmesh was tested with (%s): "
            "a model's declared plans may have changed (docs/COMPATIBILITY.md)", transformers.__version__, TRANSFORMERS_TESTED)
