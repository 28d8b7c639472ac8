"""Fault tolerance (``--fault-tolerant``): data-parallel replicas — the cp x pp x tp ranks of
one dp index (--zero 0), or of one --dp-shard group (--zero 1-3) — that survive the loss of a
replica without a restart (docs/FAULT_TOLERANCE.md)."""
from __future__ import annotations

import math

from trainmesh.core.axes import Feature, Rule
from trainmesh.strategies.base import Strategy


def _ft(c) -> bool:
    return c.fault_tolerant


def _shard(c) -> int:
    return c.dp if c.dp_shard is None else c.dp_shard


def replica_dp(c) -> int:
    """The dp indices of one replica: the --dp-shard group under ZeRO, else one."""
    return _shard(c) if c.zero > 0 else 1


NOT = "is not supported with --fault-tolerant, whose replicas reduce across each other " \
      "themselves (valid: {valid})"
F = {"dp": 2, "fault_tolerant": True}

RULES: tuple[Rule, ...] = (
    Rule("--fault-tolerant", lambda c, f: _ft(c) and c.dp < 2,
         "needs --dp >= 2 (replicas that can stand in for each other); got --dp {c.dp}",
         {"fault_tolerant": True}),
    Rule("--zero", lambda c, f: _ft(c) and c.zero > 0 and _shard(c) == c.dp,
         "{c.zero} with --fault-tolerant shards inside each replica: needs --dp-shard S < --dp "
         "(replicas of S ranks); valid without it: 0", {**F, "zero": 1}),
    Rule("--ep", lambda c, f: _ft(c) and (replica_dp(c) * c.cp) % c.ep != 0,
         lambda c, f: f"{c.ep} with --fault-tolerant spreads experts inside one replica (a "
                      f"replica lost must not take experts with it): must divide its dp x cp = "
                      f"{replica_dp(c)} x {c.cp} (raise --dp-shard)",
         {**F, "ep": 2, "experts": 2}),
    Rule("--min-dp", lambda c, f: _ft(c) and c.min_dp is not None,
         NOT.format(valid="unset: replicas come and go per step"), {**F, "min_dp": 2}),
    Rule("--offload", lambda c, f: _ft(c) and c.offload != "none",
         NOT.format(valid="none: the live state is copied from memory"),
         {"dp": 4, "dp_shard": 2, "zero": 1, "offload": "cpu", "fault_tolerant": True},
         pairs=(("ft", "offload"),)),
    Rule("--allreduce", lambda c, f: _ft(c) and c.allreduce != "native", NOT.format(valid="native"),
         {**F, "allreduce": "ring"}, pairs=(("ft", "allreduce"),)),
    # its launcher runs one elastic agent per replica: no other launcher can start it
    Rule("--fault-tolerant", lambda c, f: _ft(c) and f.launcher == "torchrun",
         "runs its replicas under trainmesh's own launcher (one elastic agent per replica); start "
         "it with `trainmesh train`, not under torchrun or srun", {**F, "launcher": "torchrun"},
         needs=("launcher",)),
    Rule("--fault-tolerant", lambda c, f: _ft(c) and f.launcher == "sbatch",
         "runs its replicas under trainmesh's own launcher, not srun: start a coordinator and one "
         "`trainmesh train --fault-tolerant` per host (docs/FAULT_TOLERANCE.md)",
         {**F, "launcher": "sbatch"}, needs=("launcher",)),
)


def _across(f) -> dict:
    """The flags of a replica of a run across hosts, and what was given of them."""
    r = f.run
    return {"--coordinator": r.coordinator, "--replica-id": r.replica_id, "--replicas": r.replicas}


def _missing(f, flag: str) -> bool:
    """A replica across hosts given some of its flags, and ``flag`` is the first not given."""
    given = _across(f)
    return (any(v is not None for v in given.values())
            and next((k for k, v in given.items() if v is None), None) == flag)


def coordinator_ok(spec: str) -> bool:
    """``HOST:PORT[,HOST:PORT...]`` (ports 1..65535), or ``@FILE`` (read by the replica at each
    connection: the file may name other addresses later)."""
    if spec.startswith("@") and len(spec) > 1:
        return True
    for address in (a.strip() for a in spec.split(",")):
        host, sep, port = address.rpartition(":")
        if not sep or not host.strip("[]") or not port.isdigit() or not 0 < int(port) <= 65535:
            return False
    return True


def _whole(c) -> int:
    """Rows of a --pp global batch: every quorum of 1..replicas cuts it into microbatches."""
    return math.lcm(*range(1, c.dp // replica_dp(c) + 1)) * c.microbatches


ACROSS = "runs a replica of a fault-tolerant run across hosts; needs --fault-tolerant"
NEEDS = "a replica of a run across hosts needs --coordinator HOST:PORT, --replica-id I and --replicas R"
HOSTS = {**F, "coordinator": "127.0.0.1:1", "replica_id": 0, "replicas": 2}

RUN_RULES: tuple[Rule, ...] = (
    # what a run across hosts needs, checked where TrainConfig checks its other flags
    Rule("--secret-file", lambda c, f: f.run.secret_file is not None and f.run.coordinator is None,
         "gives the secret of a fault-tolerant run across hosts; needs --fault-tolerant "
         "--coordinator HOST:PORT (a run on one host makes its own)",
         {**F, "secret_file": "secret"}, needs=("run",)),
    *(Rule(flag, lambda c, f, flag=flag: not _ft(c) and _across(f)[flag] is not None, ACROSS,
           {flag[2:].replace("-", "_"): value}, needs=("run",))
      for flag, value in (("--coordinator", "127.0.0.1:1"), ("--replica-id", 0), ("--replicas", 2))),
    *(Rule(flag, lambda c, f, flag=flag: _ft(c) and _missing(f, flag), NEEDS,
           {k: v for k, v in HOSTS.items() if k != flag[2:].replace("-", "_")}, needs=("run",))
      for flag in ("--coordinator", "--replica-id", "--replicas")),
    Rule("--replicas", lambda c, f: _ft(c) and f.run.replicas is not None
         and f.run.replicas != c.dp // replica_dp(c),
         lambda c, f: f"{f.run.replicas} disagrees with the layout: --dp {c.dp} makes "
                      f"{c.dp // replica_dp(c)} replicas of {replica_dp(c)} dp index(es) (leave "
                      "--dp unset to derive it)", {**HOSTS, "dp": 4}, needs=("run",)),
    Rule("--replica-id", lambda c, f: _ft(c) and None not in _across(f).values()
         and f.run.replica_id >= f.run.replicas,
         lambda c, f: f"must be in 0..{f.run.replicas - 1} (--replicas {f.run.replicas}); got "
                      f"{f.run.replica_id}",
         {**HOSTS, "replica_id": 2}, needs=("run",)),
    Rule("--coordinator", lambda c, f: _ft(c) and None not in _across(f).values()
         and not coordinator_ok(f.run.coordinator),
         "must be HOST:PORT of `trainmesh coordinator` (several comma-separated, or @FILE "
         "listing them; e.g. 10.0.0.1:29400); got {f.run.coordinator!r}",
         {**HOSTS, "coordinator": "nowhere"}, needs=("run",)),
    Rule("--global-batch", lambda c, f: _ft(c) and f.run.global_batch < c.dp,
         "must be at least --dp {c.dp} with --fault-tolerant (each replica takes rows of it)",
         {**F, "dp": 4, "global_batch": 3}, needs=("run",)),
    Rule("--global-batch", lambda c, f: _ft(c) and c.pp > 1 and f.run.global_batch % _whole(c) != 0,
         lambda c, f: f"must be divisible by {_whole(c)} with --fault-tolerant --pp (each quorum "
                      f"of 1..{c.dp // replica_dp(c)} replicas cuts its rows into --microbatches "
                      f"{c.microbatches} equal microbatches); got {f.run.global_batch}",
         {**F, "dp": 3, "pp": 2, "microbatches": 2, "global_batch": 6}, needs=("run",)),
)
"""Fault tolerance's rules on the run's own flags (a replica across hosts, the global batch)."""

FEATURES: tuple[Feature, ...] = (
    Feature("ft", "fault_tolerant", F, _ft),
)

STRATEGY = Strategy("fault_tolerant", "--fault-tolerant", _ft, RULES + RUN_RULES, FEATURES,
                    policy="trainmesh.run.ft_steps:QuorumSteps",
                    launcher="trainmesh.run.ft_launch:launch_fault_tolerant")
