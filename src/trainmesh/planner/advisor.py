"""The advisor: enumerate every valid layout for a cluster, score each, recommend one.

Layouts considered (``trainmesh plan``): every combination of the axes of :mod:`.space` (tp,
cp, pp, dp, ep, the pipeline schedule and its virtual stages, ZeRO stage and offload, HSDP's
shard group, recompute, the CP exchange, the strategy) that trainmesh's own validation accepts
and no pruning rule of :mod:`.space` leaves out. The global batch defaults to ``8 * gpus *
micro-batch`` sequences, the same for every layout so step times compare like with like.
Sequence parallelism is on whenever ``tp > 1`` without offload.

Ranking: layouts that fit by estimated step time, then the others by memory. DiLoCo layouts
are scored and listed but never recommended (H local steps between synchronisations are not the
same training step). The recommendation
follows the rules of thumb of :mod:`.rules`, in this order: if plain DDP over every GPU fits,
DDP; if only offloading fits, the fastest offload layout; over several nodes, ZeRO alone when it
is within 25% of the fastest layout without offload; otherwise the fastest layout without
offload. Within the chosen group the simplest layout within 5% of its fastest wins (simplest: no
offload, no cp, fewer model-parallel axes, smaller pp, smaller tp, smaller cp, less recompute,
lower ZeRO stage): so cp is recommended where the sequence's activations fit no other way, or
where the estimate puts it more than 5% faster.
:mod:`.rules` says why in one sentence.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from trainmesh.config.parallel import ParallelConfig
from trainmesh.core.errors import ConfigError

from .activations import RECOMPUTE, TRAINMESH, Kernels
from .candidate import Candidate, evaluate, nominal_shape
from .cluster import Cluster
from .rules import Facts, explain
from .shapes import ModelShape
from .space import Problem, groups

TOLERANCE = 0.05
"""A simpler layout within this fraction of the fastest one's step time is preferred."""

ZERO_MARGIN = 0.25
"""Over several nodes, ZeRO alone is preferred to a pipeline/tensor split unless that split is
estimated more than this fraction faster ("fast links")."""

GLOBAL_BATCH_PER_GPU = 8
"""Default global batch: this many micro-batches per GPU."""



@dataclass(frozen=True)
class Plan:
    """The advisor's answer: ranked candidates, the recommendation and why."""

    candidates: list[Candidate]
    recommended: Candidate
    why: str
    notes: list[str] = field(default_factory=list)
    """Assumptions worth telling the user (missing shape, defaults used)."""
    global_batch: int = 0
    cluster: Cluster | None = None
    """The cluster the plan scored, its efficiency resolved."""

    def to_json(self) -> dict[str, Any]:
        """The ``trainmesh plan --json`` object (docs/PLANNER.md)."""
        return {"candidates": [c.to_json() for c in self.candidates],
                "recommended": self.recommended.to_json(), "why": self.why}


def _simplicity(c: Candidate) -> tuple:
    cfg = c.layout
    return (cfg.offload != "none", cfg.cp > 1, (cfg.pp > 1) + (cfg.tp > 1), cfg.shard_size < cfg.dp,
            cfg.pp, cfg.tp, cfg.cp, cfg.ep, cfg.virtual_stages, cfg.cp_comm != "ring",
            RECOMPUTE.index(cfg.recompute), cfg.zero, c.time.total)


def _pick(cands: list[Candidate]) -> Candidate:
    """The simplest of ``cands`` (ranked fastest first) within TOLERANCE of the fastest."""
    fastest = cands[0].time.total
    return min((c for c in cands if c.time.total <= fastest * (1 + TOLERANCE)), key=_simplicity)


def _is_ddp(c: Candidate, cluster: Cluster) -> bool:
    cfg = c.layout
    return cfg.dp == cluster.gpus and cfg.zero == 0 and cfg.offload == "none"


def _recommend(ranked: list[Candidate], cluster: Cluster) -> Candidate:
    """Apply the rules of thumb (module doc of :mod:`.rules`) to the ranked candidates."""
    ranked = [c for c in ranked if c.layout.strategy == "mesh"] or ranked
    fitting = [c for c in ranked if c.fits]
    if not fitting:
        return min(ranked, key=lambda c: c.memory.total)
    ddp = [c for c in fitting if _is_ddp(c, cluster)]
    if ddp:
        return _pick(ddp)
    resident = [c for c in fitting if c.layout.offload == "none"]
    if not resident:
        return _pick(fitting)
    if cluster.nodes > 1:
        zero = [c for c in resident if c.layout.dp == cluster.gpus]
        if zero and zero[0].time.total <= resident[0].time.total * (1 + ZERO_MARGIN):
            return _pick(zero)
    return _pick(resident)


def _notes(model: ModelShape, global_batch: int, defaulted_batch: bool) -> list[str]:
    notes = []
    if not model.has_shape:
        layers, hidden = nominal_shape(model.params)
        missing = " ".join(model.missing_shape_flags())
        notes.append(f"no {missing}: activations are not counted (0) and TP/PP traffic uses a "
                     f"nominal shape of {model.layers or layers} layers, hidden "
                     f"{model.hidden or hidden}")
    if defaulted_batch:
        notes.append(f"global batch {global_batch} sequences ({GLOBAL_BATCH_PER_GPU} micro-batches "
                     f"of {model.micro_batch} per GPU; set --global-batch to change)")
    return notes


def _single_gpu_bytes(model: ModelShape, cluster: Cluster, precision: str, kernels: Kernels,
                      optimizer: str = "adamw") -> float:
    """Least memory the unsharded model needs on one GPU, over the recompute options."""
    recomputes = RECOMPUTE if model.has_shape else ("none",)
    return min(evaluate(ParallelConfig(precision=precision, recompute=r), model, cluster, kernels,
                        optimizer=optimizer).memory.total for r in recomputes)


def _first(ranked: list[Candidate], keep: Callable[[ParallelConfig], bool]) -> Candidate | None:
    """The fastest fitting candidate without offload whose layout passes ``keep``."""
    return next((c for c in ranked if c.fits and c.layout.offload == "none"
                 and c.layout.strategy == "mesh" and keep(c.layout)), None)


def _score(problem: Problem, kernels: Kernels) -> list[Candidate]:
    """Every group's layouts scored up to the first that fits (:func:`.space.groups`)."""
    scored = []
    for group in groups(problem):
        for cfg in group:
            c = evaluate(cfg, problem.model, problem.cluster, kernels, optimizer=problem.optimizer)
            scored.append(c)
            if c.fits:
                break
    return scored


def resolve_efficiency(cluster: Cluster, model: ModelShape, source: str | None = None
                       ) -> tuple[Cluster, str]:
    """``cluster`` with its efficiency set (from the published runs when unset) and the sentence
    saying where it came from (``source`` when the caller set it)."""
    if cluster.efficiency is not None:
        return cluster, source or f"efficiency {cluster.efficiency:.0%} of peak (Cluster.efficiency)"
    from .efficiency import assumed_efficiency
    assumed = assumed_efficiency(cluster.gpu, model.active_params)
    return replace(cluster, efficiency=assumed.efficiency), assumed.source


def plan(model: ModelShape, cluster: Cluster, *, precision: str = "bf16",
         global_batch: int | None = None, kernels: Kernels = TRAINMESH,
         axes_allowed: frozenset[str] = frozenset({"tp", "pp", "cp", "ep"}),
         efficiency_source: str | None = None, optimizer: str = "adamw") -> Plan:
    """Enumerate, score and rank layouts of ``model`` on ``cluster``; recommend one. Without an
    efficiency on ``cluster`` the published runs' (:mod:`.efficiency`) is assumed and said;
    ``efficiency_source`` says where a given one comes from (a calibration run); ``optimizer``
    (adamw, sgd, muon) sets the optimizer states and Muon's step (:func:`~.candidate.evaluate`)."""
    defaulted = global_batch is None
    batch = global_batch or GLOBAL_BATCH_PER_GPU * cluster.gpus * model.micro_batch
    cluster, efficiency = resolve_efficiency(cluster, model, efficiency_source)
    problem = Problem(model, cluster, precision, batch, axes_allowed,
                      model.layers or nominal_shape(model.params)[0], optimizer)
    scored = _score(problem, kernels)
    if not scored:
        raise ConfigError("--global-batch", f"{batch} sequences split evenly over no layout of "
                                            f"{cluster.gpus} GPUs with --micro-batch "
                                            f"{model.micro_batch}; give a multiple of "
                                            f"{cluster.gpus * model.micro_batch}")
    ranked = (sorted((c for c in scored if c.fits), key=lambda c: c.time.total)
              + sorted((c for c in scored if not c.fits), key=lambda c: c.memory.total))
    rec = _recommend(ranked, cluster)
    mesh = [c for c in ranked if c.layout.strategy == "mesh"]
    facts = Facts(cluster=cluster,
                  single_gpu_bytes=_single_gpu_bytes(model, cluster, precision, kernels, optimizer),
                  best_ddp=_first(ranked, lambda cfg: cfg.dp == cluster.gpus and cfg.zero == 0),
                  best_dp_only=_first(ranked, lambda cfg: cfg.dp == cluster.gpus),
                  fits_without_offload=any(c.fits and c.layout.offload == "none" for c in mesh),
                  fits_without_cp=any(c.fits and c.layout.cp == 1 for c in mesh),
                  seq_len=model.seq_len,
                  fastest=mesh[0] if mesh and mesh[0].fits else None)
    notes = [efficiency, *_notes(model, batch, defaulted)]
    return Plan(ranked, rec, explain(rec, facts), notes, batch, cluster)
