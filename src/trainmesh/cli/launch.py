"""``trainmesh launch slurm --nodes N [...] -- [train flags]``: print an sbatch script.

The script asks Slurm for N nodes and one task per rank (``--ntasks-per-node``, by default one
per GPU with ``--gpus-per-node``, else 1), and starts the ranks with ``srun``: each task is one
worker of ``trainmesh train``, which forms one job from srun's environment (the master is the
first node of the step, the port derived from the job id). Without ``--gpus-per-node`` the
job asks for no GPU. The layout flags left unset follow the world size (nodes x tasks per
node), as under srun itself; the train flags are validated here, as ``trainmesh train`` would,
before anything is printed.
"""
from __future__ import annotations

import argparse
import re
import shlex
import sys

from trainmesh.core.errors import ConfigError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("launch", help="print a multi-node launch script")
    what = p.add_subparsers(dest="what", metavar="SCHEDULER", parser_class=type(p))
    s = what.add_parser("slurm", help="an sbatch script: one srun task per rank",
                        description=__doc__.splitlines()[0])
    s.add_argument("--nodes", type=int, required=True, help="nodes (hosts) of the job")
    s.add_argument("--gpus-per-node", type=int, default=None,
                   help="GPUs per node, one rank each; omitted: a CPU job that requests no GPU")
    s.add_argument("--ntasks-per-node", type=int, default=None,
                   help="ranks per node (default: --gpus-per-node, else 1)")
    s.add_argument("--cpus-per-task", type=int, default=None,
                   help="CPUs per rank (also its OMP_NUM_THREADS); omitted: the cluster's default")
    s.add_argument("--job-name", default="trainmesh")
    s.add_argument("--partition", default=None, help="the partition (queue) to submit to")
    s.add_argument("--time", default="01:00:00", help="wall-clock limit, in any form sbatch takes")
    s.add_argument("train_flags", nargs=argparse.REMAINDER, help="flags for trainmesh train")
    p.set_defaults(run=run)


def sbatch_script(*, nodes: int, tasks_per_node: int, gpus_per_node: int | None,
                  cpus_per_task: int | None, job_name: str, partition: str | None, time: str,
                  train_flags: list[str], layout: str, python: str = sys.executable) -> str:
    """The batch script (a pure function of its arguments)."""
    directives = [f"--job-name={job_name}", f"--nodes={nodes}", f"--ntasks-per-node={tasks_per_node}"]
    if cpus_per_task:
        directives.append(f"--cpus-per-task={cpus_per_task}")
    if gpus_per_node:
        directives.append(f"--gpus-per-node={gpus_per_node}")
    directives.append(f"--time={time}")
    if partition:
        directives.append(f"--partition={partition}")
    lines = ["#!/bin/bash", *(f"#SBATCH {shlex.quote(d)}" for d in directives),
             f"# trainmesh train on {nodes * tasks_per_node} ranks ({nodes} nodes x {tasks_per_node}): "
             f"{layout}",
             "set -euo pipefail"]
    if cpus_per_task:
        lines.append('export OMP_NUM_THREADS="$SLURM_CPUS_PER_TASK"')
    lines += [
        "# One srun task per rank. The ranks meet on the job's first node, on a port derived from",
        "# the job id; their stores and connections have no authentication: keep the job inside",
        "# the cluster's private network (docs/SECURITY.md). A failed rank ends the others.",
        f"srun --kill-on-bad-exit=1 {shlex.quote(python)} -m trainmesh train {shlex.join(train_flags)}".rstrip(),
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
    for field in ("nodes", "gpus_per_node", "ntasks_per_node", "cpus_per_task"):
        value = getattr(args, field)
        if value is not None and value < 1:
            raise ConfigError("--" + field.replace("_", "-"), f"must be >= 1; got {value}")
    gpus = args.gpus_per_node
    tasks = args.ntasks_per_node or gpus or 1
    if gpus is not None and tasks > gpus:
        raise ConfigError("--ntasks-per-node", f"{tasks} ranks per node but --gpus-per-node {gpus}: "
                          "each rank needs its own GPU")
    from trainmesh.config.train import build_train_config

    from . import build_parser
    from .train import collect
    flags = [f for f in args.train_flags if f != "--"]
    world = args.nodes * tasks
    cfg = build_train_config(collect(build_parser().parse_args(["train", *flags]), True, world=world))
    from trainmesh.core.axes import Facts
    from trainmesh.strategies import table
    table.check_facts(cfg.parallel, Facts(launcher="sbatch"))   # a strategy's own launcher
    if tasks % cfg.parallel.tp:
        raise ConfigError("--tp", f"{cfg.parallel.tp} must divide the {tasks} ranks per node: "
                          "a TP group stays inside a node")
    layout = cfg.parallel.layout.describe()
    print(sbatch_script(nodes=args.nodes, tasks_per_node=tasks, gpus_per_node=gpus,
                        cpus_per_task=args.cpus_per_task, job_name=args.job_name,
                        partition=args.partition, time=args.time, train_flags=flags,
                        layout=layout), end="")
    return 0
