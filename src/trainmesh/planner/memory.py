"""Model-state memory per GPU: the ZeRO accounting (Rajbhandari et al. 2019).

Bytes per parameter held by one data-parallel replica, before any sharding:

============================  ======  =====  =========================================
precision, optimizer          params  grads  optimizer
============================  ======  =====  =========================================
bf16/fp16, Adam(W)            2       2      12 (fp32 master 4 + momentum 4 + variance 4)
fp32, Adam(W)                 4       4      8  (momentum + variance; params are the master)
bf16/fp16, SGD (no momentum)  2       2      4  (fp32 master)
fp32, SGD (no momentum)       4       4      0
============================  ======  =====  =========================================

ZeRO over N = dp ranks: stage 1 divides the optimizer by N, stage 2 also the gradients, stage 3
also the parameters (a shard is ``ceil(Psi/N)`` elements). ``psi`` is what the rank's DP group
replicates, i.e. the parameters left after the tensor/pipeline split (Psi/(pp*tp) for a
uniform model). With ``offload="cpu"`` (host memory) or ``"nvme"`` (files) the optimizer column
(states and fp32 masters) leaves the GPU, and at stage 3 with ``offload_params`` the parameter
shards too: they cost no GPU memory but cost time (see :mod:`.steptime`). Gradients stay on the
GPU.

So for mixed-precision Adam: DDP 16Psi, ZeRO-1 4Psi + 12Psi/N, ZeRO-2 2Psi + 14Psi/N, ZeRO-3
16Psi/N -- the ZeRO paper's 120 GB / 31.4 GB / 16.6 GB / 1.88 GB for 7.5B parameters on 64 GPUs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from trainmesh.config.train import OPTIMIZERS
from trainmesh.core.errors import ConfigError


def element_bytes(precision: str) -> int:
    """Bytes of one value in the compute dtype: 4 for fp32, 2 for bf16/fp16."""
    return 4 if precision == "fp32" else 2


def bytes_per_param(precision: str, optimizer: str = "adamw") -> tuple[int, int, int]:
    """(params, grads, optimizer) bytes per parameter of one unsharded replica."""
    if optimizer not in OPTIMIZERS:
        raise ConfigError("--optimizer", f"must be one of {', '.join(OPTIMIZERS)}; got {optimizer!r}")
    mixed = precision != "fp32"
    if optimizer == "adamw":
        return (2, 2, 12) if mixed else (4, 4, 8)
    if optimizer == "muon":     # one moment (the momentum) on the hidden matrices, most of a model
        return (2, 2, 8) if mixed else (4, 4, 4)
    return (2, 2, 4) if mixed else (4, 4, 0)


@dataclass(frozen=True)
class ModelStates:
    """Bytes one rank keeps for parameters, gradients and optimizer states."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def shard(psi: float, n: int) -> float:
    """Elements of one of ``n`` equal shards (``ceil`` for whole parameter counts)."""
    if n == 1:
        return psi
    return math.ceil(psi / n) if float(psi).is_integer() else psi / n


def model_states(psi: float, *, dp: int, zero: int, precision: str, optimizer: str = "adamw",
                 offload: str = "none", offload_params: bool = True,
                 matrices: float | None = None) -> ModelStates:
    """GPU bytes of model states for a rank whose DP group replicates ``psi`` parameters.
    Muon: ``matrices`` of them are its hidden matrices (None: all); AdamW steps the others,
    whose second moment adds 4 bytes each (sharded as the rest)."""
    p, g, o = bytes_per_param(precision, optimizer)
    params = p * (shard(psi, dp) if zero >= 3 else psi)
    grads = g * (shard(psi, dp) if zero >= 2 else psi)
    optim = o * (shard(psi, dp) if zero >= 1 else psi)
    if optimizer == "muon" and matrices is not None:
        rest = psi - matrices
        optim += 4 * (shard(rest, dp) if zero >= 1 else rest)
    if offload != "none":
        optim = 0.0
        if zero >= 3 and offload_params:
            params = 0.0
    return ModelStates(float(params), float(grads), float(optim))


@dataclass(frozen=True)
class MemoryBreakdown:
    """Per-GPU memory of one layout, bytes; ``total`` is the sum of the parts."""

    params: float
    grads: float
    optimizer: float
    activations: float
    """Activations kept for backward and the working set at the peak (loss, a layer's backward)."""
    overhead: float
    """Framework overhead (CUDA context, NCCL) plus communication buffers at the peak."""
    fragmentation: float = 0.0
    """What the allocator holds beyond the live tensors (:mod:`.peak`)."""

    @property
    def model_states(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.model_states + self.activations + self.overhead + self.fragmentation

    def to_json(self) -> dict[str, int]:
        """``memory_per_gpu_bytes`` of ``trainmesh plan --json`` (docs/PLANNER.md; plus
        ``overhead`` and ``fragmentation``, parts of ``total``)."""
        parts = {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                 "activations": self.activations, "overhead": self.overhead,
                 "fragmentation": self.fragmentation, "total": self.total}
        return {k: int(round(v)) for k, v in parts.items()}
