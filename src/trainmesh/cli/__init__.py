"""``trainmesh`` command line: one sub-command per module in this package.

Each sub-command module exposes ``add_parser(subparsers)`` and ``run(args) -> int``. This
package is the only place that parses flags. Bad input exits 2 with one line naming the field.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from ..errors import ConfigError

# sub-command name -> module (relative to this package)
COMMANDS = {
    "train": ".train",
    "plan": ".plan",
    "schedule": ".schedule",
    "bench": ".bench",
    "checkpoint": ".checkpoint",
    "launch": ".launch",
    "report": ".report",
}


class _Parser(argparse.ArgumentParser):
    """argparse that reports bad flags in one line and exits 2 (argparse's own code)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"trainmesh: error: {message}\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="trainmesh", description=__doc__.splitlines()[0])
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
    args = parser.parse_args(argv)
    args.argv = argv
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(args.run(args) or 0)
    except ConfigError as exc:
        sys.stderr.write(f"trainmesh {args.command}: error: {exc}\n")
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
