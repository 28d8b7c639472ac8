"""``trainmesh checkpoint consolidate DIR OUT.safetensors``: the full, unsharded model;
``trainmesh checkpoint export-hf DIR OUTDIR``: a Hugging Face model directory.

Neither destroys: an existing OUT is refused unless ``--force``, and OUT inside DIR (where it
could replace a piece of a checkpoint) is refused always; OUTDIR must be new or empty."""
from __future__ import annotations

import argparse
from pathlib import Path

from trainmesh.core.errors import ConfigError

from .paths import check_output_dir, check_output_file


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("checkpoint", help="work with checkpoints")
    what = p.add_subparsers(dest="what", metavar="ACTION", parser_class=type(p))
    c = what.add_parser("consolidate", help="write the full model of the newest intact checkpoint as safetensors")
    c.add_argument("dir", metavar="DIR", help="a --save-dir, or one step-NNNNNNNN directory in it")
    c.add_argument("out", metavar="OUT", help="output .safetensors file (not inside DIR)")
    c.add_argument("--force", action="store_true", help="replace OUT if it exists")
    e = what.add_parser("export-hf", help="write the newest checkpoint as a Hugging Face model "
                        "directory (config.json + model.safetensors)")
    e.add_argument("dir", metavar="DIR", help="a --save-dir, or one step-NNNNNNNN directory in it")
    e.add_argument("out", metavar="OUTDIR", help="output directory (must not exist or be empty)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if getattr(args, "what", None) == "export-hf":
        return _export_hf(args)
    if getattr(args, "what", None) != "consolidate":
        raise ConfigError("checkpoint", "name the action: trainmesh checkpoint consolidate DIR OUT, "
                          "or trainmesh checkpoint export-hf DIR OUTDIR")
    if not args.out.endswith(".safetensors"):
        raise ConfigError("OUT", f"must end in .safetensors; got {args.out!r}")
    check_output_file("OUT", args.out)
    _check_destination(Path(args.dir), Path(args.out), force=args.force)
    from trainmesh.checkpoint.sharded import CheckpointError, consolidate
    try:
        path = consolidate(args.dir, args.out)
    except CheckpointError as exc:
        raise ConfigError("DIR", str(exc)) from None
    print(f"wrote {path}")
    return 0


def _check_destination(src: Path, out: Path, *, force: bool) -> None:
    """OUT lies outside DIR, and is new unless ``force``."""
    where = out.parent.resolve() / out.name   # a link named OUT is judged by where it sits
    if where.is_relative_to(src.resolve()) or (out.exists() and out.resolve().is_relative_to(src.resolve())):
        raise ConfigError("OUT", f"{str(out)!r} is inside DIR {str(src)!r}; write the consolidated "
                          "model outside the checkpoint directory")
    if (out.exists() or out.is_symlink()) and not force:
        raise ConfigError("OUT", f"{str(out)!r} exists; choose a new file or pass --force to replace it")


def _export_hf(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if (out.parent.resolve() / out.name).is_relative_to(Path(args.dir).resolve()):
        raise ConfigError("OUTDIR", f"{args.out!r} is inside DIR {args.dir!r}; write the export "
                          "outside the checkpoint directory")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError("OUTDIR", f"{args.out!r} exists and is not an empty directory")
    check_output_dir("OUTDIR", args.out)
    from trainmesh.checkpoint.export_hf import export_hf
    print(f"wrote {export_hf(args.dir, out)}")
    return 0
