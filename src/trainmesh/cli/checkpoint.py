"""``trainmesh checkpoint consolidate DIR OUT.safetensors``: the full, unsharded model."""
from __future__ import annotations

import argparse

from ..errors import ConfigError
from .paths import check_output_file


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("checkpoint", help="work with checkpoints")
    what = p.add_subparsers(dest="what", metavar="ACTION", parser_class=type(p))
    c = what.add_parser("consolidate", help="write the full model of the newest checkpoint as safetensors")
    c.add_argument("dir", metavar="DIR", help="a --save-dir, or one step-NNNNNNNN directory in it")
    c.add_argument("out", metavar="OUT", help="output .safetensors file")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if getattr(args, "what", None) != "consolidate":
        raise ConfigError("checkpoint", "name the action: trainmesh checkpoint consolidate DIR OUT")
    if not args.out.endswith(".safetensors"):
        raise ConfigError("OUT", f"must end in .safetensors; got {args.out!r}")
    check_output_file("OUT", args.out)
    from ..checkpoint import CheckpointError, consolidate
    try:
        path = consolidate(args.dir, args.out)
    except CheckpointError as exc:
        raise ConfigError("DIR", str(exc)) from None
    print(f"wrote {path}")
    return 0
