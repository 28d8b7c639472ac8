"""The RPC parameter server (``--strategy ps``): ``--dp`` trainers holding whole fp32 replicas
of the built-in GPT, ``--ps-servers`` servers holding the parameters (docs/PARAMETER_SERVER.md)."""
from __future__ import annotations

from trainmesh.core.axes import Feature, Rule
from trainmesh.strategies.base import Strategy


def _ps(c) -> bool:
    return c.strategy == "ps"


DEFAULTS = "must stay at its default with --strategy ps (fp32 replicas of whole parameters; --dp " \
           "sets the trainers)"
MESH = "needs --strategy mesh (got {c.strategy})"

RULES: tuple[Rule, ...] = (
    Rule("--ps-servers", lambda c, f: not _ps(c) and c.ps_servers != 1, "needs --strategy ps",
         {"ps_servers": 2}),
    Rule("--ps-mode", lambda c, f: not _ps(c) and c.ps_mode != "sync", "needs --strategy ps",
         {"ps_mode": "async"}),
    Rule("--ps-staleness", lambda c, f: c.ps_staleness is not None and not (_ps(c) and c.ps_mode == "async"),
         "bounds async training; needs --strategy ps --ps-mode async",
         {"strategy": "ps", "dp": 2, "ps_staleness": 1}),
    Rule("--tp", lambda c, f: _ps(c) and c.tp > 1, DEFAULTS, {"strategy": "ps", "dp": 2, "tp": 2},
         pairs=(("ps", "tp"), ("ps", "sp"))),       # sequence parallelism needs tp
    Rule("--pp", lambda c, f: _ps(c) and c.pp > 1, DEFAULTS,
         {"strategy": "ps", "dp": 2, "pp": 2, "microbatches": 2}, pairs=(("ps", "pp"),)),
    # HSDP and offload need ZeRO: refused with it
    Rule("--zero", lambda c, f: _ps(c) and c.zero > 0, DEFAULTS, {"strategy": "ps", "dp": 2, "zero": 1},
         pairs=(("ps", "zero1"), ("ps", "zero2"), ("ps", "zero3"), ("ps", "hsdp"), ("ps", "offload"))),
    Rule("--precision", lambda c, f: _ps(c) and c.precision != "fp32", DEFAULTS,
         {"strategy": "ps", "dp": 2, "precision": "bf16"}),
    Rule("--recompute", lambda c, f: _ps(c) and c.recompute != "none", DEFAULTS,
         {"strategy": "ps", "dp": 2, "recompute": "full"}),
    Rule("--min-dp", lambda c, f: _ps(c) and c.min_dp is not None, DEFAULTS,
         {"strategy": "ps", "dp": 2, "min_dp": 2}),
    Rule("--cp", lambda c, f: _ps(c) and c.cp > 1, MESH, {"strategy": "ps", "dp": 2, "cp": 2},
         pairs=(("ps", "cp"),)),
    Rule("--ep", lambda c, f: _ps(c) and c.ep > 1, MESH,
         {"strategy": "ps", "dp": 2, "ep": 2, "experts": 4}, pairs=(("ps", "ep"),)),
    Rule("--fault-tolerant", lambda c, f: _ps(c) and c.fault_tolerant, MESH,
         {"strategy": "ps", "dp": 2, "fault_tolerant": True}, pairs=(("ps", "ft"),)),
    Rule("--strategy", lambda c, f: _ps(c) and f.hub,
         "ps trains the built-in GPT, not --model-dir models; valid: --strategy mesh (dp, ZeRO, "
         "tp, pp, cp, ep) or diloco", {"strategy": "ps", "dp": 2, "hub": True}, needs=("hub",)),
    Rule("--save-dir", lambda c, f: _ps(c) and f.saves, "is not supported with --strategy ps",
         {"strategy": "ps", "dp": 2, "saves": True}, needs=("saves",)),
    # what its trainers' loop does not produce: refused rather than silently left unwritten
    Rule("--eval-every", lambda c, f: _ps(c) and f.run.eval_every is not None,
         "is not supported with --strategy ps: its trainers keep no held-out evaluation; leave "
         "it unset", {"strategy": "ps", "dp": 2, "eval_every": 2}, needs=("run",)),
    Rule("--trace-out", lambda c, f: _ps(c) and f.run.trace_out is not None,
         "is not supported with --strategy ps: its trainers' pushes and pulls are not traced; "
         "leave it unset", {"strategy": "ps", "dp": 2, "trace_out": "trace.json"}, needs=("run",)),
    Rule("--tensorboard", lambda c, f: _ps(c) and f.run.tensorboard is not None,
         "is not supported with --strategy ps: its metrics go to --metrics-out only; leave it "
         "unset", {"strategy": "ps", "dp": 2, "tensorboard": "tb"}, needs=("run",)),
)

FEATURES: tuple[Feature, ...] = (
    Feature("ps", "strategy", {"strategy": "ps", "dp": 2}, _ps),
)

STRATEGY = Strategy("ps", "--strategy ps", _ps, RULES, FEATURES,
                    worker="trainmesh.run.ps_trainer:train_ps")
