"""Peak memory of one rank: what is live at the busiest moment of a training step.

One accounting for the advisor (any model on GPUs) and the prediction of ``trainmesh train``
(the built-in GPT, CPU or CUDA)::

    peak = fixed + states + fragmentation x (kept + working + buffers)

* ``states``: parameters, gradients and optimizer states (:mod:`.memory`), allocated once.
* ``kept``: the activations the stage keeps for backward at its peak: every microbatch in flight
  (:mod:`.activations`), with the head's fp32 log-softmax on the last stage.
* ``working``: what is transient at the peak, the larger of two moments:
  the loss (last stage): the logits' two fp32 gradients of the log-softmax in backward (or the
  forward's logits and their fp32 copy), on top of everything kept; and a layer's backward:
  gradients as large as what the layer kept (no recompute, selective), or with full recompute
  the segment rematerialised and its gradients (twice its activations), on top of what is kept
  minus the head's share, already freed by then.
* ``buffers``: communication memory at the peak (:func:`comm_buffers`).
* ``fixed``: what the device or process holds before the model: on CUDA the context, NCCL and
  the allocator's own (:data:`CUDA_FIXED`); on CPU the worker's measured base plus the runtime.
* ``fragmentation``: what the allocator holds beyond the live tensors of the dynamic part, as
  measured factors (:class:`Allocator`): on CUDA PyTorch's caching allocator reserves
  :data:`CUDA_FRAGMENTATION` times what is allocated; on CPU glibc serves tensors below its mmap
  threshold (32 MiB once a worker is set up) from a heap that keeps what is freed, and the
  heap's high-water mark settles at :data:`CPU_HEAP_FACTOR` times the live bytes it holds,
  while larger tensors (the loss's vocabulary-wide ones, mostly) are mapped and unmapped
  exactly.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .activations import (
    Kernels,
    head_parts,
    layer_bytes,
    layer_input_bytes,
    loss_transient_bytes,
)
from .shapes import ModelShape

CUDA_FRAGMENTATION = 1.18
"""Reserved over allocated bytes of PyTorch's caching allocator on the dynamic memory (activations,
loss, buffers) of a training step. Fitted to torchtitan's four context-parallel runs of Llama
3.1 8B (FSDP + CP, full recompute, 32k tokens per GPU: 83.9-84.5 GiB reserved) and checked on its
FSDP runs with op-level selective recompute on 8 and 128 H100s (docs/PLANNER.md)."""

CPU_HEAP_FACTOR = 1.2
"""Resident over live bytes of a CPU worker's heap (tensors below the mmap threshold) over its
steps: freed blocks stay resident and later allocations do not fit them all back. The median
over the single-microbatch layouts of the CPU matrix of benchmarks/plan_vs_measured.py
(1.02-1.37)."""

CPU_LOSS_REPEAT = 1.0
"""The loss's vocabulary-wide tensors, when below the mmap threshold, are held once more, and one
more logits-sized block for every further microbatch through the loss in a step: the next
microbatch's (or step's) land above the holes the layers' smaller tensors took. Measured on the
same matrix (the layouts whose loss tensors are 16 MiB: accumulation, pipelines, dp 4)."""

MMAP_THRESHOLD = 32 * 2**20
"""glibc serves a tensor of at least this many bytes by mmap (trainmesh sets it after set-up)."""

CUDA_FIXED = 2**30
"""Per-GPU memory outside the allocator's count: CUDA context, NCCL buffers, cuBLAS workspaces."""


@dataclass(frozen=True)
class StageMemory:
    """The dynamic memory of one pipeline stage over a step, bytes."""

    kept: float
    """Activations kept for backward at the peak (every microbatch in flight)."""
    working: float
    """Transient on top of them at the peak (the loss, or a layer's backward)."""
    small: float
    """Most live bytes in tensors below the allocator's threshold at any moment of the step."""
    large: float
    """Most live bytes in tensors at or above it at any moment (0 without a threshold)."""
    loss_small: float = 0.0
    """Of ``small``, the loss's tensors (what :data:`CPU_LOSS_REPEAT` repeats)."""


@dataclass(frozen=True)
class Allocator:
    """Resident (or reserved) over live bytes: ``small`` for tensors below ``threshold`` bytes
    (held for the rest of the run once touched: the most the step ever held counts), ``large``
    for the rest (held while live)."""

    small: float
    large: float
    threshold: float = math.inf
    loss_repeat: float = 0.0
    """Extra copies of the loss's small tensors the allocator holds (:data:`CPU_LOSS_REPEAT`)."""

    def resident(self, stage: StageMemory, buffers: float = 0.0) -> float:
        """Bytes the allocator holds at the stage's peak, communication ``buffers`` included."""
        return (self.small * (stage.small + buffers) + self.large * stage.large
                + self.loss_repeat * stage.loss_small)


CUDA = Allocator(CUDA_FRAGMENTATION, CUDA_FRAGMENTATION)
CUDA_ALLOCATED = Allocator(1.0, 1.0)
"""What ``torch.cuda.max_memory_allocated`` counts (trainmesh's CUDA ``peak_mem_bytes``)."""
CPU = Allocator(CPU_HEAP_FACTOR, 1.0, MMAP_THRESHOLD, CPU_LOSS_REPEAT)


def stage_memory(model: ModelShape, kernels: Kernels, *, layers: int, moe_layers: int,
                 last: bool, seq: int, batch: int, tp: int, sequence_parallel: bool,
                 recompute: str, segment: int, value_bytes: int, inflight: float,
                 received: float | None = None, threshold: float = math.inf,
                 loss_passes: int = 1) -> StageMemory:
    """Activations kept and the working set at the peak of a stage holding ``layers`` layers
    (``moe_layers`` of them MoE), ``inflight`` microbatches in flight (module doc). Two moments
    are compared: the loss's (last stage) and a layer's backward; ``small``/``large`` split each
    by tensor size against ``threshold`` (the loss's vocabulary-wide tensors; a layer's when its
    widest tensor reaches it)."""
    shape = dict(seq=seq, batch=batch, tp=tp, sequence_parallel=sequence_parallel,
                 value_bytes=value_bytes)
    dense_none = layer_bytes(model, kernels, recompute="none", **shape)
    moe_none = layer_bytes(model, kernels, recompute="none", moe=True, received=received, **shape) \
        if moe_layers else 0.0
    if recompute == "full":
        per_mb = math.ceil(layers / segment) * layer_input_bytes(hidden=model.hidden or 0, **shape)
        layer_bw = 2 * min(segment, layers) * max(dense_none, moe_none)
    else:
        dense = layer_bytes(model, kernels, recompute=recompute, **shape)
        moe = layer_bytes(model, kernels, recompute=recompute, moe=True, received=received, **shape) \
            if moe_layers else 0.0
        per_mb = (layers - moe_layers) * dense + moe_layers * moe
        layer_bw = max(dense if layers > moe_layers else 0.0, moe) if layers else 0.0
    head = head_parts(model, **shape) if last and model.vocab else {}
    lsm = head.get("log-softmax (fp32)", 0.0)
    norm = sum(head.values()) - lsm
    loss = loss_transient_bytes(tokens=seq * batch, vocab=model.vocab, tp=tp, value_bytes=value_bytes) \
        if last and model.vocab else 0.0
    layers_kept = inflight * per_mb
    widest = seq * batch * max(model.hidden or 0, (model.ffn_width if model.hidden else 0) // tp) * value_bytes
    big_layers, big_loss = widest >= threshold, lsm >= threshold
    moments = []   # (small, large) live bytes at the loss and in a layer's backward
    at_loss = (layers_kept + inflight * norm, inflight * lsm + loss) if head else (0.0, 0.0)
    at_layer = (layers_kept + layer_bw, 0.0)
    for layer_part, loss_part in (at_loss, at_layer):
        small = (0.0 if big_layers else layer_part) + (0.0 if big_loss else loss_part)
        moments.append((small, layer_part + loss_part - small))
    kept = layers_kept + inflight * (norm + lsm)
    total = max(a + b for a, b in moments)
    return StageMemory(kept=kept, working=total - kept if total > kept else 0.0,
                       small=max(a for a, _ in moments), large=max(b for _, b in moments),
                       loss_small=0.0 if big_loss else
                       inflight * lsm + loss + (loss_passes - 1) * lsm)


def comm_buffers(*, zero: int, dp: int, reduce_bytes: float, bucket_bytes: float,
                 unit_bytes: float, unit_grad_bytes: float, stage_gathered: float = 0.0) -> float:
    """Communication memory at the peak of a DP rank: with ZeRO 0-2 two buckets of gradients
    in flight (``bucket_bytes`` each, or the whole ``reduce_bytes`` when smaller); with ZeRO-3
    two units' gathered parameters (the one running and the one prefetched) and one unit's
    unsharded gradients, or inside a pipeline with ``--zero3-reshard step`` the whole stage
    gathered (``stage_gathered``)."""
    if dp <= 1:
        return 0.0
    if zero < 3:
        return min(2 * bucket_bytes, reduce_bytes)
    if stage_gathered:
        return stage_gathered + unit_grad_bytes
    return 2 * unit_bytes + unit_grad_bytes
