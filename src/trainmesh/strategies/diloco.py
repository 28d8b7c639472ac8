"""DiLoCo (``--strategy diloco``): each replica — the tp x pp x cp ranks of one dp index, or
with ZeRO inside it one ``--dp-shard`` group — takes ``--inner-steps`` local steps, then the
replicas average their parameter change and apply it with an outer Nesterov step
(docs/DILOCO.md)."""
from __future__ import annotations

from trainmesh.core.axes import Feature, Rule
from trainmesh.strategies.base import Strategy


def _diloco(c) -> bool:
    return c.strategy == "diloco"


def _shard(c) -> int:
    return c.dp if c.dp_shard is None else c.dp_shard


NEEDS = "sets DiLoCo's synchronisation; needs --strategy diloco"
NOT = "is not supported with --strategy diloco: "
D = {"strategy": "diloco", "dp": 2}

RULES: tuple[Rule, ...] = (
    Rule("--inner-steps", lambda c, f: not _diloco(c) and c.inner_steps != 500, NEEDS,
         {"inner_steps": 4}),
    Rule("--outer-lr", lambda c, f: not _diloco(c) and c.outer_lr != 0.7, NEEDS, {"outer_lr": 0.5}),
    Rule("--outer-momentum", lambda c, f: not _diloco(c) and c.outer_momentum != 0.9, NEEDS,
         {"outer_momentum": 0.5}),
    Rule("--outer-momentum", lambda c, f: _diloco(c) and c.outer_momentum >= 1,
         "must be in [0, 1); got {c.outer_momentum}", {**D, "outer_momentum": 1.0}),
    Rule("--zero", lambda c, f: _diloco(c) and c.zero > 0 and _shard(c) == c.dp,
         "{c.zero} with --strategy diloco shards inside each replica: needs --dp-shard S < --dp "
         "(replicas of S dp ranks, synchronised every --inner-steps); valid without it: 0 (a "
         "replica per dp index)", {**D, "zero": 1}),
    Rule("--ep", lambda c, f: _diloco(c) and c.ep > 1,
         NOT + "an ep group spans several replicas, whose all-to-all would couple them every step",
         {**D, "ep": 2, "experts": 2}, pairs=(("diloco", "ep"),)),
    Rule("--cp", lambda c, f: _diloco(c) and c.cp > 1 and c.zero > 0,
         NOT + "a replica's ZeRO group would span its dp-shard x cp ranks (use --zero 0 with --cp)",
         {**D, "cp": 2, "dp_shard": 1, "zero": 1}),
    Rule("--fault-tolerant", lambda c, f: _diloco(c) and c.fault_tolerant,
         NOT + "fault-tolerant replicas synchronise every step", {**D, "fault_tolerant": True},
         pairs=(("diloco", "ft"),)),
    Rule("--min-dp", lambda c, f: _diloco(c) and c.min_dp is not None,
         NOT + "the replicas' inner states do not survive a resize (leave --min-dp unset)",
         {**D, "min_dp": 2}),
)

FEATURES: tuple[Feature, ...] = (
    # one inner step, outer lr 1, no outer momentum: DP exactly with SGD and no clipping
    Feature("diloco", "strategy", {**D, "inner_steps": 1, "outer_lr": 1.0, "outer_momentum": 0.0},
            _diloco),
)

STRATEGY = Strategy("diloco", "--strategy diloco", _diloco, RULES, FEATURES,
                    grad_sync="trainmesh.data_parallel.diloco:wrap")
