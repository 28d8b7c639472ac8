"""What one rank of a layout holds, keeps and sends, for :mod:`.predict`: model states on the
device and off it, the set-up peak, traffic per group and op, activations and buffers at the
peak. ``held`` is the rank's share of the built-in GPT (:func:`.builtin.rank_model`);
``layout`` a :class:`~trainmesh.config.parallel.ParallelConfig`.
"""
from __future__ import annotations

import math

from trainmesh.config.parallel import ParallelConfig
from trainmesh.context_parallel.traffic import cp_bytes_per_layer, cp_document_bytes
from trainmesh.core.axes import kind_groups, sequence_groups
from trainmesh.core.layout import Group

from ..models.gpt import GPTConfig
from .activations import TRAINMESH, inflight_stages
from .builtin import RankModel, block_params, gpt_shape
from .memory import bytes_per_param, element_bytes, model_states
from .peak import StageMemory, comm_buffers, stage_memory
from .traffic import (
    Traffic,
    data_parallel_ops,
    dp_ops,
    ep_ops,
    muon_ops,
    other_ops,
    pp_ops,
    tp_ops,
    zero3_regathers,
)


def kind_parts(held: RankModel, layout: ParallelConfig) -> list[tuple[int, int]]:
    """(parameter values, the group ZeRO shards them over) of each strategy of a rank: the dense
    parameters over dp x cp (HSDP: the shard group), under expert parallelism this rank's experts
    over edp = dp x cp / ep."""
    dense = layout.layout.size(kind_groups(layout, "dense").reduce)   # dp x cp, or HSDP's shard
    if layout.ep == 1 or not held.expert_params:
        return [(held.params, dense)]
    return [(held.params - held.expert_params, dense),
            (held.expert_params, layout.layout.size(Group.edp))]


def device_states(held: RankModel, layout: ParallelConfig, optimizer: str,
                  offload: str | None = None) -> dict[str, int]:
    """Model-state bytes on the device (``offload``: in place of the layout's)."""
    # ZeRO 0-2 hold the paper's mixed-precision bytes; trainmesh's ZeRO-3 keeps fp32 shards as
    # the parameters (FSDP2 style): fp32's 4 + 4 + 8 over N, the paper's 16Psi/N in total.
    precision = "fp32" if layout.zero >= 3 else layout.precision
    offload = layout.offload if offload is None else offload
    out = {"params": 0, "grads": 0, "optimizer": 0}
    parts = kind_parts(held, layout)
    for psi, dp in parts:
        st = model_states(psi, dp=dp, zero=layout.zero, precision=precision,
                          optimizer=optimizer, offload=offload,
                          offload_params=layout.offload_params)
        out["params"] += int(st.params)
        out["grads"] += int(st.grads)
        out["optimizer"] += int(st.optimizer)
    if optimizer == "muon":      # its AdamW part keeps a second moment
        for (psi, dp), matrices in zip(parts, (held.matrix_params, held.expert_matrix_params)):
            rest = model_states(psi - matrices, dp=dp, zero=layout.zero, precision=precision,
                                optimizer="muon", offload=offload, offload_params=layout.offload_params)
            out["optimizer"] += int(rest.optimizer * 4 / bytes_per_param(precision, "muon")[2])
    if optimizer in ("adamw", "muon") and offload == "none":  # AdamW's step counters
        out["optimizer"] += 4 * (held.tensors if layout.zero == 0 else len(parts))
    return out


def offloaded(held: RankModel, layout: ParallelConfig, optimizer: str,
              states: dict[str, int]) -> dict[str, int]:
    """What ``--offload`` keeps off the device: the states it moves (optimizer states, the
    masters of mixed precision, AdamW's step counters; ZeRO-3's parameter shards with
    ``offload_params``), in host memory (``cpu``) or files (``nvme``)."""
    out = {"cpu": 0, "nvme": 0}
    if layout.offload != "none":
        kept = device_states(held, layout, optimizer, offload="none")
        out[layout.offload] = sum(kept.values()) - sum(states.values())
    return out


def init_peak(held: RankModel, layout: ParallelConfig, gpt: GPTConfig, states: dict[str, int],
              base: int) -> int:
    """Set-up peak of a rank (sharded initialisation: it builds only what it holds): ``base``
    + its parameters + the gradient buffers set-up allocates (none under DDP: they come with the
    first backward; ZeRO-1 full, ZeRO-2/3 the shard) + fp32 master shards (mixed precision,
    ZeRO 0-2; optimizer moments come with the first step) + at ZeRO-3 one unit in flight."""
    grads = states["grads"] if layout.zero >= 1 else 0
    dp = layout.shard_size * layout.cp if layout.zero >= 1 else 1
    masters = 4 * held.params / dp if layout.precision != "fp32" and layout.zero < 3 else 0
    unit = 0.0
    if layout.zero == 3:
        d, f = gpt.d_model, gpt.d_ff
        unit = 4 * (4 * (d * d + d) + (d * f + f) + (f * d + d) + 4 * d) / layout.tp
    return int(base + states["params"] + grads + masters + unit)


def rank_traffic(held: RankModel, layout: ParallelConfig, gpt: GPTConfig, micro_batch: int,
                 pp_rank: int, documents: bool = False, optimizer: str = "adamw") -> Traffic:
    """Bytes per step a rank of pipeline stage ``pp_rank`` passes to each op, keyed by group;
    ``documents``: packed batches (cp gathers their position ids); ``optimizer`` muon: its
    Newton-Schulz exchanges (:func:`~.traffic.muon_ops`; experts' over edp)."""
    e = element_bytes(layout.precision)
    grad_bytes = 4 if layout.reduce_dtype == "fp32" else e
    replicas = layout.layout.size(Group.dp_cp)   # the gradient group: dp x cp
    tokens = micro_batch * gpt.seq_len // layout.cp
    m = layout.microbatches
    forwards = 2 if layout.recompute == "full" else 1   # full recompute runs each block's forward again
    cp: Traffic = {}
    if layout.cp > 1:   # docs/CONTEXT_PARALLEL.md; the gradient reduction keyed by its group
        per_layer = cp_bytes_per_layer(
            cp=layout.cp, micro_batch=micro_batch, seq_len=gpt.seq_len, d_model=gpt.d_model,
            tp=layout.tp, mode=layout.cp_comm, elem_bytes=e,
            forwards=1 if layout.recompute == "none" else 2)
        cp[Group.cp] = {op: b * held.blocks * m for op, b in per_layer.items()}
        if documents and held.blocks:   # the position ids: once per microbatch, not per layer
            for op, b in cp_document_bytes(cp=layout.cp, micro_batch=micro_batch,
                                           seq_len=gpt.seq_len).items():
                cp[Group.cp][op] = cp[Group.cp].get(op, 0) + b * m
    parts = kind_parts(held, layout)   # the dense parameters over dp x cp (or HSDP's shard), experts over edp
    psi, shard = parts[0]
    if layout.zero >= 1:
        psi = math.ceil(psi / shard) * shard
    dp_traffic = data_parallel_ops(psi, dp=replicas, shard=shard if layout.zero >= 1 else replicas,
                                   zero=layout.zero, microbatches=m, grad_bytes=grad_bytes,
                                   param_bytes=e, regather=zero3_regathers(layout))
    groups = kind_groups(layout, "dense")   # keyed by the groups' names: dp, dp_cp, dp_shard(_cp)
    if groups.replicate is not None:
        dp_traffic = {Group.dp: {}, groups.reduce: dp_traffic[Group.dp_shard],
                      groups.replicate: dp_traffic[Group.dp_replicate]}
    elif groups.reduce != Group.dp:
        dp_traffic = {groups.reduce: dp_traffic[Group.dp]}
    other = other_ops(world=layout.layout.world, precision=layout.precision)
    moe: Traffic = {}
    if gpt.n_experts and layout.layout.world > 1:   # the step's MoE figures: one float64 all-reduce
        other["all_reduce"] = other.get("all_reduce", 0.0) + 8 * len(gpt.moe_blocks()) * (gpt.n_experts + 2)
        # an expert may get no token: each strategy's count of parameters without a gradient
        # rides along the loss all-reduce (float64); the flags agreed on over dp / edp on steps
        # where some rank has one depend on the routing and are not predicted
        other["all_reduce"] += 8 * (2 if layout.ep > 1 else 1)
    if len(parts) > 1:
        psi_e, edp = parts[1]
        psi_e = math.ceil(psi_e / edp) * edp if layout.zero >= 1 else psi_e
        routed = tokens // (layout.tp if layout.sequence_parallel else 1)   # SP: its own T/t tokens
        moe = {Group.ep: ep_ops(ep=layout.ep, moe_layers=held.moe_blocks, tokens=routed, top_k=gpt.top_k,
                            hidden=gpt.d_model, value_bytes=e, microbatches=m, experts=gpt.n_experts,
                            forwards=forwards),
               Group.edp: dp_ops(psi_e, dp=edp, zero=layout.zero, microbatches=m, grad_bytes=grad_bytes,
                             param_bytes=e, regather=zero3_regathers(layout))}
    out = {
        **moe, **dp_traffic, **cp,
        Group.tp: tp_ops(tp=layout.tp, layers=held.blocks, tokens=tokens, hidden=gpt.d_model,
                         value_bytes=e, microbatches=m, first=held.first, last=held.last,
                         sequence_parallel=layout.sequence_parallel,
                         partial_grad_bytes=grad_bytes * _partial_pieces(held, layout),
                         forwards=forwards, moe_layers=held.moe_blocks),
        Group.pp: pp_ops(pp=layout.pp, rank=pp_rank, virtual_stages=layout.virtual_stages,
                         microbatches=m, tokens=tokens, hidden=gpt.d_model, value_bytes=e,
                         tp=layout.tp, sequence_parallel=layout.sequence_parallel),
        "other": other,
    }
    for axis, ops in sequence_sums(held, layout, gpt, micro_batch).items():
        out[axis] = {**out.get(axis, {})}
        out[axis]["all_reduce"] = out[axis].get("all_reduce", 0.0) + ops
    if optimizer == "muon":
        routers = gpt.n_experts * gpt.d_model * held.moe_blocks        # whole over tp
        for axis, ops in muon_ops(matrices=held.matrix_params, tp_split=held.matrix_params - routers,
                                  shard=parts[0][1],
                                  zero=layout.zero, tp=layout.tp).items():
            _merge(out, groups.reduce if axis == "dp" else Group.tp, ops)
        if len(parts) > 1:      # the experts' matrices: owners over edp (whole over tp)
            for _, ops in muon_ops(matrices=held.expert_matrix_params, tp_split=0, shard=parts[1][1],
                                   zero=layout.zero, tp=1).items():
                _merge(out, Group.edp, ops)
    return out


def _merge(out: Traffic, key: str, ops: dict[str, float]) -> None:
    out[key] = {**out.get(key, {})}
    for op, b in ops.items():
        out[key][op] = out[key].get(op, 0.0) + b


def _partial_pieces(held: RankModel, layout: ParallelConfig) -> float:
    """Values of the partial (sequence-parallel) gradients a rank sums over tp once per step:
    all of them, or under ZeRO its pieces of the gradient shard, 1/N of each strategy's (N its
    group; the shard boundaries move a few values between ranks)."""
    if layout.zero == 0:
        return float(held.partial_grad_params)
    experts = held.partial_grad_params - held.partial_dense_params
    parts = kind_parts(held, layout)
    return held.partial_dense_params / parts[0][1] + (experts / parts[1][1] if len(parts) > 1 else 0.0)


def sequence_sums(held: RankModel, layout: ParallelConfig, gpt: GPTConfig,
                  micro_batch: int) -> dict[str, float]:
    """Bytes per step a rank's MoE layers all-reduce over each group a sequence is split over
    (cp, and tp under sequence parallelism; docs/EXPERT_PARALLEL.md): each layer's fp32
    per-sequence slot counts, ``b x E``, once per forward run with gradients (full recompute
    runs it again) of every microbatch."""
    if not gpt.n_experts or not held.moe_blocks:
        return {}
    forwards = 2 if layout.recompute == "full" else 1
    counts = forwards * layout.microbatches * held.moe_blocks * micro_batch * gpt.n_experts * 4
    return {axis: float(counts) for axis in sequence_groups(layout, layout.sequence_parallel)}


def stage(held: RankModel, layout: ParallelConfig, gpt: GPTConfig, micro_batch: int,
          pp_rank: int, threshold: float) -> StageMemory:
    """Activations kept and the working set at the peak of one pipeline rank (:mod:`.peak`)."""
    inflight = inflight_stages(layout.schedule, pp=layout.pp, microbatches=layout.microbatches,
                               rank=pp_rank, virtual_stages=layout.virtual_stages)
    return stage_memory(gpt_shape(gpt, micro_batch=micro_batch), TRAINMESH, layers=held.blocks,
                        moe_layers=held.moe_blocks, last=held.last, seq=gpt.seq_len // layout.cp,
                        batch=micro_batch, tp=layout.tp, sequence_parallel=layout.sequence_parallel,
                        recompute=layout.recompute, segment=layout.recompute_segment,
                        value_bytes=element_bytes(layout.precision), inflight=inflight,
                        threshold=threshold, loss_passes=layout.microbatches)


def buffers(held: RankModel, layout: ParallelConfig, gpt: GPTConfig, states: dict[str, int]) -> float:
    """Communication memory at the peak (:func:`~.peak.comm_buffers`): buckets of the
    reduction dtype, or ZeRO-3's gathered units."""
    e = element_bytes(layout.precision)
    grad_bytes = 4 if layout.reduce_dtype == "fp32" else e
    unit = block_params(gpt, layout.tp) if held.blocks else held.params
    return comm_buffers(zero=layout.zero, dp=layout.layout.size(Group.dp_cp),
                        reduce_bytes=grad_bytes * held.params,
                        bucket_bytes=layout.bucket_mb * 2**20, unit_bytes=e * unit,
                        unit_grad_bytes=grad_bytes * unit,
                        stage_gathered=zero3_gathered_bytes(held, layout, gpt)
                        if layout.zero3_reshard == "step" else 0.0)


def zero3_gathered_bytes(held: RankModel, layout: ParallelConfig, gpt: GPTConfig) -> int:
    """Most bytes of gathered ZeRO-3 parameters a rank holds at once (docs/ZERO.md, "ZeRO inside
    a pipeline"): inside a pipeline, the whole stage with ``--zero3-reshard step``, one block
    (the largest unit of the stage: a block, the embedding or the head) with ``microbatch``
    (padding of each unit to a multiple of dp aside); 0 elsewhere (without a
    pipeline the model of the peak leaves it out)."""
    if layout.zero != 3 or layout.pp == 1:
        return 0
    e = element_bytes(layout.precision)
    if layout.zero3_reshard == "step":
        return int(e * held.params)
    d, vocab_rows = gpt.d_model, math.ceil(gpt.vocab_size / layout.tp)
    units = [block_params(gpt, layout.tp) if held.blocks else 0,
             (vocab_rows + gpt.seq_len) * d if held.first else 0,
             (vocab_rows + 2) * d if held.last else 0]
    return int(e * max(units))
