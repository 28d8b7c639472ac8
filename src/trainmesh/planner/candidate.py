"""One layout scored by the planner: memory per GPU, traffic per step, estimated step time.

A layout is :class:`trainmesh.config.parallel.ParallelConfig` (the same record ``trainmesh train`` takes
and the metrics summary prints). :func:`evaluate` scores it for a model on a cluster under the
models of :mod:`.memory`, :mod:`.activations`, :mod:`.traffic` and :mod:`.steptime`. The numbers
describe the busiest rank: the first pipeline stage (most microbatches in flight) or the last
(logits), whichever needs more. Context parallelism divides the tokens (activations, compute,
TP/PP traffic) by cp, adds the K/V ring's traffic (``cp``) and widens the DP group to dp x cp.

When the model's shape is not given, activations are 0 and a nominal shape (``h = 128*L``,
``Psi = 12*L*h^2``, the proportions of GPT-3 and Llama) sizes the TP/PP traffic, the attention
FLOPs and the ``pp <= layers`` limit.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from trainmesh.config.parallel import ParallelConfig
from trainmesh.context_parallel.traffic import cp_bytes_per_layer

from .activations import inflight_stages, megatron_layer_bytes
from .cluster import Cluster
from .memory import MemoryBreakdown, bytes_per_param, element_bytes, model_states
from .shapes import ModelShape
from .steptime import StepTime, flops_per_token, offload_seconds, step_time
from .traffic import (
    Traffic,
    data_parallel_ops,
    empty,
    other_ops,
    pp_ops,
    ring_factor,
    total_payload,
    tp_ops,
    wire_bytes,
    zero3_regathers,
)

BUCKET_BYTES = 25 * 2**20
"""Gradient bucket (``--bucket-mb`` default); two are in flight while DP reduces."""


def nominal_shape(params: float) -> tuple[int, int]:
    """(layers, hidden) of a transformer with ``params`` parameters and h = 128 L."""
    hidden = (128 * params / 12) ** (1 / 3)
    return max(1, round(hidden / 128)), max(1, round(hidden))


@dataclass(frozen=True)
class Candidate:
    """A layout with its memory, traffic and time."""

    layout: ParallelConfig
    memory: MemoryBreakdown
    traffic: Traffic
    """Payload bytes per step of the busiest rank, axis -> op -> bytes."""
    wire: dict[str, float]
    """Ring wire bytes per step of that rank, per axis."""
    time: StepTime
    fits: bool

    @property
    def comm_bytes_per_step(self) -> float:
        return total_payload(self.traffic)

    def to_json(self) -> dict[str, Any]:
        """One entry of ``candidates`` in ``trainmesh plan --json`` (docs/PLANNER.md)."""
        return {"layout": self.layout.layout(), "memory_per_gpu_bytes": self.memory.to_json(),
                "comm_bytes_per_step": int(round(self.comm_bytes_per_step)), "fits": self.fits,
                "est_step_time_s": round(self.time.total, 6)}


def _shape(model: ModelShape) -> tuple[int, int]:
    if model.layers and model.hidden:
        return model.layers, model.hidden
    layers, hidden = nominal_shape(model.params)
    return model.layers or layers, model.hidden or hidden


def _stage_layers(layers: int, pp: int, rank: int) -> int:
    """Blocks on pipeline ``rank``: as even as possible, the first ranks take the remainder."""
    return layers // pp + (1 if rank < layers % pp else 0)


def _activations(model: ModelShape, cfg: ParallelConfig, rank: int, layers: int) -> float:
    if not model.has_shape:
        return 0.0
    seq = model.seq_len // cfg.cp            # context parallelism: each rank s/cp tokens
    kw = dict(seq=seq, batch=model.micro_batch, hidden=model.hidden, heads=model.heads,
              tp=cfg.tp, sequence_parallel=cfg.sequence_parallel,
              value_bytes=element_bytes(cfg.precision))
    inflight = inflight_stages(cfg.schedule, pp=cfg.pp, microbatches=cfg.microbatches, rank=rank,
                               virtual_stages=cfg.virtual_stages)
    total = megatron_layer_bytes(recompute=cfg.recompute, **kw) * layers * inflight
    if cfg.recompute == "full":  # one layer rematerialised during its backward
        total += megatron_layer_bytes(recompute="none", **kw)
    if model.vocab and rank == cfg.pp - 1:  # output layer (Korthikanti): 4sbh/t * (1 + V/h)
        sbh = seq * model.micro_batch * model.hidden
        total += 4 * sbh / cfg.tp * (1 + model.vocab / model.hidden) * inflight
    return total


def _overhead(cfg: ParallelConfig, cluster: Cluster, psi_rank: float, layers: int, known: bool) -> float:
    extra = 2 * BUCKET_BYTES if cfg.dp * cfg.cp > 1 else 0
    if cfg.zero == 3 and not zero3_regathers(cfg):  # the stage, gathered for the whole step
        extra += psi_rank * element_bytes(cfg.precision)
    elif cfg.zero == 3 and known:  # two layers' gathered parameters (prefetch)
        extra += 2 * psi_rank / max(layers, 1) * element_bytes(cfg.precision)
    return cluster.framework_overhead_bytes + extra


def _rank_traffic(model: ModelShape, cfg: ParallelConfig, rank: int, layers: int,
                  hidden: int, psi_rank: float) -> Traffic:
    e = element_bytes(cfg.precision)
    tokens = model.tokens_per_microbatch // cfg.cp
    traffic = empty()
    traffic.update(data_parallel_ops(psi_rank, dp=cfg.dp * cfg.cp, shard=cfg.shard_size * cfg.cp,
                                     zero=cfg.zero, microbatches=cfg.microbatches, grad_bytes=e,
                                     param_bytes=e, regather=zero3_regathers(cfg)))
    traffic["tp"] = tp_ops(tp=cfg.tp, layers=layers, tokens=tokens, hidden=hidden, value_bytes=e,
                           microbatches=cfg.microbatches, first=rank == 0, last=rank == cfg.pp - 1,
                           sequence_parallel=cfg.sequence_parallel,
                           partial_grad_bytes=e * 6 * hidden * layers)
    traffic["pp"] = pp_ops(pp=cfg.pp, rank=rank, virtual_stages=cfg.virtual_stages,
                           microbatches=cfg.microbatches, tokens=tokens, hidden=hidden,
                           value_bytes=e, tp=cfg.tp, sequence_parallel=cfg.sequence_parallel)
    traffic["other"] = other_ops(world=cfg.world_size, precision=cfg.precision)
    if cfg.cp > 1:   # K/V around the CP ring (docs/CONTEXT_PARALLEL.md), every layer and microbatch
        per_layer = cp_bytes_per_layer(cp=cfg.cp, micro_batch=model.micro_batch, seq_len=model.seq_len,
                                       d_model=hidden, tp=cfg.tp, mode=cfg.cp_comm, elem_bytes=e,
                                       forwards=1 if cfg.recompute == "none" else 2)
        traffic["cp"] = {op: b * layers * cfg.microbatches for op, b in per_layer.items()}
    return traffic


def _hsdp_groups(cfg: ParallelConfig) -> list[tuple[str, int]]:
    """HSDP's two groups and their sizes (none without HSDP)."""
    if cfg.zero == 0 or cfg.shard_size >= cfg.dp:
        return []
    return [("dp_shard", cfg.shard_size), ("dp_replicate", cfg.dp // cfg.shard_size)]


def _time(model: ModelShape, cfg: ParallelConfig, cluster: Cluster, traffic: Traffic,
          layers_total: int, hidden: int, psi_rank: float) -> StepTime:
    m = cfg.microbatches
    per_token = flops_per_token(model.params, layers=layers_total, hidden=hidden,
                                seq_len=model.seq_len, recompute=cfg.recompute)
    mb_compute = (model.tokens_per_microbatch * per_token / (cfg.pp * cfg.tp * cfg.cp)
                  / cluster.flops_per_s(cfg.precision))
    tp_bw = cluster.bandwidth(cfg.tp)
    dp_bw = cluster.bandwidth(cfg.dp * cfg.cp * cfg.tp)
    pp_bw = cluster.bandwidth(cfg.world_size)
    dp_s = {op: b * ring_factor(op, cfg.dp * cfg.cp) / dp_bw for op, b in traffic["dp"].items()}
    for axis, n in _hsdp_groups(cfg):   # HSDP: both terms, each over its own group
        for op, b in traffic.get(axis, {}).items():
            dp_s[op] = dp_s.get(op, 0.0) + b * ring_factor(op, n) / dp_bw
    tp_mb = wire_bytes(traffic["tp"], cfg.tp) / tp_bw / m
    if "cp" in traffic:   # counted as not overlapped with attention: an upper bound
        tp_mb += wire_bytes(traffic["cp"], cfg.cp) / 2 / cluster.bandwidth(cfg.cp * cfg.tp) / m
    pp_mb = traffic["pp"].get("send", 0.0) / pp_bw / m
    offload = 0.0
    if cfg.offload != "none":
        shard = psi_rank / cfg.dp if cfg.zero >= 1 else psi_rank
        nvme = bytes_per_param(cfg.precision)[2] * shard if cfg.offload == "nvme" else 0.0
        offload = offload_seconds(shard, zero=cfg.zero, microbatches=m,
                                  value_bytes=element_bytes(cfg.precision), cluster=cluster,
                                  nvme_bytes=nvme, params_on_host=cfg.offload_params)
    return step_time(mb_compute_s=mb_compute, microbatches=m, pp=cfg.pp, schedule=cfg.schedule,
                     virtual_stages=cfg.virtual_stages, tp_mb_s=tp_mb, pp_mb_s=pp_mb, dp_s=dp_s,
                     zero=cfg.zero, offload_s=offload)


def evaluate(cfg: ParallelConfig, model: ModelShape, cluster: Cluster) -> Candidate:
    """Score ``cfg`` for ``model`` on ``cluster`` (mixed-precision or fp32 Adam)."""
    layers_total, hidden = _shape(model)
    psi_rank = model.params / (cfg.pp * cfg.tp)
    states = model_states(psi_rank, dp=cfg.shard_size * cfg.cp, zero=cfg.zero, precision=cfg.precision,
                          offload=cfg.offload, offload_params=cfg.offload_params)
    best: tuple[float, float, Traffic] | None = None
    for rank in sorted({0, cfg.pp - 1}):
        layers = _stage_layers(layers_total, cfg.pp, rank)
        acts = _activations(model, cfg, rank, layers)
        traffic = _rank_traffic(model, cfg, rank, layers, hidden, psi_rank)
        key = (acts, total_payload(traffic))
        if best is None or key > best[:2]:
            best = (*key, traffic)
    assert best is not None
    activations, _, traffic = best
    stage_layers = math.ceil(layers_total / cfg.pp)
    memory = MemoryBreakdown(params=states.params, grads=states.grads, optimizer=states.optimizer,
                             activations=activations,
                             overhead=_overhead(cfg, cluster, psi_rank, stage_layers, model.has_shape))
    wire = {"dp": wire_bytes(traffic["dp"], cfg.dp * cfg.cp), "tp": wire_bytes(traffic["tp"], cfg.tp),
            "cp": wire_bytes(traffic.get("cp", {}), cfg.cp),
            "pp": wire_bytes(traffic["pp"], cfg.pp),
            "other": wire_bytes(traffic["other"], cfg.world_size),
            **{axis: wire_bytes(traffic[axis], n) for axis, n in _hsdp_groups(cfg) if axis in traffic}}
    time = _time(model, cfg, cluster, traffic, layers_total, hidden, psi_rank)
    return Candidate(cfg, memory, traffic, wire, time, memory.total <= cluster.gpu_mem_bytes)
