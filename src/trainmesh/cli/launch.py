"""``trainmesh launch slurm [train flags] --nodes N --gpus-per-node G``: print an sbatch script.

The script runs one ``torchrun`` per node through ``srun``; the torchruns meet through a c10d
rendezvous on the first node and each starts G workers of ``trainmesh train``. The train flags
are validated here, as ``trainmesh train`` would, before anything is printed.
"""
from __future__ import annotations

import argparse
import re
import shlex

from trainmesh.core.errors import ConfigError

PORT = 29500


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("launch", help="print a multi-node launch script")
    what = p.add_subparsers(dest="what", metavar="SCHEDULER", parser_class=type(p))
    s = what.add_parser("slurm", help="an sbatch script using srun + torchrun",
                        description=__doc__.splitlines()[0])
    s.add_argument("--nodes", type=int, required=True)
    s.add_argument("--gpus-per-node", type=int, required=True)
    s.add_argument("--job-name", default="trainmesh")
    s.add_argument("--partition", default=None)
    s.add_argument("--time", default="01:00:00", help="wall-clock limit HH:MM:SS")
    s.add_argument("train_flags", nargs=argparse.REMAINDER, help="flags for trainmesh train")
    p.set_defaults(run=run)


def sbatch_script(*, nodes: int, gpus_per_node: int, job_name: str, partition: str | None,
                  time: str, train_flags: list[str]) -> str:
    lines = ["#!/bin/bash", f"#SBATCH --job-name={job_name}", f"#SBATCH --nodes={nodes}",
             "#SBATCH --ntasks-per-node=1", f"#SBATCH --gpus-per-node={gpus_per_node}",
             f"#SBATCH --time={time}"]
    if partition:
        lines.append(f"#SBATCH --partition={partition}")
    lines += [
        "set -euo pipefail",
        'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "# restarted workers get a fresh store (gloo reconnects to stale peers otherwise); rank 0",
        "# then serves it on the interface of the master address only. Stores have no",
        "# authentication: keep the job inside a private cluster network (docs/SECURITY.md).",
        "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1",
        "srun torchrun \\",
        '  --nnodes "$SLURM_NNODES" \\',
        f"  --nproc-per-node {gpus_per_node} \\",
        '  --rdzv-backend c10d --rdzv-id "$SLURM_JOB_ID" \\',
        f'  --rdzv-endpoint "$head:{PORT}" \\',
        f"  -m trainmesh train {shlex.join(train_flags)}".rstrip(),
    ]
    return "\n".join(lines) + "\n"


SLURM_TIME = re.compile(r"(\d+(-\d+)?(:\d\d){0,2}|\d+-\d+|UNLIMITED|unlimited|infinite)")
"""Slurm's --time forms: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS, unlimited."""
SLURM_NAME = re.compile(r"[\w.+-]+")
"""A job name or partition that stays one word of its ``#SBATCH`` line."""


def _check_script_flags(args: argparse.Namespace) -> None:
    """The values that go into ``#SBATCH`` lines, each one word of Slurm's forms."""
    for flag, value in (("--job-name", args.job_name), ("--partition", args.partition)):
        if value is not None and not SLURM_NAME.fullmatch(value):
            raise ConfigError(flag, f"must be one word of letters, digits and ._+-; got {value!r}")
    if not SLURM_TIME.fullmatch(args.time):
        raise ConfigError("--time", f"must be a Slurm time limit (MM, HH:MM:SS, D-HH:MM:SS or "
                          f"unlimited); got {args.time!r}")


def run(args: argparse.Namespace) -> int:
    if getattr(args, "what", None) != "slurm":
        raise ConfigError("launch", "name the scheduler: trainmesh launch slurm ...")
    _check_script_flags(args)
    for field in ("nodes", "gpus_per_node"):
        if getattr(args, field) < 1:
            raise ConfigError(field.replace("_", "-"), f"must be >= 1; got {getattr(args, field)}")
    from trainmesh.config.train import build_train_config

    from . import build_parser
    from .train import collect
    flags = [f for f in args.train_flags if f != "--"]
    train_args = build_parser().parse_args(["train", *flags])
    cfg = build_train_config(collect(train_args, True))
    world = args.nodes * args.gpus_per_node
    if cfg.parallel.world_size != world:
        raise ConfigError("dp*cp*pp*tp", f"{cfg.parallel.world_size} must equal nodes x gpus-per-node = {world}")
    if args.gpus_per_node % cfg.parallel.tp:
        raise ConfigError("tp", f"{cfg.parallel.tp} must divide --gpus-per-node {args.gpus_per_node}: "
                          "a TP group stays inside a node")
    print(sbatch_script(nodes=args.nodes, gpus_per_node=args.gpus_per_node, job_name=args.job_name,
                        partition=args.partition, time=args.time, train_flags=flags), end="")
    return 0
