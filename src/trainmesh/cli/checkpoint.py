"""``trainmesh checkpoint consolidate DIR OUT.safetensors``: the full, unsharded model;
``trainmesh checkpoint export-hf DIR OUTDIR``: a Hugging Face model directory."""
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
    e = what.add_parser("export-hf", help="write the newest checkpoint as a Hugging Face model "
                        "directory (config.json + model.safetensors)")
    e.add_argument("dir", metavar="DIR", help="a --save-dir, or one step-NNNNNNNN directory in it")
    e.add_argument("out", metavar="OUTDIR", help="output directory (must not exist or be empty)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if getattr(args, "what", None) == "export-hf":
        return _export_hf(args)
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


def _export_hf(args: argparse.Namespace) -> int:
    from pathlib import Path
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError("OUTDIR", f"{args.out!r} exists and is not an empty directory")
    from ..export_hf import export_hf
    print(f"wrote {export_hf(args.dir, out)}")
    return 0
