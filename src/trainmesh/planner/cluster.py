"""The machines a plan runs on: GPU count, node size, memory, link and compute speeds.

Every number the time model uses is a field here with its default stated, so a user can see
(and a caller can change) what the estimate assumes:

* ``intra_node_bw`` / ``inter_node_bw`` are per-GPU bus bandwidths in bytes/s. A collective whose
  group spans more than one node runs at ``inter_node_bw`` (the slowest link of a ring sets its
  pace); a group inside one node at ``intra_node_bw``.
* ``peak_flops`` is one GPU's dense 16-bit tensor throughput (default 989e12, an H100 SXM);
  fp32 training is assumed to run on TF32 tensor cores at half of it. ``efficiency`` is the
  fraction of peak the model's matmuls reach (compute only: pipeline bubbles and exposed
  communication are modelled on top). None (the default) takes it from the table of published
  runs for ``gpu`` and the model's size (:mod:`.efficiency`); ``trainmesh plan --calibrate``
  takes it from a measured run.
* ``pcie_bw`` and ``cpu_optimizer_params_per_s`` price CPU offload: the gradient/parameter
  copies between GPU and host and the host optimizer step (per GPU's share of the host);
  ``nvme_bw`` prices NVMe offload: the optimizer states read and written back every step.
* ``framework_overhead_bytes`` (default 1 GiB) stands for the CUDA context, NCCL buffers and
  cuBLAS workspaces, which every layout pays outside the allocator's count;
  ``fragmentation`` is the caching allocator's reserved over allocated bytes on the dynamic
  memory (:data:`~.peak.CUDA_FRAGMENTATION`); ``memory_scale`` a calibrated run's measured over
  predicted dynamic memory (1 without ``--calibrate``).
"""
from __future__ import annotations

from dataclasses import dataclass

from trainmesh.core.errors import ConfigError

from .peak import CUDA_FIXED, CUDA_FRAGMENTATION


@dataclass(frozen=True)
class Cluster:
    """``gpus`` GPUs in nodes of ``gpus_per_node``; TP groups never leave a node."""

    gpus: int
    """Total GPUs (world size of the layouts considered)."""
    gpus_per_node: int = 8
    """GPUs per node; a single partial node (gpus < gpus_per_node) is allowed."""
    gpu_mem_bytes: int = 80 * 10**9
    """Memory of one GPU, bytes."""
    intra_node_bw: float = 300e9
    """Per-GPU bandwidth inside a node (NVLink class), bytes/s."""
    inter_node_bw: float = 25e9
    """Per-GPU bandwidth between nodes (InfiniBand/RoCE class), bytes/s."""
    peak_flops: float = 989e12
    """Dense 16-bit peak of one GPU, FLOP/s (fp32 runs at half: TF32)."""
    efficiency: float | None = None
    """Achieved fraction of peak for the model's matmuls (None: from the published runs, by
    ``gpu`` and model size, :func:`~.efficiency.assumed_efficiency`)."""
    gpu: str = "h100"
    """The accelerator's name in :data:`trainmesh.core.gpus.GPUS` (which published runs apply)."""
    pcie_bw: float = 25e9
    """GPU <-> host copy bandwidth per GPU (offload), bytes/s."""
    cpu_optimizer_params_per_s: float = 1e9
    """Parameters per second one GPU's share of the host updates with Adam (offload)."""
    nvme_bw: float = 3e9
    """NVMe read (and write) bandwidth of one GPU's share of the node's drives, bytes/s."""
    framework_overhead_bytes: int = CUDA_FIXED
    """Per-GPU memory every layout pays outside the allocator: CUDA context, NCCL, workspaces."""
    fragmentation: float = CUDA_FRAGMENTATION
    """Reserved over allocated bytes of the dynamic memory (:mod:`.peak`)."""
    memory_scale: float = 1.0
    """Measured over predicted dynamic memory of a calibration run (``--calibrate``)."""

    def __post_init__(self) -> None:
        if self.gpus < 1:
            raise ConfigError("--gpus", f"must be a positive integer; got {self.gpus}")
        if self.gpus_per_node < 1:
            raise ConfigError("--gpus-per-node", f"must be a positive integer; got {self.gpus_per_node}")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise ConfigError("--gpus", f"{self.gpus} GPUs do not fill whole nodes of "
                                        f"--gpus-per-node {self.gpus_per_node}; give a multiple of it")
        for name, value in (("--gpu-mem", self.gpu_mem_bytes), ("--intra-node-bw", self.intra_node_bw),
                            ("--inter-node-bw", self.inter_node_bw), ("peak_flops", self.peak_flops),
                            ("pcie_bw", self.pcie_bw),
                            ("cpu_optimizer_params_per_s", self.cpu_optimizer_params_per_s),
                            ("nvme_bw", self.nvme_bw)):
            if not value > 0:
                raise ConfigError(name, f"must be > 0; got {value}")
        if self.efficiency is not None and not 0 < self.efficiency <= 1:
            raise ConfigError("efficiency", f"must be in (0, 1]; got {self.efficiency}")
        if self.fragmentation < 1 or not self.memory_scale > 0:
            raise ConfigError("fragmentation", f"must be >= 1 (memory scale > 0); got "
                              f"{self.fragmentation}, {self.memory_scale}")

    @property
    def node_size(self) -> int:
        """GPUs in one node as used here (the whole cluster when it is a partial node)."""
        return min(self.gpus, self.gpus_per_node)

    @property
    def nodes(self) -> int:
        return max(1, self.gpus // self.node_size)

    def spans_nodes(self, span: int) -> bool:
        """Whether a group whose ranks cover ``span`` consecutive world ranks leaves a node."""
        return span > self.node_size

    def bandwidth(self, span: int) -> float:
        """Per-GPU bandwidth of a group covering ``span`` consecutive ranks."""
        return self.inter_node_bw if self.spans_nodes(span) else self.intra_node_bw

    def flops_per_s(self, precision: str) -> float:
        """Achieved FLOP/s of one GPU at ``precision`` (fp32 = TF32 at half the 16-bit peak)."""
        if self.efficiency is None:
            raise ConfigError("efficiency", "is not set: plan() resolves it from the published runs")
        peak = self.peak_flops / 2 if precision == "fp32" else self.peak_flops
        return peak * self.efficiency
