"""ZeRO-3's units: the pieces of a model that are gathered, used and freed together.

By default (:func:`find_units`) each child of the model's largest ``nn.ModuleList`` (the one
holding the most parameters, wherever it sits: ``model.layers``, ``model.transformer.h``,
``encoder.block``, ...) is a unit — each repeated block —, so is every other child with
parameters of the modules on the way to that list (embeddings, final norm, head: modules that
run once; containers such as a ``ModuleDict`` are never units, their forward never runs), and
the root holds whatever is left, as FSDP wraps each transformer block. A model without a ``ModuleList`` but built as an
``nn.Sequential`` takes its children; otherwise the whole model is one unit. ``zero3_units=``
(:data:`UnitSpec`: module names, module classes, or a predicate on ``(name, module)``) chooses
the units instead, as FSDP's auto-wrap policy does. A parameter shared by modules of different
units belongs to their closest common unit (:func:`owner`).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn

from trainmesh.core.errors import ConfigError

UnitSpec = Sequence["str | type[nn.Module]"] | Callable[[str, nn.Module], bool]
"""What ``zero3_units=`` takes: module names (``"transformer.h.0"``) and/or module classes
(every module of that class is a unit), or a predicate ``(name, module) -> bool``."""


def _numel(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def _largest_list(root: nn.Module) -> tuple[str, nn.Module] | None:
    """The ``ModuleList`` with the most parameters (the outermost on a tie), or None."""
    best: tuple[int, str, nn.Module] | None = None
    for name, m in root.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) > 0:
            n = _numel(m)
            if n > 0 and (best is None or n > best[0]):
                best = (n, name, m)
    return (best[1], best[2]) if best is not None else None


def find_units(root: nn.Module, spec: UnitSpec | None = None) -> list[str]:
    """Module paths of the units, outermost first; the root ("") is always one (what is left)."""
    if spec is not None:
        return ["", *select_units(root, spec)]
    found = _largest_list(root)
    if found is None and isinstance(root, nn.Sequential):
        found = ("", root)
    if found is None:
        return [""]
    path, blocks = found
    units = [""]
    parts = path.split(".") if path else []
    for depth in range(len(parts)):              # the siblings along the way to the list
        above = ".".join(parts[:depth])
        module = root.get_submodule(above)
        for name, child in module.named_children():
            full = f"{above}.{name}" if above else name
            if name != parts[depth] and _numel(child) > 0 and not _is_container(child):
                units.append(full)
    prefix = path + "." if path else ""
    units += [prefix + name for name, child in blocks.named_children() if _numel(child) > 0]
    order = {name: i for i, (name, _) in enumerate(root.named_modules())}
    return sorted(units, key=order.__getitem__)                     # model order


def _is_container(m: nn.Module) -> bool:
    """A module whose own forward never runs (its children are called one by one)."""
    return isinstance(m, (nn.ModuleList, nn.ModuleDict))


def select_units(root: nn.Module, spec: UnitSpec) -> list[str]:
    """The module names ``spec`` picks (ConfigError naming ``zero3_units`` for a name that is
    not a module, or a choice that picks nothing), in model order."""
    modules = dict(root.named_modules())
    if callable(spec) and not isinstance(spec, type):
        picked = [n for n, m in modules.items() if n and spec(n, m)]
    else:
        names = {s for s in spec if isinstance(s, str)}
        classes = tuple(s for s in spec if isinstance(s, type))
        unknown = sorted(n for n in names if n not in modules)
        if unknown:
            raise ConfigError("zero3_units", f"{unknown[0]!r} is not a module of "
                              f"{type(root).__name__}; valid: names from model.named_modules(), "
                              "module classes, or a predicate (name, module) -> bool")
        picked = [n for n, m in modules.items()
                  if n and (n in names or (classes and isinstance(m, classes)))]
    picked = [n for n in picked if _numel(modules[n]) > 0]
    if not picked:
        raise ConfigError("zero3_units", f"picks no module with parameters of {type(root).__name__}")
    return picked


def owner(paths: list[str], units: list[str]) -> str:
    """The deepest unit that contains every module path in ``paths``."""
    def inside(path: str, unit: str) -> bool:
        return unit == "" or path == unit or path.startswith(unit + ".")
    return max((u for u in units if all(inside(p, u) for p in paths)), key=len)
