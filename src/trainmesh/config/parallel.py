"""Typed configuration: the parallel layout (:class:`ParallelConfig`), validated once.

Every field is settable from a TOML file and from ``trainmesh train`` flags (the flag is the
field name with dashes, ``timeout_s`` is ``--timeout``; :mod:`trainmesh.config.validation`). Every
check of a layout runs here: :func:`~trainmesh.config.validation.check_fields` checks each field's
type and range, ``__post_init__`` the pipeline schedule's rules and then the table of rules
(:mod:`trainmesh.strategies.table`: the axes' degrees and rules and every strategy's). Checks
raise :class:`ConfigError` naming the flag and what would be valid.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

from trainmesh.config.validation import check_fields, setting
from trainmesh.core.errors import ConfigError
from trainmesh.core.layout import Layout
from trainmesh.core.mesh import TIMEOUT_S, ParallelMesh
from trainmesh.strategies import table

SCHEDULES = ("naive", "gpipe", "1f1b", "interleaved", "zb1p")
"""Pipeline schedules the training runtime runs (``trainmesh schedule`` draws the same); the one
list, which :mod:`trainmesh.pipeline_parallel.schedules` builds from."""
GRAD_CLIP = 1.0
"""The gradient-norm clip of ``trainmesh train`` (``--grad-clip``); :class:`ParallelConfig` in
the Python API defaults to no clipping (0.0), as a plain PyTorch loop does (docs/API.md)."""
ZERO3_RESHARD = ("step", "microbatch")
PRECISIONS = ("fp32", "bf16", "fp16")
RECOMPUTE = ("none", "full", "selective")
OFFLOAD = ("none", "cpu", "nvme")
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
MAX_TIMEOUT_S = 7 * 24 * 3600.0
"""Longest collective timeout accepted: a week (torch's timedelta-based timeouts overflow far
beyond; no collective legitimately waits longer)."""
STRATEGIES = ("mesh", "ps", "diloco")
PS_MODES = ("sync", "async")
ALLREDUCE = ("native", "ring", "tree", "naive")
CP_COMM = ("ring", "allgather")


@dataclass
class ParallelConfig:
    """How one training step is split over processes. World size = dp * cp * pp * tp."""

    dp: int = setting(1, "data-parallel degree: replicas, each with a slice of the global batch", ge=1)
    pp: int = setting(1, "pipeline-parallel degree: stages the layers are split into", ge=1)
    tp: int = setting(1, "tensor-parallel degree: ranks each layer's matrices are split across", ge=1)
    cp: int = setting(1, "context-parallel degree: each sequence split over cp ranks (load-balanced: "
                         "rank r holds chunks r and 2cp-1-r of 2cp), attention over the whole "
                         "sequence by passing K/V around the CP group; --seq-len divisible by 2cp", ge=1)
    cp_comm: str = setting("ring", "context parallelism's K/V exchange: ring (blocks passed rank to "
                                   "rank, overlapped with attention) or allgather (gathered once "
                                   "per layer)", choices=CP_COMM)
    ep: int = setting(1, "expert-parallel degree: each MoE layer's experts spread over ep ranks of "
                         "the DP(xCP) group, tokens exchanged by all-to-all; divides --experts (or a "
                         "--model-dir model's experts) and dp*cp", ge=1)
    dp_shard: int | None = setting(None, "HSDP: ZeRO shards over groups of this many DP ranks, "
                                         "replicated across dp/dp-shard groups; divides dp "
                                         "(default dp: plain ZeRO)", ge=1)
    zero: int = setting(0, "ZeRO stage over the DP axis: 0 (DDP), 1 (optimizer states), "
                           "2 (+ gradients), 3 (+ parameters)", choices=(0, 1, 2, 3))
    microbatches: int = setting(1, "gradient accumulation (pp=1) or pipeline microbatches (pp>1)", ge=1)
    min_dp: int | None = setting(None, "elastic resize: the smallest dp the job may shrink to when "
                                       "it loses processes (default --dp: no resize)", ge=1)
    schedule: str = setting("1f1b", "pipeline schedule", choices=SCHEDULES)
    virtual_stages: int = setting(1, "model chunks per pipeline rank (interleaved)", ge=1)
    zero3_reshard: str = setting("step", "ZeRO-3 with pp: step (gather each unit once per step, "
                                         "keep it for every microbatch) or microbatch (gather "
                                         "before every forward and backward)",
                                 choices=ZERO3_RESHARD)
    sequence_parallel: bool = setting(False, "Megatron sequence parallelism inside TP groups")
    precision: str = setting("fp32", "compute precision: fp32, bf16, fp16 (dynamic loss scaling)",
                             choices=PRECISIONS, group="precision & memory")
    reduce_dtype: str | None = setting(None, "dtype gradients are reduced in: fp32 or the compute "
                                             "dtype (default)", group="precision & memory")
    recompute: str = setting("none", "activation recomputation: none, full (keep layer inputs) or "
                                     "selective (attention internals)", choices=RECOMPUTE,
                                     group="precision & memory")
    recompute_segment: int = setting(1, "with full: recompute K layers from every K-th layer's input", ge=1,
                                     group="precision & memory")
    offload: str = setting("none", "ZeRO >= 1: fp32 masters and optimizer states off the device, "
                                   "stepped on the CPU: none, cpu (host memory) or nvme (files)",
                           choices=OFFLOAD, group="precision & memory")
    offload_dir: str | None = setting(None, "directory for nvme offload files (default: a fresh "
                                            "one under the system temp dir, removed at exit)", path=True,
                                            group="precision & memory")
    offload_params: bool = setting(False, "ZeRO-3 with offload: parameter shards in host memory "
                                          "too, gathered to the device per unit", group="precision & memory")
    bucket_mb: float = setting(25.0, "gradient bucket size in MiB (DDP all-reduce, ZeRO "
                                     "reduce-scatter)", gt=0, group="precision & memory")
    grad_clip: float = setting(0.0, "global gradient-norm clip, 0 = off (the norm is still "
                                    f"measured); {GRAD_CLIP:g} for trainmesh train, 0 in the "
                                    "Python API", ge=0, group="optimisation")
    timeout_s: float = setting(TIMEOUT_S, "every collective's timeout in seconds", flag="--timeout",
                               gt=0, le=MAX_TIMEOUT_S, group="launch")
    compile: bool = setting(False, "torch.compile each transformer block / pipeline layer "
                                   "(collectives stay outside the graphs)", group="precision & memory")
    compile_backend: str = setting("inductor", "--compile's backend: inductor (generates kernels; "
                                               "a C++ compiler on CPU, triton on CUDA), aot_eager "
                                               "(captures forward and backward graphs and runs them "
                                               "eagerly: no code generated) or eager (capture only)",
                                   choices=COMPILE_BACKENDS, group="precision & memory")
    find_unused_parameters: bool = setting(False)
    """Parameters that received no gradient in a step are allowed instead of raising an error:
    one no DP rank used gets no update that step (its gradient is None, as DDP's
    ``find_unused_parameters``; at every ZeRO stage its value, states and own step count stay
    as they were); one used on some ranks is reduced as usual (API only; the engine sets it for
    the built-in MoE, whose experts without tokens get no gradient)."""
    broadcast_buffers: bool = setting(True)
    """Buffers (e.g. BatchNorm running statistics) are broadcast from the DP root at start and
    before every forward with gradients, as DDP's ``broadcast_buffers`` (API only)."""
    zero3_units: "Sequence[str | type] | Callable[[str, Any], bool] | None" = setting(None)
    """ZeRO-3: which modules are units — module names, module classes, or a predicate
    ``(name, module) -> bool`` (None: each child of the model's largest ``nn.ModuleList`` and
    the other modules that run once; API only)."""
    # -- parameter server and all-reduce algorithms
    strategy: str = setting("mesh", "mesh (dp x cp x pp x tp), ps (RPC parameter server: --dp trainers, "
                                    "--ps-servers servers) or diloco (replicas - each dp index, or each "
                                    "--dp-shard group under ZeRO - taking --inner-steps local "
                                    "steps between synchronisations)",
                            choices=STRATEGIES)
    ps_servers: int = setting(1, "parameter-server processes (strategy ps); parameters are sharded "
                                 "across them by bytes", ge=1)
    ps_mode: str = setting("sync", "sync (servers average every trainer's gradients of a step) or "
                                   "async (Hogwild-style; strategy ps)", choices=PS_MODES)
    ps_staleness: int | None = setting(None, "async: most steps a trainer may run ahead of the "
                                             "slowest (0 = sync; default unbounded)", ge=0)
    inner_steps: int = setting(500, "DiLoCo: local optimizer steps of each replica between two "
                                    "synchronisations (H)", ge=1)
    outer_lr: float = setting(0.7, "DiLoCo: learning rate of the outer Nesterov-SGD step", gt=0)
    outer_momentum: float = setting(0.9, "DiLoCo: momentum of the outer Nesterov-SGD step (0 = "
                                         "plain SGD; below 1)", ge=0)
    fault_tolerant: bool = setting(False, "DP replicas survive the loss of a replica without a "
                                          "restart: a per-step quorum; a failed step is redone by "
                                          "those present, a replaced replica rejoins from a peer's "
                                          "live state", group="launch")
    allreduce: str = setting("native", "DDP's bucket reduction: native (the backend's), ring, tree "
                                       "or naive", choices=ALLREDUCE)

    def __post_init__(self) -> None:
        check_fields(self)
        check_pipeline(self.schedule, pp=self.pp, microbatches=self.microbatches,
                       virtual_stages=self.virtual_stages)
        # the degrees, the axes' rules and every strategy's (with the model's and the run's
        # facts: TrainConfig)
        table.check(self)
        if self.zero3_units is not None and self.zero != 3:   # the Python API's own field
            raise ConfigError("zero3_units", f"chooses ZeRO-3's units; needs zero=3 (got zero={self.zero})")

    @property
    def replica_ranks(self) -> int:
        """--fault-tolerant: the ranks of one replica (its unit of failure): cp x pp x tp ranks
        for each of its dp indices (the shard group of --dp-shard under ZeRO, else one)."""
        return self.replica_dp * self.layout.world // self.dp

    @property
    def replica_dp(self) -> int:
        """--fault-tolerant: the dp indices of one replica (--dp-shard under ZeRO, else one)."""
        return self.shard_size if self.zero > 0 else 1

    @property
    def replicas(self) -> int:
        """--fault-tolerant: how many replicas stand in for each other (dp / replica_dp)."""
        return self.dp // self.replica_dp

    @property
    def layout(self) -> Layout:
        """The degrees of this config (dp, pp, tp, cp, ep, dp_shard) as one :class:`Layout`:
        its world, coordinates, groups and text."""
        return Layout.of(self)

    def build_mesh(self) -> ParallelMesh:
        """The mesh of this layout (a collective call: every rank builds it, in the same order)."""
        return ParallelMesh(self.layout, timeout_s=self.timeout_s)

    @property
    def shard_size(self) -> int:
        """Ranks ZeRO shards over: --dp-shard, else dp."""
        return self.layout.dp_shard

    @property
    def microbatch_multiple(self) -> int:
        """The microbatch count must be a multiple of this: pp with the interleaved schedule."""
        return microbatch_multiple(self.schedule, self.pp)

    @property
    def world_size(self) -> int:
        """Processes of the job: dp*cp*pp*tp, or dp trainers + ps_servers servers with strategy ps."""
        return self.layout.world + (self.ps_servers if self.strategy == "ps" else 0)

    def layout_record(self) -> dict[str, Any]:
        """The layout record of the metrics summary (docs/METRICS.md): the degrees (dp_shard
        resolved) and the settings that shape a step."""
        degrees = self.layout.as_dict()
        keys = ("zero", "microbatches", "schedule", "virtual_stages", "sequence_parallel",
                "precision", "recompute", "offload", "zero3_reshard", "strategy")
        if self.strategy == "diloco":
            keys += ("inner_steps", "outer_lr", "outer_momentum")
        shard = degrees.pop("dp_shard")   # last, where the record has always had it
        return {**degrees, **{k: getattr(self, k) for k in keys}, "dp_shard": shard}

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}


def microbatch_multiple(schedule: str, pp: int) -> int:
    """Interleaved 1F1B runs microbatches in rounds of pp: their count is a multiple of this."""
    return pp if schedule == "interleaved" else 1


def check_pipeline(schedule: str, *, pp: int, microbatches: int, virtual_stages: int) -> None:
    """The rules of a pipeline schedule, for the flags and for schedules built directly
    (:func:`~trainmesh.pipeline_parallel.schedules.build_schedule`). Raises ConfigError."""
    if schedule not in SCHEDULES:
        raise ConfigError("--schedule", f"must be one of {', '.join(SCHEDULES)}; got {schedule!r}")
    if virtual_stages > 1 and schedule != "interleaved":
        raise ConfigError("--virtual-stages", f"> 1 needs --schedule interleaved; got {virtual_stages} "
                          f"with {schedule} (valid with it: 1)")
    multiple = microbatch_multiple(schedule, pp)
    if microbatches % multiple:
        raise ConfigError("--microbatches", f"with --schedule interleaved must be a multiple of --pp "
                          f"({pp}): microbatches go through the chunks in rounds of pp; got {microbatches}")
