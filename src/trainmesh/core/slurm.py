"""The job a Slurm step describes: who this task is, and where its tasks meet.

Under ``srun`` every task has ``SLURM_PROCID`` (its rank in the step), ``SLURM_NTASKS`` (the
step's size), ``SLURM_LOCALID`` (its index on its node), ``SLURM_NODEID`` and the step's node
list in Slurm's hostlist syntax (``node[1-3,5]``, ``a1,b[01-02]``). Without a ``MASTER_ADDR``
the tasks meet on the first host of that list, on a port derived from the job and step ids:
every task computes the same address and port, and two steps of one job (or two jobs sharing a
node) get different ports.

A batch script (``sbatch``) and an ``salloc`` shell carry ``SLURM_PROCID`` too, but are no task
of a step: only ``srun`` sets ``SLURM_STEP_ID`` together with ``SLURM_STEP_NUM_TASKS``.
"""
from __future__ import annotations

import itertools
import re
from collections.abc import Mapping
from dataclasses import dataclass

PORT_BASE = 20000
"""Derived ports lie in [PORT_BASE, PORT_BASE + PORT_SPAN): unprivileged, below Linux's
ephemeral range (32768-60999), where the kernel picks client ports."""
PORT_SPAN = 10000
STEPS_PER_JOB = 16
"""Consecutive steps of a job get consecutive ports; consecutive jobs are this far apart."""
BATCH_STEPS = {"batch", "extern", "interactive", "4294967294", "4294967293", "4294967292"}
"""Step ids of a batch script, the external step and an interactive allocation, not of an srun."""


@dataclass(frozen=True)
class SlurmTask:
    """One task of an srun step."""

    rank: int
    world: int
    local_rank: int
    local_world: int
    nodes: tuple[str, ...]
    """The step's hosts, in Slurm's order (the first is the master)."""
    job_id: int
    step_id: int

    @property
    def master_addr(self) -> str:
        return self.nodes[0]

    @property
    def master_port(self) -> int:
        return derived_port(self.job_id, self.step_id)


def derived_port(job_id: int, step_id: int) -> int:
    """The port the tasks of step ``step_id`` of job ``job_id`` meet on."""
    return PORT_BASE + (job_id * STEPS_PER_JOB + step_id % STEPS_PER_JOB) % PORT_SPAN


def _top_level_split(spec: str) -> list[str]:
    """``spec`` cut at the commas outside brackets."""
    parts, depth, current = [], 0, []
    for ch in spec:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    parts.append("".join(current))
    return [p.strip() for p in parts if p.strip()]


def _bracket(body: str) -> list[str]:
    """``1-3,5`` -> ["1", "2", "3", "5"]; zero padding kept (``01-02`` -> ["01", "02"])."""
    out = []
    for item in body.split(","):
        lo, sep, hi = item.strip().partition("-")
        if not sep:
            out.append(lo)
            continue
        if not (lo.isdigit() and hi.isdigit()) or int(hi) < int(lo):
            raise ValueError(f"bad range {item!r} in a Slurm host list")
        out += [str(i).zfill(len(lo)) for i in range(int(lo), int(hi) + 1)]
    return out


def expand_hostlist(spec: str) -> list[str]:
    """Slurm's hostlist syntax expanded, in order: ``node[1-3,5]`` -> node1, node2, node3, node5;
    ``a1,b[01-02]`` -> a1, b01, b02; several bracket groups in one name multiply
    (``r[1-2]n[1-2]`` -> r1n1, r1n2, r2n1, r2n2), as ``scontrol show hostnames`` does."""
    hosts: list[str] = []
    for token in _top_level_split(spec):
        pieces = re.split(r"(\[[^\]]*\])", token)
        if any("[" in p[1:-1] if p.startswith("[") else ("[" in p or "]" in p) for p in pieces):
            raise ValueError(f"unbalanced brackets in the Slurm host list {spec!r}")
        choices = [_bracket(p[1:-1]) if p.startswith("[") else [p] for p in pieces]
        hosts += ["".join(combo) for combo in itertools.product(*choices)]
    return hosts


def expand_counts(spec: str) -> list[int]:
    """Slurm's tasks-per-node syntax expanded: ``2(x3),1`` -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for item in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if m is None:
            raise ValueError(f"bad tasks-per-node value {spec!r}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def is_srun_task(env: Mapping[str, str]) -> bool:
    """Whether ``env`` is a task of an srun step (not a batch script or an salloc shell)."""
    return ("SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env
            and env.get("SLURM_STEP_ID", "batch") not in BATCH_STEPS)


def slurm_task(env: Mapping[str, str]) -> SlurmTask | None:
    """This srun task, from ``env``; None outside an srun step. A value Slurm would never write
    raises ValueError naming it."""
    if not is_srun_task(env):
        return None
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "")
    nodes = tuple(expand_hostlist(nodelist)) if nodelist else ()
    if not nodes:
        raise ValueError("SLURM_STEP_NODELIST / SLURM_NODELIST: empty under srun")
    node = int(env.get("SLURM_NODEID", "0"))
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", "")
    counts = expand_counts(per_node) if per_node else []
    if node < len(counts):
        local_world = counts[node]
    else:
        plain = env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
        local_world = int(plain) if plain.isdigit() else 1
    return SlurmTask(rank=int(env["SLURM_PROCID"]),
                     world=int(env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS", "1")),
                     local_rank=int(env.get("SLURM_LOCALID", "0")), local_world=local_world,
                     nodes=nodes, job_id=int(env.get("SLURM_JOB_ID", env.get("SLURM_JOBID", "0"))),
                     step_id=int(env["SLURM_STEP_ID"]))
