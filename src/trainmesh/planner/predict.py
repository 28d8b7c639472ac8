"""Predict what ``trainmesh train --metrics-out`` measures for one layout of the built-in GPT.

For every rank: ``model_state_bytes`` (the ZeRO accounting of :mod:`.memory` on the rank's own
parameters, :mod:`.builtin`), ``comm_bytes_per_step`` (:mod:`.traffic`, docs/METRICS.md's keys and
payload convention) and ``peak_mem_bytes``. The first two are exact up to ZeRO shard padding and
a few bytes of scalars; compare them within 1% (the expert all-to-all within 5%: routing is
taken as balanced). The peak is :mod:`.peak`'s on the rank's own states, activations in flight
and buffers; on CPU (process RSS)::

    peak = base + runtime + model states + glibc's resident share of the dynamic memory

``base`` is measured, never assumed: a process's footprint after importing torch depends on the
wheel (~220 MiB for torch 2.13 CPU, ~650 MiB for a CUDA build with no GPU in use). A worker
records its own in the summary (``base_mem_bytes``: RSS after joining the job, before building
the model) and :func:`compare` predicts on top of it; a prediction made ahead of a run
(``trainmesh plan --model``) measures the planning process itself, which has imported the same
torch (:func:`measured_base_bytes`). Workers measure it after torch's deferred imports,
and the planning process adds what those imports take (:data:`~trainmesh.core.compat.DEFERRED_IMPORT_BYTES`)
where it has not done them; a worker forked by the launcher's fork server measures less than the planning
process (about 64 MiB of torch's code pages are shared with the server and not yet touched), so a
plan made ahead of a local run errs on the safe side. ``runtime`` (:data:`RUNTIME_BYTES`) is what
the first set-up and step add whatever the model: the kernel code they page in. On CUDA the
summary reports ``max_memory_allocated``, so base, runtime and the allocator's reserve are left
out there (not yet calibrated on a GPU); ``reserved=True`` predicts what the GPU must hold.
Compare the peak within 10% (benchmarks/plan_vs_measured.py, docs/PLANNER.md).
Activations follow :mod:`.activations` (the built-in GPT's own count, MoE blocks by what the
layer saves with balanced routing; pipeline microbatches in flight per schedule). Mixed
precision is predicted ZeRO-paper style (16-bit parameters and gradients, fp32 master in the
optimizer states); AdamW's per-tensor ``step`` counters (4 bytes
per parameter tensor, or per flat shard under ZeRO) are included. Under context parallelism each
rank holds s/cp tokens, sends the K/V traffic of docs/CONTEXT_PARALLEL.md (axis ``cp``) and
reduces gradients over dp x cp (axis ``dp_cp``, ZeRO shards over it).

The lead's measured-vs-predicted check calls :func:`predict_run` with the run's
:class:`~trainmesh.config.train.TrainConfig` and :func:`compare` with the metrics summary.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from trainmesh.config.parallel import ParallelConfig
from trainmesh.context_parallel.traffic import cp_bytes_per_layer
from trainmesh.core.axes import Degrees, kind_groups, members, sequence_groups

from ..models.gpt import GPTConfig
from .activations import TRAINMESH, inflight_stages
from .builtin import RankModel, block_params, gpt_shape, rank_model
from .memory import element_bytes, model_states
from .peak import (
    CPU,
    CUDA,
    CUDA_ALLOCATED,
    CUDA_FIXED,
    Allocator,
    StageMemory,
    comm_buffers,
    stage_memory,
)
from .traffic import (
    AXES,
    Traffic,
    data_parallel_ops,
    dp_ops,
    ep_ops,
    other_ops,
    pp_ops,
    tp_ops,
    zero3_regathers,
)

MOE_AXES = ("ep", "edp")
"""Axes of expert parallelism's traffic (predicted where ``ep > 1``)."""

RUNTIME_BYTES = 25 * 2**20
"""CPU: what a worker's RSS grows by beyond its measured base (taken after torch's deferred
imports, :func:`~trainmesh.core.compat.load_lazy_imports`) and its model: the kernel code that
building the model and the first step page in, 5-30 MiB measured (spawned and forked workers)."""

TOLERANCE = {"model_state_bytes": 0.01, "comm_bytes_per_step": 0.01, "peak_mem_bytes": 0.1,
             "init_peak_mem_bytes": 0.2, "ep.all_to_all": 0.05}
"""Relative tolerance of each predicted field (the all-to-all is predicted for balanced routing;
a real run's imbalance moves it by a few percent)."""


@dataclass(frozen=True)
class RankPrediction:
    """One rank's predicted ``ranks[i]`` entry of the metrics summary."""

    rank: int
    coords: dict[str, int]
    model_state_bytes: dict[str, int]
    comm_bytes_per_step: dict[str, dict[str, int]]
    activation_bytes: int
    peak_mem_bytes: int
    base_mem_bytes: int = 0
    """The base footprint ``peak_mem_bytes`` assumes (before runtime and model)."""
    init_peak_mem_bytes: int = 0
    """The set-up peak (sharded initialisation): see :func:`_init_peak`."""
    offloaded_bytes: dict[str, int] = field(default_factory=lambda: {"cpu": 0, "nvme": 0})
    """Model-state bytes kept off the compute device (``--offload``): in host memory or files."""

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "coords": self.coords, "model_state_bytes": self.model_state_bytes,
                "comm_bytes_per_step": self.comm_bytes_per_step,
                "activation_bytes": self.activation_bytes, "peak_mem_bytes": self.peak_mem_bytes,
                "base_mem_bytes": self.base_mem_bytes, "init_peak_mem_bytes": self.init_peak_mem_bytes,
                "offloaded_bytes": self.offloaded_bytes}


@dataclass(frozen=True)
class RunPrediction:
    """Predicted summary of one run: layout, logical parameter count, every rank."""

    layout: dict[str, Any]
    params: int
    ranks: list[RankPrediction]
    tolerance: dict[str, float] = field(default_factory=lambda: dict(TOLERANCE))
    row_bytes: int = 0
    """All-to-all bytes one row moves per step (the hidden width times the value's bytes, once
    per exchange of a row: dispatch and combine, forward, recomputed forward and backward):
    what a rank's expert receiving a row beyond the balanced count adds (:func:`compare`)."""

    def to_json(self) -> dict[str, Any]:
        return {"layout": self.layout, "params": self.params, "world_size": len(self.ranks),
                "ranks": [r.to_json() for r in self.ranks], "tolerance": self.tolerance}


def _coords(rank: int, layout: ParallelConfig) -> dict[str, int]:
    """Mesh coordinates of a world rank: a (pp, dp, cp, tp) grid, tp fastest
    (:mod:`trainmesh.core.mesh`)."""
    tp, cp, dp = layout.tp, layout.cp, layout.dp
    return {"dp": (rank // (tp * cp)) % dp, "pp": rank // (tp * cp * dp), "tp": rank % tp,
            "cp": (rank // tp) % cp}


def _split(held: RankModel, layout: ParallelConfig) -> list[tuple[int, int]]:
    """(parameter values, the group ZeRO shards them over) of each strategy of a rank: the dense
    parameters over dp x cp (HSDP: the shard group), under expert parallelism this rank's experts
    over edp = dp x cp / ep."""
    dense = layout.shard_size * layout.cp      # ZeRO's group: dp x cp, or HSDP's shard group
    if layout.ep == 1 or not held.expert_params:
        return [(held.params, dense)]
    return [(held.params - held.expert_params, dense),
            (held.expert_params, layout.dp * layout.cp // layout.ep)]


def _states(held: RankModel, layout: ParallelConfig, optimizer: str,
            offload: str | None = None) -> dict[str, int]:
    """Model-state bytes on the device (``offload``: in place of the layout's)."""
    # ZeRO 0-2 hold the paper's mixed-precision bytes; trainmesh's ZeRO-3 keeps fp32 shards as
    # the parameters (FSDP2 style): fp32's 4 + 4 + 8 over N, the paper's 16Psi/N in total.
    precision = "fp32" if layout.zero >= 3 else layout.precision
    offload = layout.offload if offload is None else offload
    out = {"params": 0, "grads": 0, "optimizer": 0}
    parts = _split(held, layout)
    for psi, dp in parts:
        st = model_states(psi, dp=dp, zero=layout.zero, precision=precision,
                          optimizer=optimizer, offload=offload,
                          offload_params=layout.offload_params)
        out["params"] += int(st.params)
        out["grads"] += int(st.grads)
        out["optimizer"] += int(st.optimizer)
    if optimizer == "adamw" and offload == "none":  # AdamW's step counters
        out["optimizer"] += 4 * (held.tensors if layout.zero == 0 else len(parts))
    return out


def _offloaded(held: RankModel, layout: ParallelConfig, optimizer: str,
               states: dict[str, int]) -> dict[str, int]:
    """What ``--offload`` keeps off the device: the states it moves (optimizer states, the
    masters of mixed precision, AdamW's step counters; ZeRO-3's parameter shards with
    ``offload_params``), in host memory (``cpu``) or files (``nvme``)."""
    out = {"cpu": 0, "nvme": 0}
    if layout.offload != "none":
        kept = _states(held, layout, optimizer, offload="none")
        out[layout.offload] = sum(kept.values()) - sum(states.values())
    return out


def _init_peak(held: RankModel, layout: ParallelConfig, gpt: GPTConfig, states: dict[str, int],
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


def _traffic(held: RankModel, layout: ParallelConfig, gpt: GPTConfig, micro_batch: int,
             pp_rank: int) -> Traffic:
    e = element_bytes(layout.precision)
    grad_bytes = 4 if layout.reduce_dtype == "fp32" else e
    replicas = layout.dp * layout.cp       # the gradient group: dp x cp (``dp_cp``)
    tokens = micro_batch * gpt.seq_len // layout.cp
    m = layout.microbatches
    forwards = 2 if layout.recompute == "full" else 1   # full recompute runs each block's forward again
    cp: Traffic = {}
    if layout.cp > 1:   # docs/CONTEXT_PARALLEL.md; the gradient reduction keyed by its group
        per_layer = cp_bytes_per_layer(
            cp=layout.cp, micro_batch=micro_batch, seq_len=gpt.seq_len, d_model=gpt.d_model,
            tp=layout.tp, mode=layout.cp_comm, elem_bytes=e,
            forwards=1 if layout.recompute == "none" else 2)
        cp["cp"] = {op: b * held.blocks * m for op, b in per_layer.items()}
    parts = _split(held, layout)   # the dense parameters over dp x cp (or HSDP's shard), experts over edp
    psi, shard = parts[0]
    if layout.zero >= 1:
        psi = math.ceil(psi / shard) * shard
    dp_traffic = data_parallel_ops(psi, dp=replicas, shard=shard if layout.zero >= 1 else replicas,
                                   zero=layout.zero, microbatches=m, grad_bytes=grad_bytes,
                                   param_bytes=e, regather=zero3_regathers(layout))
    groups = kind_groups(layout, "dense")   # keyed by the groups' names: dp, dp_cp, dp_shard(_cp)
    if groups.replicate is not None:
        dp_traffic = {"dp": {}, groups.reduce: dp_traffic["dp_shard"],
                      groups.replicate: dp_traffic["dp_replicate"]}
    elif groups.reduce != "dp":
        dp_traffic = {groups.reduce: dp_traffic["dp"]}
    other = other_ops(world=layout.world_size, precision=layout.precision)
    moe: Traffic = {}
    if gpt.n_experts and layout.world_size > 1:   # the step's MoE figures: one float64 all-reduce
        other["all_reduce"] = other.get("all_reduce", 0.0) + 8 * len(gpt.moe_blocks()) * (gpt.n_experts + 2)
        # an expert may get no token: each strategy's count of parameters without a gradient
        # rides along the loss all-reduce (float64); the flags agreed on over dp / edp on steps
        # where some rank has one depend on the routing and are not predicted
        other["all_reduce"] += 8 * (2 if layout.ep > 1 else 1)
    if len(parts) > 1:
        psi_e, edp = parts[1]
        psi_e = math.ceil(psi_e / edp) * edp if layout.zero >= 1 else psi_e
        routed = tokens // (layout.tp if layout.sequence_parallel else 1)   # SP: its own T/t tokens
        moe = {"ep": ep_ops(ep=layout.ep, moe_layers=held.moe_blocks, tokens=routed, top_k=gpt.top_k,
                            hidden=gpt.d_model, value_bytes=e, microbatches=m, experts=gpt.n_experts,
                            forwards=forwards),
               "edp": dp_ops(psi_e, dp=edp, zero=layout.zero, microbatches=m, grad_bytes=grad_bytes,
                             param_bytes=e, regather=zero3_regathers(layout))}
    out = {
        **moe, **dp_traffic, **cp,
        "tp": tp_ops(tp=layout.tp, layers=held.blocks, tokens=tokens, hidden=gpt.d_model,
                     value_bytes=e, microbatches=m, first=held.first, last=held.last,
                     sequence_parallel=layout.sequence_parallel,
                     partial_grad_bytes=grad_bytes * _partial_pieces(held, layout), forwards=forwards,
                     moe_layers=held.moe_blocks),
        "pp": pp_ops(pp=layout.pp, rank=pp_rank, virtual_stages=layout.virtual_stages,
                     microbatches=m, tokens=tokens, hidden=gpt.d_model, value_bytes=e,
                     tp=layout.tp, sequence_parallel=layout.sequence_parallel),
        "other": other,
    }
    for axis, ops in sequence_sums(held, layout, gpt, micro_batch).items():
        out[axis] = {**out.get(axis, {})}
        out[axis]["all_reduce"] = out[axis].get("all_reduce", 0.0) + ops
    return out


def _partial_pieces(held: RankModel, layout: ParallelConfig) -> float:
    """Values of the partial (sequence-parallel) gradients a rank sums over tp once per step:
    all of them, or under ZeRO its pieces of the gradient shard, 1/N of each strategy's (N its
    group; the shard boundaries move a few values between ranks)."""
    if layout.zero == 0:
        return float(held.partial_grad_params)
    experts = held.partial_grad_params - held.partial_dense_params
    parts = _split(held, layout)
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


def _stage(held: RankModel, layout: ParallelConfig, gpt: GPTConfig, micro_batch: int,
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


def _buffers(held: RankModel, layout: ParallelConfig, gpt: GPTConfig, states: dict[str, int]) -> float:
    """Communication memory at the peak (:func:`~.peak.comm_buffers`): buckets of the
    reduction dtype, or ZeRO-3's gathered units."""
    e = element_bytes(layout.precision)
    grad_bytes = 4 if layout.reduce_dtype == "fp32" else e
    unit = block_params(gpt, layout.tp) if held.blocks else held.params
    return comm_buffers(zero=layout.zero, dp=layout.dp * layout.cp, reduce_bytes=grad_bytes * held.params,
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


def _ints(traffic: Traffic) -> dict[str, dict[str, int]]:
    axes = [*AXES, *(a for a in traffic if a not in AXES)]
    return {axis: {op: int(round(b)) for op, b in traffic.get(axis, {}).items()} for axis in axes}


def predict_layout(gpt: GPTConfig, layout: ParallelConfig, *, global_batch: int,
                   optimizer: str = "adamw", base_bytes: int,
                   runtime_bytes: int = RUNTIME_BYTES,
                   allocator: Allocator = CPU, host_resident: bool = True) -> RunPrediction:
    """Per-rank predictions for ``layout`` of ``gpt`` at ``global_batch`` sequences per step, on
    workers whose footprint before the model is ``base_bytes``. ``host_resident``: the device
    is the host (CPU), so states offloaded to host memory count in its peak."""
    micro_batch = global_batch // (layout.dp * layout.microbatches)
    ranks = []
    for pp_rank in range(layout.pp):
        held = rank_model(gpt, pp=layout.pp, tp=layout.tp, rank=pp_rank,
                          virtual_stages=layout.virtual_stages, ep=layout.ep)
        states = _states(held, layout, optimizer)
        stage = _stage(held, layout, gpt, micro_batch, pp_rank, allocator.threshold)
        acts = stage.kept
        comm = _ints(_traffic(held, layout, gpt, micro_batch, pp_rank))
        offloaded = _offloaded(held, layout, optimizer, states)
        host = offloaded["cpu"] if host_resident else 0
        peak = int(base_bytes + runtime_bytes + sum(states.values()) + host
                   + allocator.resident(stage, _buffers(held, layout, gpt, states)))
        for within in range(layout.dp * layout.cp * layout.tp):
            rank = pp_rank * layout.dp * layout.cp * layout.tp + within
            ranks.append(RankPrediction(rank, _coords(rank, layout), dict(states),
                                        {k: dict(v) for k, v in comm.items()}, int(acts), peak,
                                        int(base_bytes),
                                        _init_peak(held, layout, gpt, states, base_bytes + runtime_bytes),
                                        dict(offloaded)))
    passes = 1 + (2 if layout.recompute == "full" else 1)   # each row received goes back
    return RunPrediction(layout.layout(), gpt.num_params(), ranks,
                         row_bytes=passes * gpt.d_model * element_bytes(layout.precision))


def measured_base_bytes(device: str = "cpu") -> int:
    """This process's footprint now, as the base of a worker on this machine: its RSS on CPU
    (torch is imported: the wheel's share is in it); 0 on CUDA, where the allocator counts."""
    if device == "cuda":
        return 0
    import torch

    from trainmesh.core.compat import DEFERRED_IMPORT_BYTES, lazy_imports_loaded
    from trainmesh.observe.metrics import memory_now
    base = memory_now(torch.device("cpu"))
    # a worker measures after torch's deferred imports; counted, not done (the launcher's check)
    return base if lazy_imports_loaded() else base + DEFERRED_IMPORT_BYTES


def predict_run(cfg: Any, *, base_bytes: int | None = None, reserved: bool = False) -> RunPrediction:
    """Predictions for a :class:`~trainmesh.config.train.TrainConfig` (what a run will measure).

    ``base_bytes`` defaults to :func:`measured_base_bytes` (this process, this machine).
    ``reserved``: on CUDA, what the GPU must hold (the caching allocator's reserve and the CUDA
    context) rather than what ``max_memory_allocated`` will measure.
    """
    device = getattr(cfg, "device", "cpu")
    if device == "auto":
        from trainmesh.core.distributed import choose_device, visible_gpus
        device, _ = choose_device("auto", local_ranks=cfg.parallel.world_size, gpus=visible_gpus())
    if base_bytes is None:
        base_bytes = measured_base_bytes(device)
    cuda = device == "cuda"   # CUDA: max_memory_allocated, the allocator's reserve left out
    runtime = (CUDA_FIXED if reserved else 0) if cuda else RUNTIME_BYTES
    allocator = (CUDA if reserved else CUDA_ALLOCATED) if cuda else CPU
    return predict_layout(cfg.gpt_config(), cfg.parallel, global_batch=cfg.global_batch,
                          optimizer=cfg.optimizer, base_bytes=base_bytes, runtime_bytes=runtime,
                          allocator=allocator, host_resident=not cuda)


def _close(predicted: float, measured: float, rel: float) -> bool:
    return abs(predicted - measured) <= rel * max(abs(measured), 1.0)


def _routed(prediction: RunPrediction, summary: dict[str, Any], got: dict[str, Any]) -> float | None:
    """The all-to-all bytes per step this rank's routing adds over the balanced one the
    prediction assumes (its experts received R rows where its slots were S), from the
    summary's ``moe_rows`` and step count; None without them."""
    rows, steps = got.get("moe_rows"), summary.get("steps")
    if not rows or not steps or not prediction.row_bytes:
        return None
    sent = sum(sum(layer) for layer in rows["routed"])
    return prediction.row_bytes * (sum(rows["received"]) - sent) / steps


def _shard_means(prediction: RunPrediction, summary: dict[str, Any]) -> dict[int, float]:
    """SP under ZeRO: each rank sums over tp its pieces of the partial gradients in its
    gradient shard, and where a shard boundary cuts a parameter moves a few values between the
    ranks of the group; over the group they add up to what the prediction gives each rank
    1/N of. Rank -> the mean of ``tp.all_reduce`` over its dense group (empty elsewhere)."""
    layout = prediction.layout
    if not (layout.get("sequence_parallel") and layout.get("zero", 0) >= 1 and layout.get("tp", 1) > 1):
        return {}
    d = Degrees(**{k: layout.get(k, 1) for k in ("dp", "pp", "tp", "cp", "ep")},
                dp_shard=layout.get("dp_shard"))
    tp = {r["rank"]: r["comm_bytes_per_step"].get("tp", {}).get("all_reduce", 0)
          for r in summary.get("ranks", [])}
    out = {}
    for group in members(d, kind_groups(d, "dense").reduce):
        if all(rank in tp for rank in group):
            out.update({rank: sum(tp[r] for r in group) / len(group) for rank in group})
    return out


def compare(prediction: RunPrediction, summary: dict[str, Any]) -> list[str]:
    """Every predicted number outside its tolerance of the measured ``summary`` (empty: all agree).

    ``summary`` is the ``{"event": "summary", ...}`` record of ``--metrics-out``. Two numbers
    depend on what no plan knows ahead: the all-to-all on the routing (predicted balanced; where
    the summary has ``moe_rows`` its imbalance is taken out and the rest compared as any
    traffic, else within :data:`TOLERANCE`'s ``ep.all_to_all``), and under SP with ZeRO each
    rank's share of the partial gradients on its shard boundaries (compared as the group's mean,
    :func:`_shard_means`).
    """
    problems = []
    measured = {r["rank"]: r for r in summary.get("ranks", [])}
    means = _shard_means(prediction, summary)
    if summary.get("params") not in (None, prediction.params):
        problems.append(f"params: predicted {prediction.params}, measured {summary['params']}")
    for pred in prediction.ranks:
        got = measured.get(pred.rank)
        if got is None:
            problems.append(f"rank {pred.rank}: missing from the summary")
            continue
        for kind, want in pred.model_state_bytes.items():
            have = got["model_state_bytes"].get(kind, 0)
            if not _close(want, have, TOLERANCE["model_state_bytes"]):
                problems.append(f"rank {pred.rank} model_state_bytes.{kind}: "
                                f"predicted {want}, measured {have}")
        for where, have in got.get("offloaded_bytes", {}).items():
            if where != "cpu":   # the store's files: written as it goes, not predicted here
                continue
            want = pred.offloaded_bytes.get(where, 0)
            if not _close(want, have, TOLERANCE["model_state_bytes"]):
                problems.append(f"rank {pred.rank} offloaded_bytes.{where}: "
                                f"predicted {want}, measured {have}")
        axes = sorted(set(AXES) | set(pred.comm_bytes_per_step) | set(got["comm_bytes_per_step"]))
        for axis in axes:
            ops = set(pred.comm_bytes_per_step.get(axis, {})) | set(got["comm_bytes_per_step"].get(axis, {}))
            for op in sorted(ops):
                want = pred.comm_bytes_per_step.get(axis, {}).get(op, 0)
                have = got["comm_bytes_per_step"].get(axis, {}).get(op, 0)
                rel = TOLERANCE.get(f"{axis}.{op}", TOLERANCE["comm_bytes_per_step"])
                routed = _routed(prediction, summary, got) if (axis, op) == ("ep", "all_to_all") else None
                if routed is not None:   # the routing's share taken out: the rest is exact
                    have, rel = have - routed, TOLERANCE["comm_bytes_per_step"]
                if (axis, op) == ("tp", "all_reduce") and pred.rank in means:
                    have = means[pred.rank]
                if not _close(want, have, rel):
                    problems.append(f"rank {pred.rank} comm_bytes_per_step.{axis}.{op}: "
                                    f"predicted {want}, measured {have}")
        shift = got.get("base_mem_bytes", pred.base_mem_bytes) - pred.base_mem_bytes
        for key in ("peak_mem_bytes", "init_peak_mem_bytes"):
            want = getattr(pred, key) + shift   # on the base the run measured
            if key in got and not _close(want, got[key], TOLERANCE[key]):
                problems.append(f"rank {pred.rank} {key}: predicted {want} (on the measured base), "
                                f"measured {got[key]}")
    return problems
