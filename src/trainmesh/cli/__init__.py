"""``trainmesh`` command line: one sub-command per module in this package.

Each sub-command module exposes ``add_parser(subparsers)`` and ``run(args) -> int``. This
package is the only place that parses flags. Bad input exits 2 with one line naming the field.
Imports every package; nothing imports it.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from trainmesh.core.errors import ConfigError

# sub-command name -> module (relative to this package)
COMMANDS = {
    "train": ".train",
    "plan": ".plan",
    "schedule": ".schedule",
    "bench": ".bench",
    "checkpoint": ".checkpoint",
    "launch": ".launch",
    "report": ".report",
    "coordinator": ".coordinator",
    "verify": ".verify",
}


class _Parser(argparse.ArgumentParser):
    """argparse that reports bad flags in one line and exits 2 (argparse's own code)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"trainmesh: error: {message}\n")
        raise SystemExit(2)


def add_version(parser: argparse.ArgumentParser) -> None:
    """``--version``: print the version and exit 0."""
    from .. import __version__
    parser.add_argument("--version", action="version", version=f"trainmesh {__version__}")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="trainmesh", description=__doc__.splitlines()[0])
    add_version(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, module in COMMANDS.items():
        try:
            mod = importlib.import_module(module, __name__)
        except ModuleNotFoundError as exc:  # a sub-command not built in this install
            if exc.name and exc.name.startswith(__name__):
                continue
            raise
        mod.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:   # a misspelt flag: name the nearest valid one
        from .flags import suggest
        sub = _subparser(parser, args.command)
        where = f"trainmesh {args.command}" if sub is not None else "trainmesh"
        sys.stderr.write(f"{where}: error: {suggest(unknown[0], sub or parser)}\n")
        return 2
    args.argv = argv
    if args.command is None:
        parser.print_help()
        return 2
    try:
        from trainmesh.core.versions import check_torch
        check_torch()
        return int(args.run(args) or 0)
    except ConfigError as exc:
        sys.stderr.write(f"trainmesh {args.command}: error: {exc}\n")
        return 2


def _subparser(parser: argparse.ArgumentParser, command: str | None) -> argparse.ArgumentParser | None:
    for action in parser._subparsers._group_actions if parser._subparsers else ():
        if command in getattr(action, "choices", {}):
            return action.choices[command]
    return None


if __name__ == "__main__":
    raise SystemExit(main())
