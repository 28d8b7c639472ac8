"""Why a layout is recommended, in one sentence, by the usual rules of thumb.

* The model fits on one GPU: plain data parallelism (DDP); nothing to shard.
* It does not fit on one GPU: shard it with ZeRO; if even that does not fit, ZeRO-3 with CPU
  offload (ZeRO-Offload / ZeRO-Infinity).
* Inside one node the fast links make DDP, ZeRO, pipeline or tensor parallelism all affordable:
  memory and the step-time estimate choose.
* Over many nodes with fast links: ZeRO over all GPUs. With slow inter-node links and tight
  memory: tensor parallelism inside each node, pipeline parallelism across nodes, data
  parallelism with ZeRO-1 over what is left.
* Tensor parallelism never crosses a node (the advisor never proposes it).
* A sequence whose activations fit no layout: context parallelism splits it over cp GPUs.

The advisor picks by its estimate (:mod:`.advisor`); this module turns the choice and a few
facts about the alternatives into the sentence, so the reason given is the one the numbers show.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .cluster import Cluster
from .units import fmt_bytes, fmt_seconds

if TYPE_CHECKING:
    from .candidate import Candidate

SHARDED = {1: "optimizer states", 2: "optimizer states and gradients",
           3: "parameters, gradients and optimizer states"}


@dataclass(frozen=True)
class Facts:
    """What the sentence may cite besides the recommended layout itself."""

    cluster: Cluster
    single_gpu_bytes: float
    """Least memory one GPU needs for the whole model (no sharding; any recompute)."""
    best_ddp: Candidate | None
    """Fastest fitting plain-DDP layout over every GPU (None if none fits)."""
    best_dp_only: Candidate | None
    """Fastest fitting layout with neither pp nor tp nor offload (None if none fits)."""
    fits_without_offload: bool
    """Whether any layout fits without offload."""
    fastest: Candidate | None = None
    """The fastest fitting layout of all."""
    fits_without_cp: bool = True
    """Whether any layout without context parallelism fits."""
    seq_len: int = 0
    """Tokens per sequence."""


def _bw(bytes_per_s: float) -> str:
    return fmt_bytes(bytes_per_s) + "/s"


def _split(c: Candidate, cluster: Cluster) -> str:
    cfg = c.layout
    parts = []
    if cfg.cp > 1:
        parts.append(f"context parallelism (cp={cfg.cp}: each sequence split over {cfg.cp} GPUs)")
    if cfg.tp > 1:
        parts.append(f"tensor parallelism inside {'each node' if cluster.nodes > 1 else 'the node'}"
                     f" (tp={cfg.tp})")
    if cfg.pp > 1:
        where = " across nodes" if cluster.spans_nodes(cfg.world_size) else ""
        parts.append(f"pipeline parallelism{where} (pp={cfg.pp})")
    if cfg.dp > 1 or cfg.zero:
        over = f", sharding over dp x cp = {cfg.dp * cfg.cp}" if cfg.cp > 1 and cfg.zero else ""
        parts.append(f"data parallelism with ZeRO-{cfg.zero} (dp={cfg.dp}{over})" if cfg.zero
                     else f"data parallelism (dp={cfg.dp})")
    return ", ".join(parts[:-1]) + (" and " if len(parts) > 1 else "") + parts[-1]


def _describe(c: Candidate, cluster: Cluster) -> str:
    cfg = c.layout
    if cfg.pp == cfg.tp == cfg.cp == 1:
        return f"ZeRO-{cfg.zero} over {cfg.dp} GPUs"
    return _split(c, cluster)


def _recompute(c: Candidate) -> str:
    r = c.layout.recompute
    return "" if r == "none" else f", recomputing activations ({r}) to fit"


def _faster(c: Candidate, facts: Facts) -> str:
    best = facts.fastest
    if best is None or best.time.total >= c.time.total * 0.95:
        return " and as fast as any by the estimate"
    gain = 1 - best.time.total / c.time.total
    return (f" (the estimate puts {_describe(best, facts.cluster)} {gain:.0%} faster, at the cost "
            f"of its extra moving parts)")


def _offload(c: Candidate, facts: Facts, mem: str, need: str) -> str:
    cfg = c.layout
    held = "optimizer states and parameters" if cfg.zero >= 3 else "optimizer states"
    if facts.cluster.gpus == 1:
        opening = f"The model does not fit on one {mem} GPU (it needs {need})"
    elif not facts.fits_without_offload:
        opening = f"The model does not fit in {mem} per GPU even sharded over all {facts.cluster.gpus} GPUs"
    else:
        opening = f"The model needs {need} on one GPU and offloading is estimated fastest"
    return (f"{opening}, so ZeRO-{cfg.zero} with CPU offload keeps the {held} in host memory"
            f"{_recompute(c)}.")


def explain(c: Candidate, facts: Facts) -> str:
    """One sentence: why ``c`` (the recommendation) for this model and cluster."""
    cl, cfg = facts.cluster, c.layout
    mem, need = fmt_bytes(cl.gpu_mem_bytes), fmt_bytes(facts.single_gpu_bytes)
    if not c.fits:
        return (f"No layout fits in {mem} per GPU; the smallest needs {fmt_bytes(c.memory.total)} "
                f"per GPU, so add GPUs or memory, or shorten the micro-batch or sequence.")
    if cfg.offload != "none":
        return _offload(c, facts, mem, need)
    if cfg.cp > 1 and not facts.fits_without_cp:
        return (f"Without context parallelism no layout holds the activations of a "
                f"{facts.seq_len}-token sequence in {mem} per GPU, so it is split with "
                f"{_split(c, cl)}{_recompute(c)}.")
    if cfg.pp == cfg.tp == cfg.cp == 1 and cfg.zero == 0:
        need = fmt_bytes(c.memory.total)
        if cfg.dp == 1:
            return (f"The model fits on one GPU ({need} of {mem}), so train it there with no "
                    f"parallelism{_recompute(c)}.")
        return (f"The model fits on one GPU ({need} of {mem}), so plain data parallelism (DDP) over "
                f"{cfg.dp} GPUs is the simplest layout{_recompute(c)}{_faster(c, facts)}.")
    if facts.single_gpu_bytes <= cl.gpu_mem_bytes:
        ddp = f" ({fmt_seconds(c.time.total)} against {fmt_seconds(facts.best_ddp.time.total)} per step)" \
            if facts.best_ddp else ""
        return (f"The model fits on one GPU ({need} of {mem}), but {_describe(c, cl)} is estimated "
                f"faster than plain DDP{ddp}{_recompute(c)}.")
    opening = f"The model does not fit on one GPU ({need} > {mem})"
    if cfg.pp == cfg.tp == cfg.cp == 1:
        links = (f"the {_bw(cl.inter_node_bw)} links between nodes are fast enough for its traffic"
                 if cl.nodes > 1 else f"the node's {_bw(cl.intra_node_bw)} links carry its traffic cheaply")
        return (f"{opening}, so ZeRO-{cfg.zero} shards the {SHARDED[cfg.zero]} over all {cfg.dp} GPUs "
                f"and {links}{_recompute(c)}.")
    if cl.nodes == 1:
        return (f"{opening}, and inside one node the {_bw(cl.intra_node_bw)} links make model "
                f"parallelism cheap, so it is split with {_split(c, cl)}{_recompute(c)}.")
    if facts.best_dp_only is None:
        reason = "not even ZeRO-3 alone fits it"
    else:
        reason = (f"over the {_bw(cl.inter_node_bw)} links between nodes ZeRO alone would take "
                  f"{fmt_seconds(facts.best_dp_only.time.total)} per step against "
                  f"{fmt_seconds(c.time.total)}")
    return f"{opening} and {reason}, so it is split with {_split(c, cl)}{_recompute(c)}."
