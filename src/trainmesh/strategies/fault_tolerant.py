"""Fault tolerance (``--fault-tolerant``): data-parallel replicas — the cp x pp x tp ranks of
one dp index (--zero 0), or of one --dp-shard group (--zero 1-3) — that survive the loss of a
replica without a restart (docs/FAULT_TOLERANCE.md)."""
from __future__ import annotations

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

FEATURES: tuple[Feature, ...] = (
    Feature("ft", "fault_tolerant", F, _ft),
)

STRATEGY = Strategy("fault_tolerant", "--fault-tolerant", _ft, RULES, FEATURES,
                    policy="trainmesh.run.ft_steps:QuorumSteps",
                    launcher="trainmesh.run.ft_launch:launch_fault_tolerant")
