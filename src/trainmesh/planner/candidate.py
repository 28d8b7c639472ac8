"""One layout scored by the planner: memory per GPU, traffic per step, estimated step time.

A layout is :class:`trainmesh.config.parallel.ParallelConfig` (the same record ``trainmesh train`` takes
and the metrics summary prints). :func:`evaluate` scores it for a model on a cluster under the
models of :mod:`.memory`, :mod:`.peak`, :mod:`.traffic` and :mod:`.steptime`. The numbers
describe the busiest rank: the first pipeline stage (most microbatches in flight) or the last
(logits), whichever needs more. Context parallelism divides the tokens (activations, compute,
TP/PP traffic) by cp, adds the K/V ring's traffic (``cp``; with packed documents,
``model.document_len`` given, the position ids' gather once per microbatch too) and widens the
DP group to dp x cp.

A mixture of experts splits the parameters in two: the dense ones (attention, norms,
embeddings, the router and shared experts) are held per pp x tp rank and reduced over dp x cp
like any model's; the routed experts are spread over ``ep`` ranks of the dp x cp group (whole
on every TP rank) and reduced over the other ``edp = dp x cp / ep``. Per MoE layer and
microbatch each token goes to its k experts and back through the ``ep`` all-to-all
(forward and backward, routing taken as balanced); FLOPs count the active parameters.

Muon (``optimizer="muon"``): its hidden matrices (:meth:`~.shapes.ModelShape.hidden_matrices`)
keep one moment, the other parameters AdamW's two (:func:`~.memory.model_states`), and the step
adds the Newton-Schulz iteration and the owners' collectives (:func:`muon_work`).

When the model's shape is not given, activations are 0 and a nominal shape (``h = 128*L``,
``Psi = 12*L*h^2``, the proportions of GPT-3 and Llama) sizes the TP/PP traffic, the attention
FLOPs and the ``pp <= layers`` limit.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from trainmesh.config.parallel import ParallelConfig
from trainmesh.context_parallel.traffic import cp_bytes_per_layer, cp_document_bytes
from trainmesh.core.axes import kind_groups
from trainmesh.core.layout import Group
from trainmesh.data_parallel.muon import ns_flops

from .activations import TRAINMESH, Kernels, inflight_stages
from .cluster import Cluster
from .memory import MemoryBreakdown, ModelStates, bytes_per_param, element_bytes, model_states
from .peak import comm_buffers, stage_memory
from .shapes import ModelShape
from .steptime import StepTime, flops_per_token, offload_seconds, step_time
from .traffic import (
    Traffic,
    data_parallel_ops,
    dp_ops,
    empty,
    ep_ops,
    muon_ops,
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
    expert_state_bytes: float = 0.0
    """Of the model states, the bytes of this rank's experts (MoE; 0 for a dense model)."""

    @property
    def comm_bytes_per_step(self) -> float:
        return total_payload(self.traffic)

    def to_json(self) -> dict[str, Any]:
        """One entry of ``candidates`` in ``trainmesh plan --json`` (docs/PLANNER.md)."""
        out = {"layout": self.layout.layout_record(), "memory_per_gpu_bytes": self.memory.to_json(),
               "comm_bytes_per_step": int(round(self.comm_bytes_per_step)), "fits": self.fits,
               "est_step_time_s": round(self.time.total, 6)}
        if self.expert_state_bytes:
            out["expert_state_bytes"] = int(round(self.expert_state_bytes))
            out["all_to_all_bytes_per_step"] = int(round(self.traffic.get("ep", {}).get("all_to_all", 0)))
        return out


def _shape(model: ModelShape) -> tuple[int, int]:
    if model.layers and model.hidden:
        return model.layers, model.hidden
    layers, hidden = nominal_shape(model.params)
    return model.layers or layers, model.hidden or hidden


def _stage_layers(layers: int, pp: int, rank: int) -> int:
    """Blocks on pipeline ``rank``: as even as possible, the first ranks take the remainder."""
    return layers // pp + (1 if rank < layers % pp else 0)


@dataclass(frozen=True)
class _Split:
    """The parameters one rank holds: dense (over the dp x cp shard group) and routed experts
    (over edp), and the groups ZeRO shards each over."""

    dense: float
    experts: float
    dense_group: int
    expert_group: int
    dense_matrices: float = 0.0
    """Of ``dense``, the hidden matrices' values (Muon's)."""
    expert_matrices: float = 0.0
    """Of ``experts``, the experts' matrices' values."""


def matrices(model: ModelShape) -> list[tuple[int, tuple[int, int], bool]]:
    """Muon's matrices of the whole model (:meth:`~.shapes.ModelShape.hidden_matrices`); without
    a shape, the nominal one's: per layer four h x h and two h x 4h."""
    if model.has_shape:
        return model.hidden_matrices()
    layers, hidden = _shape(model)
    return [(4 * layers, (hidden, hidden), False), (2 * layers, (hidden, 4 * hidden), False)]


def _split(model: ModelShape, cfg: ParallelConfig) -> _Split:
    experts = model.expert_params
    dense = (model.params - experts) / (cfg.pp * cfg.tp)
    kinds = matrices(model)
    # latent attention taken as full heads can count more than the dense parameters: at most all
    dense_m = min(sum(n * a * b for n, (a, b), e in kinds if not e), model.params - experts)
    expert_m = min(sum(n * a * b for n, (a, b), e in kinds if e), experts)
    layout = cfg.layout   # dense states over their reduce group (dp x cp, or HSDP's shard)
    return _Split(dense, experts / (cfg.pp * cfg.ep),
                  layout.size(kind_groups(layout, "dense").reduce), layout.size(Group.edp),
                  dense_m / (cfg.pp * cfg.tp), expert_m / (cfg.pp * cfg.ep))


def _states(split: _Split, cfg: ParallelConfig, optimizer: str = "adamw") -> tuple[ModelStates, float]:
    """(the rank's model states, of which its experts' bytes); DiLoCo adds the outer step's
    parameters and momentum (8 bytes per parameter, counted with the optimizer)."""
    kw = dict(zero=cfg.zero, precision=cfg.precision, offload=cfg.offload,
              offload_params=cfg.offload_params, optimizer=optimizer)
    dense = model_states(split.dense, dp=split.dense_group, matrices=split.dense_matrices,
                         **kw)   # type: ignore[arg-type]
    experts = model_states(split.experts, dp=split.expert_group, matrices=split.expert_matrices,
                           **kw)   # type: ignore[arg-type]
    outer = 8 * (split.dense + split.experts) if cfg.strategy == "diloco" else 0.0
    return (ModelStates(dense.params + experts.params, dense.grads + experts.grads,
                        dense.optimizer + experts.optimizer + outer), experts.total)


def _moe_layers_on(model: ModelShape, layers: int, layers_total: int) -> int:
    return round(model.moe_layer_count * layers / layers_total) if model.moe_layer_count else 0


def _rank_traffic(model: ModelShape, cfg: ParallelConfig, rank: int, layers: int,
                  hidden: int, split: _Split) -> Traffic:
    e = element_bytes(cfg.precision)
    tokens = model.tokens_per_microbatch // cfg.cp
    m = cfg.microbatches
    forwards = 2 if cfg.recompute == "full" else 1   # full recompute runs each forward again
    traffic = empty()
    regather = zero3_regathers(cfg)
    if cfg.strategy == "diloco":   # the parameters all-reduced every inner_steps steps, fp32
        traffic["dp"] = {"all_reduce": 4 * split.dense / cfg.inner_steps} if cfg.dp > 1 else {}
    else:
        traffic.update(data_parallel_ops(split.dense, dp=cfg.dp * cfg.cp, shard=split.dense_group,
                                         zero=cfg.zero, microbatches=m, grad_bytes=e,
                                         param_bytes=e, regather=regather))
    moe = _moe_layers_on(model, layers, _shape(model)[0]) if split.experts else 0
    traffic["tp"] = tp_ops(tp=cfg.tp, layers=layers, tokens=tokens, hidden=hidden, value_bytes=e,
                           microbatches=m, first=rank == 0, last=rank == cfg.pp - 1,
                           sequence_parallel=cfg.sequence_parallel,
                           partial_grad_bytes=e * 6 * hidden * layers, forwards=forwards,
                           moe_layers=moe)
    traffic["pp"] = pp_ops(pp=cfg.pp, rank=rank, virtual_stages=cfg.virtual_stages,
                           microbatches=m, tokens=tokens, hidden=hidden,
                           value_bytes=e, tp=cfg.tp, sequence_parallel=cfg.sequence_parallel)
    traffic["other"] = other_ops(world=cfg.world_size, precision=cfg.precision)
    if cfg.cp > 1:   # K/V around the CP ring (docs/CONTEXT_PARALLEL.md), every layer and microbatch
        kv = model.kv_dim if model.has_shape else hidden
        per_layer = cp_bytes_per_layer(cp=cfg.cp, micro_batch=model.micro_batch, seq_len=model.seq_len,
                                       d_model=kv, tp=cfg.tp, mode=cfg.cp_comm, elem_bytes=e,
                                       forwards=1 if cfg.recompute == "none" else 2)
        traffic["cp"] = {op: b * layers * m for op, b in per_layer.items()}
        if model.document_len is not None and layers:   # packed: the position ids, per microbatch
            for op, b in cp_document_bytes(cp=cfg.cp, micro_batch=model.micro_batch,
                                           seq_len=model.seq_len).items():
                traffic["cp"][op] = traffic["cp"].get(op, 0) + b * m
    if split.experts:
        routed = tokens // (cfg.tp if cfg.sequence_parallel else 1)
        traffic["ep"] = ep_ops(ep=cfg.ep, moe_layers=moe, tokens=routed, top_k=model.top_k,
                               hidden=hidden, value_bytes=e, microbatches=m, experts=model.experts,
                               forwards=forwards)
        traffic["edp"] = dp_ops(split.experts, dp=split.expert_group, zero=cfg.zero,
                                microbatches=m, grad_bytes=e, param_bytes=e, regather=regather)
    return traffic


def _hsdp_groups(cfg: ParallelConfig) -> list[tuple[str, int]]:
    """HSDP's two groups and their sizes (none without HSDP)."""
    if cfg.zero == 0 or cfg.shard_size >= cfg.dp:
        return []
    return [("dp_shard", cfg.shard_size), ("dp_replicate", cfg.dp // cfg.shard_size)]


def _time(model: ModelShape, cfg: ParallelConfig, cluster: Cluster, kernels: Kernels,
          traffic: Traffic, layers_total: int, hidden: int, split: _Split) -> StepTime:
    m = cfg.microbatches
    per_token = flops_per_token(model.active_params, layers=layers_total, hidden=hidden,
                                seq_len=model.attention_len, recompute=cfg.recompute,
                                model=model if model.has_shape else None, selective=kernels.selective)
    mb_compute = (model.tokens_per_microbatch * per_token / (cfg.pp * cfg.tp * cfg.cp)
                  / cluster.flops_per_s(cfg.precision))
    tp_bw = cluster.bandwidth(cfg.tp)
    dp_bw = cluster.bandwidth(cfg.dp * cfg.cp * cfg.tp)
    pp_bw = cluster.bandwidth(cfg.world_size)
    dp_s = {op: b * ring_factor(op, cfg.dp * cfg.cp) / dp_bw for op, b in traffic["dp"].items()}
    for axis, n in [*_hsdp_groups(cfg), ("edp", split.expert_group)]:   # each over its own group
        for op, b in traffic.get(axis, {}).items():
            dp_s[op] = dp_s.get(op, 0.0) + b * ring_factor(op, n) / dp_bw
    tp_mb = wire_bytes(traffic["tp"], cfg.tp) / tp_bw / m
    if "cp" in traffic:   # counted as not overlapped with attention: an upper bound
        tp_mb += wire_bytes(traffic["cp"], cfg.cp) / 2 / cluster.bandwidth(cfg.cp * cfg.tp) / m
    if traffic.get("ep"):  # the all-to-all waits for the router: on the critical path
        span = cfg.ep * cfg.tp * (1 if cfg.ep <= cfg.dp else cfg.cp)
        tp_mb += wire_bytes(traffic["ep"], cfg.ep) / cluster.bandwidth(span) / m
    pp_mb = traffic["pp"].get("send", 0.0) / pp_bw / m
    offload = 0.0
    if cfg.offload != "none":
        psi = split.dense + split.experts
        shard = psi / cfg.dp if cfg.zero >= 1 else psi
        nvme = bytes_per_param(cfg.precision)[2] * shard if cfg.offload == "nvme" else 0.0
        offload = offload_seconds(shard, zero=cfg.zero, microbatches=m,
                                  value_bytes=element_bytes(cfg.precision), cluster=cluster,
                                  nvme_bytes=nvme, params_on_host=cfg.offload_params)
    return step_time(mb_compute_s=mb_compute, microbatches=m, pp=cfg.pp, schedule=cfg.schedule,
                     virtual_stages=cfg.virtual_stages, tp_mb_s=tp_mb, pp_mb_s=pp_mb, dp_s=dp_s,
                     zero=cfg.zero, offload_s=offload)


def muon_work(model: ModelShape, cfg: ParallelConfig, cluster: Cluster,
              split: _Split) -> tuple[Traffic, float, float]:
    """(traffic, Newton-Schulz FLOPs, seconds) of Muon's step on a rank: the iteration on each
    matrix it iterates, whole, its pipeline stage's share; under ZeRO only the matrices it
    owns, the owners balanced by FLOPs (the mean over the shard group; experts' over edp);
    under tp each cut matrix at one tp owner (1/tp of them: the routers and routed experts,
    whole on every tp rank, at each). The owners' exchanges over the shard group and tp
    (:func:`~.traffic.muon_ops`) and the iteration follow the backward: none of it
    overlapped."""
    kinds = matrices(model)
    owners = (lambda group: group) if cfg.zero >= 1 else (lambda group: 1)
    dense = sum(n * ns_flops(shape) for n, shape, e in kinds if not e)
    experts = sum(n * ns_flops(shape) for n, shape, e in kinds if e)
    routers = (model.moe_layer_count * ns_flops((model.experts, model.hidden))
               if model.has_shape and model.moe_layer_count else 0)
    dense = (dense - routers) / cfg.tp + routers
    flops = (dense / cfg.pp / owners(split.dense_group)
             + experts / (cfg.pp * cfg.ep) / owners(split.expert_group))
    hsdp = _hsdp_groups(cfg)
    shard_axis = hsdp[0][0] if hsdp else "dp"
    traffic: Traffic = {}
    for axis, ops in muon_ops(matrices=split.dense_matrices, tp_split=split.dense_matrices,
                              shard=split.dense_group, zero=cfg.zero, tp=cfg.tp).items():
        traffic[shard_axis if axis == "dp" else axis] = ops
    if split.experts:   # the experts' matrices: owners over edp, whole over tp
        for ops in muon_ops(matrices=split.expert_matrices, tp_split=0, shard=split.expert_group,
                            zero=cfg.zero, tp=1).values():
            traffic["edp"] = ops
    dp_bw = cluster.bandwidth(cfg.dp * cfg.cp * cfg.tp)
    comm = (wire_bytes(traffic.get(shard_axis, {}), split.dense_group) / dp_bw
            + wire_bytes(traffic.get("edp", {}), split.expert_group) / dp_bw
            + wire_bytes(traffic.get("tp", {}), cfg.tp) / cluster.bandwidth(cfg.tp))
    return traffic, flops, flops / cluster.flops_per_s("bf16") + comm   # the iteration runs in bf16


def _buffers(cfg: ParallelConfig, split: _Split, layers_total: int, model: ModelShape) -> float:
    """Communication memory at the peak (:func:`~.peak.comm_buffers`); a ZeRO-3 unit is one
    layer's parameters, or the embedding (the head) when larger."""
    e = element_bytes(cfg.precision)
    psi = split.dense + split.experts
    layer = psi / max(1, math.ceil(layers_total / cfg.pp))
    embed = (model.vocab or 0) * (model.hidden or 0) / cfg.tp
    unit = max(layer, embed) if model.has_shape else layer
    stage = e * psi if cfg.zero == 3 and not zero3_regathers(cfg) else 0.0
    buffers = comm_buffers(zero=cfg.zero, dp=cfg.dp * cfg.cp, reduce_bytes=e * psi,
                           bucket_bytes=BUCKET_BYTES, unit_bytes=e * unit, unit_grad_bytes=e * unit,
                           stage_gathered=stage)
    if cfg.strategy == "diloco":   # the change of the parameters while it is reduced, fp32
        buffers += 4 * psi
    return buffers


def evaluate(cfg: ParallelConfig, model: ModelShape, cluster: Cluster,
             kernels: Kernels = TRAINMESH, *, optimizer: str = "adamw") -> Candidate:
    """Score ``cfg`` for ``model`` on ``cluster`` (mixed-precision or fp32 ``optimizer``:
    adamw, sgd or muon), its activations counted as ``kernels`` keep them; without an
    efficiency on ``cluster``, the published runs' (:func:`~.efficiency.assumed_efficiency`)."""
    if cluster.efficiency is None:
        from .efficiency import assumed_efficiency
        cluster = replace(cluster, efficiency=assumed_efficiency(cluster.gpu, model.active_params).efficiency)
    layers_total, hidden = _shape(model)
    split = _split(model, cfg)
    states, expert_bytes = _states(split, cfg, optimizer)
    best: tuple[float, float, float, Traffic] | None = None
    for rank in sorted({0, cfg.pp - 1}):
        layers = _stage_layers(layers_total, cfg.pp, rank)
        traffic = _rank_traffic(model, cfg, rank, layers, hidden, split)
        kept = working = 0.0
        if model.has_shape:
            inflight = inflight_stages(cfg.schedule, pp=cfg.pp, microbatches=cfg.microbatches,
                                       rank=rank, virtual_stages=cfg.virtual_stages)
            moe = _moe_layers_on(model, layers, layers_total)
            stage = stage_memory(model, kernels, layers=layers, moe_layers=moe,
                                 last=rank == cfg.pp - 1, seq=model.seq_len // cfg.cp,
                                 batch=model.micro_batch, tp=cfg.tp,
                                 sequence_parallel=cfg.sequence_parallel, recompute=cfg.recompute,
                                 segment=cfg.recompute_segment,
                                 value_bytes=element_bytes(cfg.precision), inflight=inflight)
            kept, working = stage.kept, stage.working
        key = (kept + working, total_payload(traffic))
        if best is None or key > best[:2]:
            best = (*key, kept, traffic)
    assert best is not None
    live, _, kept, traffic = best
    buffers = _buffers(cfg, split, layers_total, model)
    dynamic = live + buffers
    scaled = cluster.memory_scale * cluster.fragmentation
    memory = MemoryBreakdown(params=states.params, grads=states.grads, optimizer=states.optimizer,
                             activations=live, overhead=cluster.framework_overhead_bytes + buffers,
                             fragmentation=(scaled - 1) * dynamic)
    time = _time(model, cfg, cluster, kernels, traffic, layers_total, hidden, split)
    if optimizer == "muon":
        extra, _, seconds = muon_work(model, cfg, cluster, split)
        time = replace(time, optimizer_s=seconds)
        traffic = {**traffic}
        for axis, ops in extra.items():
            traffic[axis] = {**traffic.get(axis, {})}
            for op, b in ops.items():
                traffic[axis][op] = traffic[axis].get(op, 0.0) + b
    wire = {"dp": wire_bytes(traffic["dp"], cfg.dp * cfg.cp), "tp": wire_bytes(traffic["tp"], cfg.tp),
            "cp": wire_bytes(traffic.get("cp", {}), cfg.cp),
            "pp": wire_bytes(traffic["pp"], cfg.pp),
            "ep": wire_bytes(traffic.get("ep", {}), cfg.ep),
            "edp": wire_bytes(traffic.get("edp", {}), split.expert_group),
            "other": wire_bytes(traffic["other"], cfg.world_size),
            **{axis: wire_bytes(traffic[axis], n) for axis, n in _hsdp_groups(cfg) if axis in traffic}}
    return Candidate(cfg, memory, traffic, wire, time, memory.total <= cluster.gpu_mem_bytes,
                     expert_bytes)
