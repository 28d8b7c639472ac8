"""The advisor: enumerate every valid layout for a cluster, score each, recommend one.

Layouts considered (``trainmesh plan``):

* ``dp * pp * tp = gpus``; ``tp`` divides the node size, so a TP group never leaves a node
  (ranks are laid out with tp fastest, DESIGN.md), and divides ``heads`` and ``hidden`` when
  given; ``pp <= layers``.
* ZeRO 0-3 with ``pp = 1``; ZeRO 0-1 with a pipeline (ZeRO-2/3 reduce or gather again for every
  microbatch, which a pipeline's many microbatches make costly: Megatron and DeepSpeed pair PP
  with ZeRO-1). A ZeRO stage over a single replica (``dp = 1``) shards nothing and is only
  considered as the vehicle for CPU offload.
* offload ``none`` or ``cpu`` (``cpu`` needs ZeRO >= 1); recompute ``none``, ``selective`` or
  ``full`` when the shape is known; sequence parallelism on whenever ``tp > 1`` (same wire bytes,
  less activation memory); schedule 1F1B; microbatches = global batch / (dp * micro-batch).
  The global batch defaults to ``8 * gpus * micro-batch`` sequences, the same for every layout
  so step times compare like with like.

Ranking: layouts that fit by estimated step time, then the others by memory. The recommendation
is the simplest fitting layout within 5% of the fastest (simplest: no offload, fewer
model-parallel axes, lower ZeRO stage, less recompute, smaller tp, smaller pp); :mod:`.rules`
says why in one sentence.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ..config import ParallelConfig
from ..errors import ConfigError
from .activations import RECOMPUTE
from .candidate import Candidate, evaluate, nominal_shape
from .cluster import Cluster
from .rules import Facts, explain
from .shapes import ModelShape

TOLERANCE = 0.05
"""A simpler layout within this fraction of the fastest one's step time is preferred."""

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

    def to_json(self) -> dict[str, Any]:
        """The ``trainmesh plan --json`` object of CONTRACT.md."""
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
        for pp in _divisors(cluster.gpus // tp):
            dp = cluster.gpus // (tp * pp)
            if pp > max_pp or global_batch % (dp * model.micro_batch):
                continue
            m = global_batch // (dp * model.micro_batch)
            for (zero, offload) in _zero_offload(dp, pp):
                for recompute in recomputes:
                    out.append(ParallelConfig(dp=dp, pp=pp, tp=tp, zero=zero, microbatches=m,
                                              schedule="1f1b", sequence_parallel=tp > 1,
                                              precision=precision, recompute=recompute,
                                              offload=offload))
    return out


def _simplicity(c: Candidate) -> tuple:
    cfg = c.layout
    return (cfg.offload != "none", (cfg.pp > 1) + (cfg.tp > 1), cfg.zero,
            RECOMPUTE.index(cfg.recompute), cfg.tp, cfg.pp, c.time.total)


def _recommend(ranked: list[Candidate]) -> Candidate:
    fitting = [c for c in ranked if c.fits]
    if not fitting:
        return min(ranked, key=lambda c: c.memory.total)
    fastest = fitting[0].time.total
    near = [c for c in fitting if c.time.total <= fastest * (1 + TOLERANCE)]
    return min(near, key=_simplicity)


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
    rec = _recommend(ranked)
    single = evaluate(ParallelConfig(precision=precision, microbatches=batch // model.micro_batch),
                      model, cluster)
    zero_only = [c for c in ranked if c.fits and c.layout.pp == c.layout.tp == 1
                 and c.layout.offload == "none"]
    facts = Facts(cluster=cluster, single_gpu_bytes=single.memory.total,
                  best_dp_only=zero_only[0] if zero_only else None,
                  fits_without_offload=any(c.fits and c.layout.offload == "none" for c in ranked))
    return Plan(ranked, rec, explain(rec, facts), _notes(model, batch, defaulted), batch)
