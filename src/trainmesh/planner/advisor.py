"""The advisor: enumerate every valid layout for a cluster, score each, recommend one.

Layouts considered (``trainmesh plan``):

* ``dp * cp * pp * tp = gpus``; ``tp`` divides the node size, so a TP group never leaves a node
  (ranks are laid out with tp fastest, :mod:`trainmesh.core.mesh`), and divides ``heads`` and ``hidden`` when
  given; ``pp <= layers``; context parallelism ``cp`` in powers of two up to :data:`MAX_CP`
  when the shape is known and the sequence splits into ``2·cp`` chunks (ZeRO then shards over
  dp x cp).
* ZeRO 0-3 with ``pp = 1``; ZeRO 0-1 with a pipeline (ZeRO-2/3 reduce or gather again for every
  microbatch, which a pipeline's many microbatches make costly: Megatron and DeepSpeed pair PP
  with ZeRO-1). A ZeRO stage over a single replica (``dp = 1``) shards nothing and is only
  considered as the vehicle for CPU offload.
* offload ``none`` or ``cpu`` (``cpu`` needs ZeRO >= 1); recompute ``none``, ``selective`` or
  ``full`` when the shape is known; sequence parallelism on whenever ``tp > 1`` without offload
  (same wire bytes, less activation memory; offload streams gradients to the host before SP
  completes them, so the two exclude each other); schedule 1F1B; microbatches = global batch / (dp * micro-batch).
  The global batch defaults to ``8 * gpus * micro-batch`` sequences, the same for every layout
  so step times compare like with like.

Ranking: layouts that fit by estimated step time, then the others by memory. The recommendation
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

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from trainmesh.config.parallel import ParallelConfig
from trainmesh.core.errors import ConfigError

from .activations import RECOMPUTE
from .candidate import Candidate, evaluate, nominal_shape
from .cluster import Cluster
from .rules import Facts, explain
from .shapes import ModelShape

TOLERANCE = 0.05
"""A simpler layout within this fraction of the fastest one's step time is preferred."""

ZERO_MARGIN = 0.25
"""Over several nodes, ZeRO alone is preferred to a pipeline/tensor split unless that split is
estimated more than this fraction faster ("fast links")."""

GLOBAL_BATCH_PER_GPU = 8
"""Default global batch: this many micro-batches per GPU."""

MAX_CP = 32
"""The largest context-parallel degree scored (sequences of ~1M tokens need about this)."""


@dataclass(frozen=True)
class Plan:
    """The advisor's answer: ranked candidates, the recommendation and why."""

    candidates: list[Candidate]
    recommended: Candidate
    why: str
    notes: list[str] = field(default_factory=list)
    """Assumptions worth telling the user (missing shape, defaults used)."""
    global_batch: int = 0

    def to_json(self) -> dict[str, Any]:
        """The ``trainmesh plan --json`` object (docs/PLANNER.md)."""
        return {"candidates": [c.to_json() for c in self.candidates],
                "recommended": self.recommended.to_json(), "why": self.why}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _tp_ok(tp: int, model: ModelShape, cluster: Cluster) -> bool:
    if cluster.node_size % tp:
        return False
    return all(not dim or dim % tp == 0 for dim in (model.heads, model.hidden))


def _zero_offload(dp: int, pp: int) -> Iterator[tuple[int, str]]:
    for zero in range(4 if pp == 1 else 2):
        if dp > 1 or zero == 0:
            yield zero, "none"
        if zero >= 1:
            yield zero, "cpu"


def layouts(model: ModelShape, cluster: Cluster, *, precision: str,
            global_batch: int) -> list[ParallelConfig]:
    """Every valid layout (see module doc)."""
    max_pp = model.layers or nominal_shape(model.params)[0]
    recomputes = RECOMPUTE if model.has_shape else ("none",)
    out = []
    for tp in _divisors(cluster.gpus):
        if not _tp_ok(tp, model, cluster):
            continue
        for cp in _cp_degrees(cluster.gpus // tp, model):
            for pp in _divisors(cluster.gpus // (tp * cp)):
                dp = cluster.gpus // (tp * cp * pp)
                if pp > max_pp or global_batch % (dp * model.micro_batch):
                    continue
                m = global_batch // (dp * model.micro_batch)
                for (zero, offload) in _zero_offload(dp * cp, pp):
                    for recompute in recomputes:
                        out.append(ParallelConfig(dp=dp, pp=pp, tp=tp, cp=cp, zero=zero,
                                                  microbatches=m, schedule="1f1b",   # SP: not with offload
                                                  sequence_parallel=tp > 1 and offload == "none",
                                                  precision=precision, recompute=recompute,
                                                  offload=offload,
                                                  offload_params=offload != "none" and zero == 3))
    return out


def _cp_degrees(gpus: int, model: ModelShape) -> list[int]:
    """Context-parallel degrees worth scoring: 1, and with a known shape the powers of two up
    to MAX_CP dividing ``gpus`` and splitting the sequence into 2·cp equal chunks."""
    if not model.has_shape:
        return [1]
    return [cp for cp in (1, 2, 4, 8, 16, 32)
            if cp <= MAX_CP and gpus % cp == 0 and model.seq_len % (2 * cp) == 0]


def _simplicity(c: Candidate) -> tuple:
    cfg = c.layout
    return (cfg.offload != "none", cfg.cp > 1, (cfg.pp > 1) + (cfg.tp > 1), cfg.pp, cfg.tp, cfg.cp,
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


def _single_gpu_bytes(model: ModelShape, cluster: Cluster, precision: str) -> float:
    """Least memory the unsharded model needs on one GPU, over the recompute options."""
    recomputes = RECOMPUTE if model.has_shape else ("none",)
    return min(evaluate(ParallelConfig(precision=precision, recompute=r), model, cluster).memory.total
               for r in recomputes)


def _first(ranked: list[Candidate], keep: Callable[[ParallelConfig], bool]) -> Candidate | None:
    """The fastest fitting candidate without offload whose layout passes ``keep``."""
    return next((c for c in ranked if c.fits and c.layout.offload == "none" and keep(c.layout)), None)


def plan(model: ModelShape, cluster: Cluster, *, precision: str = "bf16",
         global_batch: int | None = None) -> Plan:
    """Enumerate, score and rank layouts of ``model`` on ``cluster``; recommend one."""
    defaulted = global_batch is None
    batch = global_batch or GLOBAL_BATCH_PER_GPU * cluster.gpus * model.micro_batch
    configs = layouts(model, cluster, precision=precision, global_batch=batch)
    if not configs:
        raise ConfigError("--global-batch", f"{batch} sequences split evenly over no layout of "
                                            f"{cluster.gpus} GPUs with --micro-batch "
                                            f"{model.micro_batch}; give a multiple of "
                                            f"{cluster.gpus * model.micro_batch}")
    scored = [evaluate(cfg, model, cluster) for cfg in configs]
    ranked = (sorted((c for c in scored if c.fits), key=lambda c: c.time.total)
              + sorted((c for c in scored if not c.fits), key=lambda c: c.memory.total))
    rec = _recommend(ranked, cluster)
    facts = Facts(cluster=cluster, single_gpu_bytes=_single_gpu_bytes(model, cluster, precision),
                  best_ddp=_first(ranked, lambda cfg: cfg.dp == cluster.gpus and cfg.zero == 0),
                  best_dp_only=_first(ranked, lambda cfg: cfg.dp == cluster.gpus),
                  fits_without_offload=any(c.fits and c.layout.offload == "none" for c in ranked),
                  fits_without_cp=any(c.fits and c.layout.cp == 1 for c in ranked),
                  seq_len=model.seq_len,
                  fastest=ranked[0] if ranked[0].fits else None)
    return Plan(ranked, rec, explain(rec, facts), _notes(model, batch, defaulted), batch)
