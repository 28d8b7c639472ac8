"""The generated flags of ``train`` and ``plan``: grouped ``--help``, defaults and choices shown,
and the nearest valid name for a misspelt flag.

Flags come from the config dataclasses (:data:`trainmesh.config.train.FLAGS`); each carries its
``--help`` section (:data:`trainmesh.config.validation.GROUPS`). Every flag defaults to None on the
parser so that "given" stays visible (a bare ``trainmesh train`` is the demo); the help text
shows the field's own default instead.
"""
from __future__ import annotations

import argparse
import difflib
from collections.abc import Iterable
from typing import Any

GROUP_TITLES = {
    "layout": "layout (unset: 1 locally, the demo's dp 2 for a bare `trainmesh train`; under "
              "torchrun/srun dp = world size / (pp x tp))",
    "model": "model", "data": "data", "optimisation": "optimisation",
    "precision & memory": "precision & memory", "checkpoints": "checkpoints",
    "observability": "observability", "launch": "launch",
}


def _show(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "off"
    return str(value)


def help_text(flag: Any) -> str:
    """The flag's help with its default and choices: ``... (default 1f1b; one of naive, ...)``."""
    from trainmesh.config.train import TRAIN_DEFAULTS
    default = TRAIN_DEFAULTS.get(flag.field, flag.default)
    shown = flag.kind is not bool and "default" not in flag.help
    extra = [f"default {_show(default)}"] if shown else []
    if flag.choices:
        extra.append("one of " + ", ".join(map(str, flag.choices)))
    text = flag.help.replace("%", "%%")
    return f"{text} ({'; '.join(extra)})" if extra else text


def add_flags(parser: argparse.ArgumentParser, *, keep: Iterable[str] | None = None,
              titles: dict[str, str] | None = None) -> dict[str, Any]:
    """Add the train flags (only those in ``keep`` when given) to ``parser`` in their groups;
    returns {group name: argparse group}. ``titles`` overrides section titles."""
    from trainmesh.config.train import FLAGS
    from trainmesh.config.validation import GROUPS
    sections: dict[str, Any] = {}
    titles = {**GROUP_TITLES, **(titles or {})}
    wanted = set(keep) if keep is not None else None
    names = list(GROUPS) + sorted({f.group for f in FLAGS.values()} - set(GROUPS))
    for name in names:
        for flag, f in FLAGS.items():
            if f.group != name or (wanted is not None and flag not in wanted):
                continue
            if name not in sections:
                sections[name] = parser.add_argument_group(titles.get(name, name))
            group = sections[name]
            if f.kind is bool:
                group.add_argument(flag, action="store_const", const=True, default=None,
                                   help=help_text(f))
            else:
                metavar = "{" + ",".join(map(str, f.choices)) + "}" if f.choices else f.kind.__name__.upper()
                group.add_argument(flag, type=f.kind, default=None, metavar=metavar,
                                   help=help_text(f))
    return sections


def option_strings(parser: argparse.ArgumentParser) -> list[str]:
    return [o for a in parser._actions for o in a.option_strings if o.startswith("--")]


def _common_prefix(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def suggest(unknown: str, parser: argparse.ArgumentParser) -> str:
    """``unrecognized flag --dpp; did you mean --dp?`` (difflib's nearest valid name)."""
    name = unknown.split("=", 1)[0]
    if not name.startswith("-"):
        return f"unexpected argument {name!r}; see --help"
    near = difflib.get_close_matches(name, option_strings(parser), n=3, cutoff=0.6)
    ratio = {c: difflib.SequenceMatcher(None, name, c).ratio() for c in near}
    near.sort(key=lambda c: (-round(ratio[c], 6), -_common_prefix(name, c), c))
    hint = f"; did you mean {near[0]}?" if near else "; see --help for the valid flags"
    return f"unrecognized flag {name}{hint}"
