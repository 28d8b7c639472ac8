"""Mesh training: DDP, ZeRO 1-3, HSDP and offload over the dp x cp line of a dp x cp x pp x tp
layout (``--strategy mesh``, the default), and ``--allreduce``, DDP's bucket reduction."""
from __future__ import annotations

from trainmesh.core.axes import Feature, Rule
from trainmesh.strategies.base import Strategy

ZERO = ("zero1", "zero2", "zero3")

RULES: tuple[Rule, ...] = (
    # what needs ZeRO (HSDP, offload) cannot pair with --allreduce either
    Rule("--allreduce", lambda c, f: c.allreduce != "native" and (c.zero > 0 or c.strategy != "mesh"),
         "{c.allreduce} reduces DDP's buckets; needs --zero 0 and --strategy mesh (valid "
         "otherwise: native)", {"dp": 2, "zero": 1, "allreduce": "ring"},
         pairs=(*(("allreduce", z) for z in ZERO), ("allreduce", "hsdp"), ("allreduce", "offload"),
                ("allreduce", "ps"), ("allreduce", "diloco"))),
)

FEATURES: tuple[Feature, ...] = (
    Feature("allreduce", "allreduce", {"dp": 2, "allreduce": "ring"},
            lambda c: c.allreduce != "native"),
)

STRATEGY = Strategy("mesh", "--strategy mesh", lambda c: c.strategy == "mesh" and not c.fault_tolerant,
                    RULES, FEATURES, launcher="trainmesh.run.launch:launch_local")
