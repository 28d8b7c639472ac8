"""Known accelerators: peak throughput per dtype, memory and link speeds (``--gpu NAME``).

Peaks are dense (no sparsity) figures of the vendors' data sheets, TFLOP/s: ``bf16``/``fp16`` on
the matrix units, ``tf32`` the tensor-float matrix rate, ``fp32`` the plain vector rate (what a
run without TF32 gets). Bandwidths are per GPU and direction, bytes/s: ``intra_node_bw`` the
GPU-to-GPU fabric inside a node (NVLink, Infinity Fabric; PCIe when there is none),
``inter_node_bw`` the node's network share of one GPU (e.g. one 400 Gb/s NIC per GPU = 50 GB/s).
``match`` lists fragments of the name CUDA reports (``torch.cuda.get_device_name``), most
specific first, so a detected device finds its row.
"""
from __future__ import annotations

from dataclasses import dataclass

from trainmesh.core.errors import ConfigError


@dataclass(frozen=True)
class GPU:
    """One accelerator model."""

    name: str
    peak_tflops: dict[str, float]
    """Dense peak TFLOP/s per dtype: bf16, fp16, tf32, fp32."""
    mem_bytes: int
    intra_node_bw: float
    inter_node_bw: float
    gpus_per_node: int
    match: tuple[str, ...]
    """Fragments of the CUDA device name that identify it."""

    def peak(self, precision: str) -> float | None:
        """Dense peak TFLOP/s at a training precision (fp32 runs on the plain fp32 rate)."""
        return self.peak_tflops.get(precision)


GB = 10**9
GPUS: dict[str, GPU] = {g.name: g for g in (
    GPU("b200", {"bf16": 2250.0, "fp16": 2250.0, "tf32": 1100.0, "fp32": 80.0}, 180 * GB,
        900e9, 50e9, 8, ("B200",)),
    GPU("h200", {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0}, 141 * GB,
        450e9, 50e9, 8, ("H200",)),
    GPU("h100-pcie", {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.0}, 80 * GB,
        300e9, 25e9, 8, ("H100 PCIe", "H100 NVL")),
    GPU("h100", {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0}, 80 * GB,
        450e9, 50e9, 8, ("H100 80GB HBM3", "H100 SXM", "GH200", "H100")),
    GPU("a100-80gb", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}, 80 * GB,
        300e9, 25e9, 8, ("A100-SXM4-80GB", "A100 80GB")),
    GPU("a100-40gb", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}, 40 * GB,
        300e9, 25e9, 8, ("A100",)),
    GPU("mi300x", {"bf16": 1307.0, "fp16": 1307.0, "tf32": 654.0, "fp32": 163.0}, 192 * GB,
        448e9, 50e9, 8, ("MI300X",)),
    GPU("l40s", {"bf16": 362.0, "fp16": 362.0, "tf32": 183.0, "fp32": 91.6}, 48 * GB,
        32e9, 25e9, 8, ("L40S",)),
    GPU("l4", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}, 24 * GB,
        32e9, 12.5e9, 8, ("L4",)),
    GPU("a10g", {"bf16": 70.0, "fp16": 70.0, "tf32": 35.0, "fp32": 31.2}, 24 * GB,
        16e9, 12.5e9, 8, ("A10G",)),
    GPU("v100", {"fp16": 125.0, "fp32": 15.7}, 32 * GB, 150e9, 12.5e9, 8, ("V100",)),
)}
"""Known accelerators by ``--gpu`` name."""

DEFAULT_GPU = "h100"
"""The planner's accelerator when neither --gpu nor its single figures are given."""


def gpu(name: str, *, flag: str = "--gpu") -> GPU:
    """The table's row for ``name`` (case-insensitive); ConfigError naming the valid names."""
    row = GPUS.get(name.lower())
    if row is None:
        raise ConfigError(flag, f"must be one of {', '.join(GPUS)} (`trainmesh plan --list-gpus`); "
                                f"got {name!r}")
    return row


def detect(device_name: str | None) -> GPU | None:
    """The row of a CUDA device name, or None (CPUs, unlisted GPUs)."""
    if not device_name:
        return None
    for row in GPUS.values():
        if any(fragment in device_name for fragment in row.match):
            return row
    return None


def table_rows() -> list[list[str]]:
    """``trainmesh plan --list-gpus``: one row per GPU, in the units people quote."""
    rows = []
    for g in GPUS.values():
        p = g.peak_tflops
        rows.append([g.name, f"{p.get('bf16', p.get('fp16', 0)):g}", f"{p['tf32']:g}" if "tf32" in p else "-",
                     f"{p['fp32']:g}", f"{g.mem_bytes / GB:g} GB", f"{g.intra_node_bw / GB:g} GB/s",
                     f"{g.inter_node_bw / GB:g} GB/s"])
    return rows


TABLE_HEADER = ["gpu", "bf16/fp16 TFLOP/s", "tf32", "fp32", "memory", "intra-node", "inter-node"]
