"""Typed configuration: the parallel layout (:class:`ParallelConfig`), validated once.

Every field is settable from a TOML file and from ``trainmesh train`` flags (the CLI maps
``--global-batch`` to ``global_batch`` and so on). Checks raise :class:`ConfigError` naming the
field and what would be valid.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from .errors import ConfigError

SCHEDULES = ("naive", "gpipe", "1f1b", "interleaved")
PRECISIONS = ("fp32", "bf16", "fp16")
RECOMPUTE = ("none", "full", "selective")
OFFLOAD = ("none", "cpu", "nvme")
STRATEGIES = ("mesh", "ps")
PS_MODES = ("sync", "async")
ALLREDUCE = ("native", "ring", "tree", "naive")


def _positive(field: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(field, f"must be a positive integer; got {value!r}")


def _choice(field: str, value: Any, valid: tuple) -> None:
    if value not in valid:
        raise ConfigError(field, f"must be one of {', '.join(map(str, valid))}; got {value!r}")


@dataclass
class ParallelConfig:
    """How one training step is split over processes. World size = dp * pp * tp."""

    dp: int = 1
    """Data-parallel degree: replicas, each with a slice of the global batch."""
    pp: int = 1
    """Pipeline-parallel degree: stages the model's layers are split into."""
    tp: int = 1
    """Tensor-parallel degree: ranks each layer's matrices are split across."""
    zero: int = 0
    """ZeRO stage over the DP axis: 0 plain DDP, 1 optimizer states, 2 + gradients, 3 + parameters."""
    microbatches: int = 1
    """Gradient-accumulation steps (pp=1) or pipeline microbatches (pp>1) per optimizer step."""
    schedule: str = "1f1b"
    """Pipeline schedule: naive, gpipe, 1f1b or interleaved."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank (interleaved schedule)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism inside TP groups."""
    precision: str = "fp32"
    """Compute precision: fp32, bf16 or fp16 (dynamic loss scaling)."""
    reduce_dtype: str | None = None
    """dtype gradients are reduced in: fp32, or None for the compute dtype."""
    recompute: str = "none"
    """Activation recomputation: none, full (keep layer inputs) or selective (attention internals)."""
    recompute_segment: int = 1
    """With full recompute: keep the input of every K-th layer, recompute K layers from it."""
    offload: str = "none"
    """Offload of optimizer states: none, cpu or nvme."""
    offload_dir: str | None = None
    """Directory for nvme offload."""
    bucket_mb: float = 25.0
    """Gradient bucket size in MiB (DDP all-reduce, ZeRO reduce-scatter)."""
    grad_clip: float = 0.0
    """Global gradient-norm clip; 0 disables clipping (the norm is still measured)."""
    timeout_s: float = 300.0
    """Every collective's timeout in seconds."""
    find_unused_parameters: bool = False
    """Reduce gradients of parameters that received none instead of raising an error."""
    # -- parameter server and all-reduce algorithms
    strategy: str = "mesh"
    """mesh (dp x pp x tp) or ps: an RPC parameter server with dp trainers and ps_servers servers."""
    ps_servers: int = 1
    """Parameter-server processes (strategy ps); parameters are sharded across them by bytes."""
    ps_mode: str = "sync"
    """sync (every server averages all trainers' gradients of a step) or async (Hogwild-style)."""
    ps_staleness: int | None = None
    """async: most steps a trainer may run ahead of the slowest; None = unbounded, 0 = sync."""
    allreduce: str = "native"
    """DDP's bucket reduction: native (the backend's), ring, tree or naive (comm/algorithms.py)."""

    def __post_init__(self) -> None:
        for name in ("dp", "pp", "tp", "microbatches", "virtual_stages", "recompute_segment"):
            _positive(name.replace("_", "-"), getattr(self, name))
        _choice("zero", self.zero, (0, 1, 2, 3))
        _choice("schedule", self.schedule, SCHEDULES)
        _choice("precision", self.precision, PRECISIONS)
        _choice("reduce-dtype", self.reduce_dtype, (None, "fp32", self.precision))
        _choice("recompute", self.recompute, RECOMPUTE)
        _choice("offload", self.offload, OFFLOAD)
        if self.bucket_mb <= 0:
            raise ConfigError("bucket-mb", f"must be > 0; got {self.bucket_mb}")
        if self.grad_clip < 0:
            raise ConfigError("grad-clip", f"must be >= 0 (0 = off); got {self.grad_clip}")
        if self.timeout_s <= 0:
            raise ConfigError("timeout", f"must be > 0 seconds; got {self.timeout_s}")
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError("sequence-parallel", "shards activations inside TP groups; needs --tp > 1")
        if self.zero == 3 and self.pp > 1:
            raise ConfigError("zero", "3 with --pp > 1 is refused: ZeRO-3 re-gathers every layer "
                              "for each of the pipeline's microbatches (traffic x microbatches); "
                              "use --zero 1 or 2 with pipelines")
        if self.virtual_stages > 1 and self.schedule != "interleaved":
            raise ConfigError("virtual-stages", "> 1 needs --schedule interleaved")
        self._check_ps()

    def _check_ps(self) -> None:
        """The parameter-server and all-reduce-algorithm fields."""
        _choice("strategy", self.strategy, STRATEGIES)
        _choice("allreduce", self.allreduce, ALLREDUCE)
        _choice("ps-mode", self.ps_mode, PS_MODES)
        _positive("ps-servers", self.ps_servers)
        if self.ps_staleness is not None and (isinstance(self.ps_staleness, bool)
                                              or not isinstance(self.ps_staleness, int) or self.ps_staleness < 0):
            raise ConfigError("ps-staleness", f"must be an integer >= 0; got {self.ps_staleness!r}")
        if self.allreduce != "native" and (self.zero > 0 or self.strategy == "ps"):
            raise ConfigError("allreduce", f"{self.allreduce} reduces DDP's buckets; needs --zero 0 and "
                              "--strategy mesh (valid otherwise: native)")
        if self.strategy != "ps" and (self.ps_servers != 1 or self.ps_mode != "sync"):
            raise ConfigError("ps-servers" if self.ps_servers != 1 else "ps-mode", "needs --strategy ps")
        if self.ps_staleness is not None and (self.strategy != "ps" or self.ps_mode != "async"):
            raise ConfigError("ps-staleness", "bounds async training; needs --strategy ps --ps-mode async")
        if self.strategy == "ps":
            for name, changed in (("tp", self.tp > 1), ("pp", self.pp > 1), ("zero", self.zero > 0),
                                  ("precision", self.precision != "fp32"),
                                  ("recompute", self.recompute != "none")):
                if changed:
                    raise ConfigError(name, "must stay at its default with --strategy ps "
                                      "(fp32 replicas of whole parameters; --dp sets the trainers)")

    @property
    def world_size(self) -> int:
        """Processes of the job: dp*pp*tp, or dp trainers + ps_servers servers with strategy ps."""
        return self.dp * self.pp * self.tp + (self.ps_servers if self.strategy == "ps" else 0)

    def layout(self) -> dict[str, Any]:
        """The layout record of the metrics summary (CONTRACT.md)."""
        keys = ("dp", "pp", "tp", "zero", "microbatches", "schedule", "virtual_stages",
                "sequence_parallel", "precision", "recompute", "offload")
        return {k: getattr(self, k) for k in keys}

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}
