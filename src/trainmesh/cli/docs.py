"""docs/CLI.md, generated from the argparse parsers: every command, sub-command and flag.

``python -m trainmesh.cli.docs > docs/CLI.md`` regenerates it (``tests/test_cli_docs.py``
fails when the file and the parsers disagree). The defaults of the ``train`` flags come from
the config dataclasses (their parsers default to None, so that "given" is visible).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

HEADER = """# Command line reference

```bash doc-test
trainmesh --version
trainmesh train --help
```

Generated from the parsers by `python -m trainmesh.cli.docs > docs/CLI.md`; do not edit by hand.
Every `trainmesh train` flag is also a key of a `--config` TOML file (the flag name without
`--`; flags win over the file). Tables (`[train]`, `[parallel]`, any name) only group keys, one
level deep; a key set twice in the file exits 2 naming both places. Bad values exit 2 with one
line naming the flag, before any worker starts.
"""


def _config_defaults() -> dict[str, Any]:
    """flag -> default of each ``trainmesh train`` flag, from its config field."""
    from trainmesh.config.parallel import ParallelConfig
    from trainmesh.config.train import FLAGS, TRAIN_DEFAULTS, TrainConfig
    fields = {f.name: f for cls in (ParallelConfig, TrainConfig) for f in dataclasses.fields(cls)}
    out = {}
    for flag, spec in FLAGS.items():
        f = fields[spec.field]
        default = f.default if f.default is not dataclasses.MISSING else None
        out[flag] = TRAIN_DEFAULTS.get(spec.field, default)
    return out


def _cell(text: Any) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _default(action: argparse.Action, config: dict[str, Any]) -> str:
    flag = next((o for o in action.option_strings if o.startswith("--")), None)
    value = config.get(flag, action.default) if flag in config else action.default
    if value is None or value is argparse.SUPPRESS or value is False:
        return ""
    if value is True:
        return "on"
    if isinstance(value, (list, tuple)):
        return ", ".join(map(str, value))
    return f"`{value}`"


def _value(action: argparse.Action) -> str:
    if action.nargs == 0:
        return "switch"
    if action.choices:
        return ", ".join(f"`{c}`" for c in action.choices)
    kind = getattr(action.type, "__name__", None) if action.type else "str"
    many = " ..." if action.nargs in ("+", "*") else ""
    return f"{kind}{many}"


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _help_of(parent: argparse.ArgumentParser, name: str) -> str:
    for action in parent._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                if choice.dest == name:
                    return choice.help or ""
    return ""


def _command(name: str, parser: argparse.ArgumentParser, summary: str,
             config: dict[str, Any], depth: int) -> list[str]:
    lines = [f"{'#' * depth} `trainmesh {name}`", ""]
    text = parser.description or summary
    if text:
        lines += [_cell(text), ""]
    positionals = [a for a in parser._actions if not a.option_strings
                   and not isinstance(a, argparse._SubParsersAction)]
    options = [a for a in parser._actions if a.option_strings and a.help is not argparse.SUPPRESS
               and not isinstance(a, argparse._HelpAction)]
    rows = [(f"`{a.metavar or a.dest}`", _value(a), "", a.help or "") for a in positionals]
    rows += [(", ".join(f"`{o}`" for o in a.option_strings), _value(a), _default(a, config),
              a.help or "") for a in options]
    if rows:
        lines += ["| argument | value | default | meaning |", "|---|---|---|---|"]
        lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
        lines.append("")
    for sub, child in _subparsers(parser).items():
        lines += _command(f"{name} {sub}", child, _help_of(parser, sub), config, depth + 1)
    return lines


def render() -> str:
    """The whole of docs/CLI.md."""
    from . import build_parser
    parser = build_parser()
    config = _config_defaults()
    from .train import DEMO
    demo = ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in DEMO.items())
    lines = [HEADER, f"A bare `trainmesh train` (no argument, no `--config`) runs the demo layout "
                     f"(`{demo}`); once any argument is given, unset layout flags default to 1.", ""]
    top = [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]
    lines += [f"`trainmesh {', '.join(a.option_strings)}`: {_cell(a.help or '')}" for a in top]
    lines += [""] if top else []
    commands = _subparsers(parser)
    lines += [f"- `trainmesh {n}`: {_cell(_help_of(parser, n))}" for n in commands] + [""]
    for name, sub in commands.items():
        lines += _command(name, sub, _help_of(parser, name),
                          config if name in ("train", "plan") else {}, 2)
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
