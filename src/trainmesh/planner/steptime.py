"""Step time: compute over achievable throughput, plus the communication that is not hidden.

**Compute.** Training FLOPs per token are ``6*Psi + 12*L*h*s`` (forward 2 per parameter,
backward 4; attention scores and weighted sum 4*L*h*s forward, causal masking not exploited).
Full recompute adds one more forward (``2*Psi + 4*L*h*s``), selective recompute the attention
forward (``4*L*h*s``). One GPU does ``1/(pp*tp)`` of a microbatch's work at
``Cluster.flops_per_s`` (default 40% of peak).

**Pipeline.** A step takes the schedule's ideal microbatch slots
(:func:`trainmesh.pipeline_parallel.analysis.ideal_slots`: ``m + (p-1)/v`` for 1F1B,
interleaved and GPipe). Every slot pays the
stage's compute, its TP collectives and its PP sends: TP and PP communication are on the critical
path (not overlapped).

**Data parallel.** Reductions overlap with backward, which is taken as 2/3 of the compute:
DDP's all-reduce and ZeRO-1's reduce-scatter hide behind the last microbatch's backward,
ZeRO-2's per-microbatch reduce-scatter behind each microbatch's backward, ZeRO-3's gathers and
reduce-scatter behind each microbatch's forward and backward (prefetching); only the excess is
exposed. ZeRO-1/2's all-gather of updated parameters follows the optimizer step and is fully
exposed. Overlap is taken as perfect within its window; real frameworks hide 70-90%.

**Offload.** Gradient shards go to the host and updated parameters come back over PCIe, the
host runs the optimizer; at ZeRO-3 parameter shards also stream in before every forward and
backward. None of it is taken as overlapped.

**Muon** (``--optimizer muon``): at the optimizer step, the Newton-Schulz iteration
(:func:`trainmesh.data_parallel.muon.ns_flops`: ``ns_steps x (4 m^2 n + 2 m^3)`` per m x n
matrix, m <= n, run in bf16) on the matrices the rank iterates, and the owners' all-to-alls
over the shard group and over tp (:func:`.traffic.muon_ops`): none overlapped
(:func:`trainmesh.planner.candidate.muon_work`).

Collective time is wire bytes (ring, see :mod:`.traffic`) over the group's bandwidth.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..pipeline_parallel.analysis import ideal_slots as pipeline_slots
from .cluster import Cluster
from .shapes import ModelShape

BACKWARD_SHARE = 2 / 3
"""Fraction of a microbatch's compute that is backward (the DP overlap window)."""


@dataclass(frozen=True)
class StepTime:
    """Estimated seconds of one optimizer step on the slowest rank, by cause."""

    compute_s: float
    """Forward + backward (+ recompute) of every microbatch on one GPU."""
    bubble_s: float
    """Pipeline idle time."""
    tp_s: float
    """Tensor-parallel collectives (critical path)."""
    pp_s: float
    """Pipeline sends and receives (critical path)."""
    dp_s: float
    """Data-parallel / ZeRO communication not hidden behind compute."""
    offload_s: float
    """Host copies and the host optimizer step."""
    optimizer_s: float = 0.0
    """Muon: the Newton-Schulz iteration on the matrices this rank iterates and the owners'
    reduce, broadcast and tp exchanges (at the optimizer step, after the backward: exposed)."""

    @property
    def total(self) -> float:
        return (self.compute_s + self.bubble_s + self.tp_s + self.pp_s + self.dp_s + self.offload_s
                + self.optimizer_s)


def flops_per_token(params: float, *, layers: int | None, hidden: int | None, seq_len: int,
                    recompute: str = "none", model: ModelShape | None = None,
                    selective: str = "attention") -> float:
    """Training FLOPs per token (attention term omitted when the shape is unknown); ``params``
    the parameters a token runs through (a mixture of experts: the active ones); ``seq_len``
    the keys a token attends (packed documents: :attr:`ModelShape.attention_len`). With ``model``
    the attention uses its query width and op-level selective recompute (``selective="op"``)
    its dropped matmuls (k, the output projection, the MLP's up or second matrix)."""
    width = model.q_dim if model is not None and model.has_shape else hidden
    attention_fwd = 4 * layers * width * seq_len if layers and width else 0.0
    flops = 6 * params + 3 * attention_fwd
    if recompute == "full":
        flops += 2 * params + attention_fwd
    elif recompute == "selective" and selective == "op" and model is not None and model.has_shape:
        h = model.hidden or 0
        dropped = h * model.kv_dim + model.q_dim * h + model.ffn_width * h
        flops += 2 * dropped * (model.layers or 0)
    elif recompute == "selective":
        flops += attention_fwd
    return float(flops)


def dp_exposed(dp_s: dict[str, float], *, zero: int, microbatches: int, mb_compute_s: float) -> float:
    """Seconds of DP traffic per step not hidden by compute (``dp_s``: op -> seconds per step)."""
    m = microbatches
    backward = BACKWARD_SHARE * mb_compute_s
    ar, rs, ag = dp_s.get("all_reduce", 0.0), dp_s.get("reduce_scatter", 0.0), dp_s.get("all_gather", 0.0)
    if zero == 0:
        return max(0.0, ar - backward)
    if zero == 1:
        return max(0.0, rs - backward) + ag
    if zero == 2:
        return m * max(0.0, rs / m - backward) + ag
    return m * max(0.0, (rs + ag) / m - mb_compute_s)


def offload_seconds(psi_shard: float, *, zero: int, microbatches: int, value_bytes: int,
                    cluster: Cluster, nvme_bytes: float = 0.0, params_on_host: bool = True) -> float:
    """Host copies (gradients out, parameters in, ZeRO-3 parameter streaming when the parameter
    shards live on the host) and host Adam; with NVMe, ``nvme_bytes`` of optimizer states (and
    masters) read before the step and written after it (the prefetch overlaps the two directions
    with the update only in part: counted in full)."""
    copies = 2 * value_bytes * psi_shard
    if zero >= 3 and params_on_host:
        copies += 2 * microbatches * value_bytes * psi_shard
    nvme = 2 * nvme_bytes / cluster.nvme_bw
    return copies / cluster.pcie_bw + psi_shard / cluster.cpu_optimizer_params_per_s + nvme


def step_time(*, mb_compute_s: float, microbatches: int, pp: int, schedule: str,
              virtual_stages: int, tp_mb_s: float, pp_mb_s: float, dp_s: dict[str, float],
              zero: int, offload_s: float = 0.0, optimizer_s: float = 0.0) -> StepTime:
    """Assemble a :class:`StepTime` from per-microbatch stage costs and per-step DP traffic."""
    slots = pipeline_slots(schedule, microbatches=microbatches, pp=pp, virtual_stages=virtual_stages)
    return StepTime(compute_s=microbatches * mb_compute_s,
                    bubble_s=(slots - microbatches) * mb_compute_s,
                    tp_s=slots * tp_mb_s, pp_s=slots * pp_mb_s,
                    dp_s=dp_exposed(dp_s, zero=zero, microbatches=microbatches,
                                    mb_compute_s=mb_compute_s),
                    offload_s=offload_s, optimizer_s=optimizer_s)
