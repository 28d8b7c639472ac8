"""The versions of torch and transformers trainmesh supports, and the check of what is installed.

The floors are those ``pyproject.toml`` declares and ``benchmarks/version_matrix.sh`` tests
(docs/COMPATIBILITY.md); a version below one is refused with one line naming the installed
and the required version (the command line: exit 2).
"""
from __future__ import annotations

import re

from trainmesh.core.errors import ConfigError

TORCH_MIN = "2.6"
"""The oldest torch whose fast test tier and layouts pass (docs/COMPATIBILITY.md)."""
TRANSFORMERS_MIN = "5.0"
"""transformers 5's weight conversions and model plans are what trainmesh reads; it needs torch
>= 2.6 itself (below it, it disables its PyTorch models)."""


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


def check_transformers(transformers) -> None:
    require("transformers", transformers.__version__, TRANSFORMERS_MIN)
