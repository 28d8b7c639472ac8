"""ZeRO-3's units: the pieces of a model that are gathered, used and freed together.

Every element of a layer list (``ModuleList``/``ModuleDict``/``Sequential``, e.g. each GPT
block), every other child that owns parameters, and the root for whatever is left; a parameter
shared by modules of different units belongs to their closest common unit (:func:`owner`).
"""
from __future__ import annotations

from torch import nn


def _is_list(m: nn.Module) -> bool:
    return isinstance(m, (nn.ModuleList, nn.ModuleDict, nn.Sequential))


def _has_params(m: nn.Module) -> bool:
    return any(True for _ in m.parameters())


def find_units(root: nn.Module) -> list[str]:
    """Module paths of the units, outermost first; the root ("") is always a candidate."""
    units = [""]

    def add_children(m: nn.Module, prefix: str) -> None:
        for name, child in m.named_children():
            if _has_params(child):
                units.append(prefix + name)

    def walk(m: nn.Module, prefix: str) -> None:
        for name, child in m.named_children():
            path = prefix + name
            if not _has_params(child):
                continue
            if _is_list(child):
                add_children(child, path + ".")
            elif any(_is_list(d) for d in child.modules() if d is not child):
                walk(child, path + ".")
            else:
                units.append(path)

    if isinstance(root, nn.Sequential):
        add_children(root, "")
    else:
        walk(root, "")
    return units


def owner(paths: list[str], units: list[str]) -> str:
    """The deepest unit that contains every module path in ``paths``."""
    def inside(path: str, unit: str) -> bool:
        return unit == "" or path == unit or path.startswith(unit + ".")
    return max((u for u in units if all(inside(p, u) for p in paths)), key=len)
